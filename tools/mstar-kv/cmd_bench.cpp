// Copyright mstar-kv authors.
//
// `mstar-kv bench`: every built engine against the physical limit (the
// fastest copy of the same pieces this machine makes), the transport's own best
// (ucx_perftest, iperf3) and the peer (Mooncake's transfer_engine_bench), in
// one run. See bench/README.md for the commands and the latest numbers.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "args.hpp"
#include "bench_external.hpp"
#include "bench_report.hpp"
#include "bench_run.hpp"
#include "bench_server.hpp"
#include "bench_tcp.hpp"
#include "bench_workload.hpp"
#include "commands.hpp"
#include "layout_args.hpp"
#include "mstar/kv/kv.hpp"
#include "util/parse.hpp"

namespace mstar::kv::cli {

namespace {

using namespace bench;

const char* kHelp =
    "usage: mstar-kv bench [options]\n"
    "\n"
    "Measures every built engine (local, shm, ucx over tcp and sm, mooncake, cuda_ipc)\n"
    "on KV workloads from real models and on raw piece/batch sweeps, each beside its\n"
    "baseline measured in the same run: the fastest copy of the same copy spans\n"
    "(memcpy or non-temporal stores, on each thread count up to the cores, threads\n"
    "started and pages touched before timing); for UCX over TCP ucx_perftest\n"
    "stream_bw at the same message size; plus\n"
    "iperf3 (raw TCP) and Mooncake's transfer_engine_bench (64 KiB x 128 reads).\n"
    "The Python package is measured by bench/python_bench.py (Python vs C++ pulls,\n"
    "per-call overhead, Mooncake through its wheel; see bench/README.md).\n"
    "With no options: the default suite (under two minutes on 2 cores).\n"
    "\n"
    "selection:\n"
    "  --suite NAME        default, full or tiny\n"
    "  --engine LIST       comma-separated engines or variants (local, shm, shm-cma,\n"
    "                      shm-cma-layers, ucx, ucx-tcp, ucx-sm, ucx-tcp-layers,\n"
    "                      ucx-tcp-staged, ucx-tcp-device, mooncake, cuda_ipc,\n"
    "                      cuda_ipc-kernel, peers = external references only); shm-cma:\n"
    "                      the prefill cache in private memory, read by cross-memory\n"
    "                      attach; *-layers: both caches one region per layer;\n"
    "                      ucx-tcp-staged: host caches through staging buffers;\n"
    "                      ucx-tcp-device: GPU caches (staged); cuda_ipc-kernel: the\n"
    "                      copy kernel whatever the build's default copy path\n"
    "  --case SUBSTR       only cases whose name contains SUBSTR\n"
    "  one model case instead of a suite:\n"
    "  --model NAME --tokens N [--page-size N] [--table scattered|contiguous]\n"
    "  [--prefix-hit F] [--cache-order O] [--page-order O]\n"
    "  [--remote-cache-order O] [--remote-page-order O]\n"
    "  [--remote-page-size N] [--remote-tp M --local-tp N --local-rank R]\n"
    "                      a prefill cache of another geometry: page size, and a\n"
    "                      decode rank of TP=N reading its heads from a TP=M rank\n"
    "                      (M <= N); the memcpy baseline then copies the same bytes\n"
    "                      contiguously\n"
    "  raw cases instead of a suite:\n"
    "  --piece LIST        piece sizes in bytes (multiples of 4096), e.g. 4096,65536\n"
    "  --batch LIST        reads per request (default 128)\n"
    "\n"
    "measurement:\n"
    "  --repeat N          repetitions; median [min, max] is reported (default 3)\n"
    "  --threads N         engine workers (default: the hardware threads)\n"
    "  --min-time S        seconds per repetition and side (default 0.15)\n"
    "  --timeout-ms N      engine timeout per read (default 30000)\n"
    "  --engine-opt K=V,.. engine-specific options (EngineOptions::extra)\n"
    "  --max-mem-gib N     skip cases needing more host memory (default 6)\n"
    "  --no-external       skip ucx_perftest, iperf3 and the peers (Mooncake's\n"
    "                      transfer_engine_bench, NIXL over UCX tcp)\n"
    "  --mooncake-duration S  transfer_engine_bench seconds (default 5)\n"
    "  --mooncake-sizes W  the peers' sizes: default (64 KiB x 128 only), all (every\n"
    "                      raw case) or none\n"
    "  --mooncake-lib PATH libtransfer_engine.so for the mooncake engine (else\n"
    "                      $MSTAR_KV_MOONCAKE_LIB or the loader's search path)\n"
    "  --no-verify         do not check the bytes after the warm-up request\n"
    "  --epoch-ab          also pull with page epoch checks off, alternating with the\n"
    "                      checked pulls in the same case (measures what they cost)\n"
    "  --epoch-ab-control  the same with checks on for both sides: the method's bias\n"
    "  --with-plain        before each case of mixed geometry, the same request between\n"
    "                      caches of the local geometry (NAME/plain); a note gives the\n"
    "                      ratio of the two\n"
    "\n"
    "output:\n"
    "  --json FILE|-       every case with ratio_to_baseline\n"
    "  --csv FILE|-\n"
    "  --plot FILE.svg     bandwidth vs piece size per engine, baselines dashed\n"
    "  --quiet             no progress bar (it is drawn only on a terminal anyway)\n";

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) throw Error(StatusCode::kUnavailable, "cannot read /proc/self/exe");
  buf[n] = '\0';
  return buf;
}

// Writes `fn`'s output to a file or, for "-", to stdout.
template <typename Fn>
void write_to(const std::string& path, Fn&& fn) {
  if (path == "-") {
    fn(stdout);
    std::fflush(stdout);
    return;
  }
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) throw Error(StatusCode::kInvalidArgument, "cannot write " + path);
  fn(f);
  if (std::fclose(f) != 0) throw Error(StatusCode::kInternal, "cannot write " + path);
}

std::vector<Workload> select_workloads(const Args& args) {
  std::vector<Workload> ws;
  if (args.has("piece") || (args.has("batch") && !args.has("model"))) {
    std::vector<std::uint64_t> pieces = {65536};
    if (args.has("piece")) {
      pieces.clear();
      for (const auto& p : split(args.str("piece", ""), ','))
        pieces.push_back(util::parse_u64(p, "--piece"));
    }
    std::vector<std::uint32_t> batches = {128};
    if (args.has("batch")) {
      batches.clear();
      for (const auto& b : split(args.str("batch", ""), ',')) {
        batches.push_back(
            static_cast<std::uint32_t>(util::parse_u64(b, "--batch", 0, 0xffffffffu)));
      }
    }
    for (auto p : pieces) {
      for (auto b : batches)
        ws.push_back(raw_workload(p, b, batches.size() > 1 ? "batch" : "piece"));
    }
  } else if (args.has("model") || args.has("tokens")) {
    const std::string table = args.str("table", "scattered");
    if (table != "scattered" && table != "contiguous") {
      throw Error(StatusCode::kInvalidArgument,
                  "--table wants scattered or contiguous, got '" + table + "'");
    }
    const CacheOrder co = parse_cache_order(args.str("cache-order", "layer"));
    const PageOrder po = parse_page_order(args.str("page-order", "nhd"));
    ws.push_back(model_workload(
        args.str("model", "llama3-8b"), static_cast<std::uint32_t>(args.u64("page-size", 16)),
        args.u64("tokens", 4096),
        table == "scattered" ? PageTable::kScattered : PageTable::kContiguous,
        args.f64("prefix-hit", 0.0), co,
        args.has("remote-cache-order") ? parse_cache_order(args.str("remote-cache-order", "")) : co,
        po,
        args.has("remote-page-order") ? parse_page_order(args.str("remote-page-order", "")) : po));
    set_geometry(ws.back(), geometry_from_args(args));
  } else {
    ws = suite(args.str("suite", "default"));
  }
  if (args.flag("with-plain")) {
    std::vector<Workload> with;
    for (auto& w : ws) {
      if (w.mixed_geometry()) with.push_back(plain_twin(w));
      with.push_back(std::move(w));
    }
    ws = std::move(with);
  }
  if (args.has("case")) {
    const std::string sub = args.str("case", "");
    std::vector<Workload> kept;
    for (auto& w : ws) {
      if (w.name.find(sub) != std::string::npos) kept.push_back(std::move(w));
    }
    ws = std::move(kept);
  }
  return ws;
}

// Variants to run, and whether the external peers are wanted.
std::vector<EngineVariant> select_variants(const Args& args, bool* peers, Report& report) {
  const std::vector<EngineTraits> table = engine_table();
  const std::vector<EngineVariant> all = engine_variants(table);
  if (!args.has("engine")) {
    *peers = true;
    return all;
  }
  std::vector<EngineVariant> out;
  *peers = false;
  std::set<std::string> known = {"peers"};
  for (const EngineTraits& e : table) {
    known.insert(e.name);
    for (const LoopbackSetup& setup : e.loopback) known.insert(setup.name);
  }
  for (const std::string& name : split(args.str("engine", ""), ',')) {
    if (name == "peers") {
      *peers = true;
      continue;
    }
    bool found = false;
    for (const auto& v : all) {
      if (v.name == name || v.engine == name) {
        found = true;
        // An engine's name selects all its variants: each once.
        if (std::any_of(out.begin(), out.end(),
                        [&](const EngineVariant& o) { return o.name == v.name; })) {
          continue;
        }
        out.push_back(v);
        if (v.crosses_hosts) *peers = true;
      }
    }
    if (!found) {
      if (known.count(name) == 0) {
        throw Error(StatusCode::kInvalidArgument,
                    "--engine: unknown engine '" + name +
                        "' (known: " + joined({known.begin(), known.end()}) + ")");
      }
      report.notes.push_back("engine '" + name + "' is not built into this mstar-kv (built: " +
                             joined(built_engines()) + "); not measured");
    }
  }
  return out;
}

// ucx_perftest runs at the case's message size, up to this (a contiguous
// request is one 512 MiB span; at that size the tool only measures TCP).
constexpr std::uint64_t kMaxPerftestMessage = 16u << 20;

}  // namespace

int cmd_bench(int argc, char** argv) {
  // A server that dies must show up as an error of its case, not kill us.
  std::signal(SIGPIPE, SIG_IGN);
  if (argc >= 1 && std::string(argv[0]) == "--internal-serve") {
    return serve_main(argc - 1, argv + 1);
  }
  Args args(
      argc, argv,
      {"help", "quiet", "no-external", "no-verify", "epoch-ab", "epoch-ab-control", "with-plain"},
      {"suite",
       "engine",
       "case",
       "model",
       "tokens",
       "page-size",
       "table",
       "prefix-hit",
       "cache-order",
       "page-order",
       "remote-cache-order",
       "remote-page-order",
       "piece",
       "remote-page-size",
       "local-tp",
       "local-rank",
       "remote-tp",
       "batch",
       "repeat",
       "threads",
       "min-time",
       "timeout-ms",
       "engine-opt",
       "max-mem-gib",
       "mooncake-duration",
       "mooncake-sizes",
       "mooncake-lib",
       "json",
       "csv",
       "plot"});
  if (args.flag("help")) {
    std::printf("%s", kHelp);
    return 0;
  }
  if (!args.positional().empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "bench takes no positional arguments, got '" + args.positional()[0] + "'");
  }
  Report report;
  report.date = utc_now();
  report.nproc = std::max(1u, std::thread::hardware_concurrency());
  report.suite = args.has("piece") || args.has("model") || args.has("tokens") || args.has("batch")
                     ? "custom"
                     : args.str("suite", "default");
  report.engines_built = built_engines();

  RunOptions ro;
  // The default follows the cores, within the limit --threads has.
  ro.threads = static_cast<std::uint32_t>(args.u64("threads", std::min(report.nproc, 256u)));
  ro.repeat = static_cast<std::uint32_t>(args.u64("repeat", 3));
  ro.min_time_s = args.f64("min-time", 0.15);
  ro.timeout = std::chrono::milliseconds(args.u64("timeout-ms", 30000));
  ro.verify = !args.flag("no-verify");
  ro.epoch_ab_control = args.flag("epoch-ab-control");
  ro.epoch_ab = args.flag("epoch-ab") || ro.epoch_ab_control;
  ro.self_exe = self_exe();
  if (ro.threads == 0 || ro.threads > 256) {
    throw Error(StatusCode::kInvalidArgument,
                "--threads " + std::to_string(ro.threads) + " outside [1, 256]");
  }
  if (ro.repeat == 0 || ro.repeat > 1000) {
    throw Error(StatusCode::kInvalidArgument,
                "--repeat " + std::to_string(ro.repeat) + " outside [1, 1000]");
  }
  for (const auto& kv : split(args.str("engine-opt", ""), ',')) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos) {
      throw Error(StatusCode::kInvalidArgument, "--engine-opt wants KEY=VALUE, got '" + kv + "'");
    }
    ro.engine_extra[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  report.threads = ro.threads;
  report.repeat = ro.repeat;
  report.min_time_s = ro.min_time_s;
  const double max_mem = args.f64("max-mem-gib", 6.0) * 1073741824.0;
  const int mc_duration = static_cast<int>(args.u64("mooncake-duration", 5));
  const std::string mc_sizes = args.str("mooncake-sizes", "default");
  if (mc_sizes != "default" && mc_sizes != "all" && mc_sizes != "none") {
    throw Error(StatusCode::kInvalidArgument,
                "--mooncake-sizes wants default, all or none, got '" + mc_sizes + "'");
  }
  const bool external = !args.flag("no-external");

  const std::vector<Workload> workloads = select_workloads(args);
  bool peers = false;
  std::vector<EngineVariant> variants = select_variants(args, &peers, report);
  if (external) {
    // Over TCP ucx_perftest is the baseline; skip the memcpy one to save time.
    for (auto& v : variants) {
      if (v.over_tcp) v.memcpy_baseline = false;
    }
  }
  if (args.has("mooncake-lib")) {
    for (auto& v : variants) {
      const std::string key = engine_traits(v.engine).library_option;
      if (!key.empty()) v.extra[key] = args.str("mooncake-lib", "");
    }
  }
  peers = peers && external;

  Progress progress(variants.size() * workloads.size(), ::isatty(2) != 0 && !args.flag("quiet"));
  ro.progress = [&](const std::string& s) { progress.status(s); };

  // ---- engines -------------------------------------------------------------------
  for (const EngineVariant& v : variants) {
    std::string unavailable;  // once an engine cannot run here, skip the rest
    for (const Workload& w : workloads) {
      progress.set_label(v.name + "  " + w.name);
      if (w.same_host_only && v.crosses_hosts) {
        CaseResult r;
        r.engine = v.name;
        r.workload = w;
        r.skipped = true;
        r.error =
            "the default suite runs this large request on same-host engines only (time "
            "budget); run it with --engine " +
            v.name + " --model " + w.model + " --tokens " + std::to_string(w.tokens) +
            " --page-size " + std::to_string(w.local.page_size);
        report.cases.push_back(r);
        progress.step();
        continue;
      }
      if (!unavailable.empty()) {
        CaseResult r;
        r.engine = v.name;
        r.workload = w;
        r.skipped = true;
        r.error = unavailable;
        report.cases.push_back(r);
        progress.step();
        continue;
      }
      const double need = static_cast<double>(w.local.total_bytes()) +
                          2.0 * static_cast<double>(w.remote.total_bytes());
      if (need > max_mem) {
        CaseResult r;
        r.engine = v.name;
        r.workload = w;
        r.skipped = true;
        char buf[160];
        std::snprintf(buf, sizeof buf, "needs %.1f GiB of host memory, over --max-mem-gib %.1f",
                      need / 1073741824.0, max_mem / 1073741824.0);
        r.error = buf;
        report.cases.push_back(r);
      } else {
        const auto t0 = std::chrono::steady_clock::now();
        report.cases.push_back(run_case(v, w, ro));
        report.cases.back().wall_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (report.cases.back().skipped) unavailable = report.cases.back().error;
      }
      progress.step();
    }
  }

  // Mixed geometry beside the same request unconverted (--with-plain).
  note_plain_twins(report);

  // ---- the transports' own best and the peers --------------------------------------
  if (external) {
    std::set<std::string> over_tcp;  // the variants whose bytes cross a TCP socket
    for (const EngineVariant& v : variants) {
      if (v.over_tcp) over_tcp.insert(v.name);
    }
    // ucx_perftest at each message size a UCX case used, cached per (tls, size).
    std::map<std::pair<std::string, std::uint64_t>, std::optional<Stat>> perftest;
    std::map<std::pair<std::string, std::uint64_t>, std::string> perftest_err;
    const std::uint32_t ext_repeat = std::min<std::uint32_t>(ro.repeat, 3);
    auto ucx_perf = [&](const std::string& tls, std::uint64_t size) -> std::optional<Stat> {
      const auto key = std::make_pair(tls, size);
      if (auto it = perftest.find(key); it != perftest.end()) return it->second;
      progress.set_label("ucx_perftest stream_bw " + tls + " " + std::to_string(size) + " B");
      std::vector<double> g;
      for (std::uint32_t i = 0; i < ext_repeat; ++i) {
        const ExternalResult er = run_ucx_perftest(tls, "stream_bw", size);
        if (!er.ok) {
          perftest_err[key] = er.error;
          break;
        }
        g.push_back(er.gbps);
      }
      std::optional<Stat> s;
      if (!g.empty()) s = make_stat(g);
      perftest[key] = s;
      return s;
    };
    // Over TCP the transport's own best is the limit, not memcpy. (For
    // ucx-sm memcpy is the limit: ucx_perftest re-sends one cache-hot buffer.)
    for (CaseResult& c : report.cases) {
      if (!c.ok || c.piece_bytes == 0) continue;
      if (over_tcp.count(c.engine) == 0) continue;
      const std::uint64_t size = std::min(c.piece_bytes, kMaxPerftestMessage);
      const auto s = ucx_perf("tcp", size);
      const std::string name = "ucx_perftest stream_bw tcp " + size_name(size);
      if (!s) {
        report.notes.push_back(c.engine + " " + c.workload.name + ": no " + name +
                               " baseline: " + perftest_err[{"tcp", size}]);
        continue;
      }
      c.extra["ucx_perftest_stream_bw_tcp"] = s->median;
      c.baseline_name = name;
      c.baseline_gbps = *s;
      c.ratio = s->median > 0 ? std::optional<double>(c.gbps.median / s->median) : std::nullopt;
    }
    // Beside plain TCP: small requests against one round trip of their
    // bytes, large ones against one stream of them (bench_tcp.hpp).
    note_tcp_floors(report, over_tcp, progress);
    if (peers) {
      // One stream with 1 MiB writes: the wire's best here (iperf3's default
      // 128 KiB writes carry less than half of it on some machines).
      progress.set_label("iperf3 tcp loopback");
      const ExternalResult ip = run_iperf3(2.0, 1u << 20);
      report.references.push_back({"iperf3 tcp loopback (1 stream, 1 MiB writes)", ip.ok, ip.gbps,
                                   ip.ok ? ip.command : ip.error});
      for (CaseResult& c : report.cases) {
        if (ip.ok && c.ok && over_tcp.count(c.engine) != 0) {
          c.extra["iperf3_tcp"] = ip.gbps;
          // Every case whose bytes cross TCP (LoopbackSetup::over_tcp).
          if (ip.gbps > 0) {
            char line[256];
            std::snprintf(
                line, sizeof line, "%s %s: %.2f GB/s = %.2f of iperf3 (1 stream, 1 MiB writes)",
                c.engine.c_str(), c.workload.name.c_str(), c.gbps.median, c.gbps.median / ip.gbps);
            report.notes.push_back(line);
          }
        }
      }
      // The peers (Mooncake's transfer_engine_bench, NIXL) at the raw cases'
      // block and batch sizes (--mooncake-sizes).
      std::set<std::pair<std::uint64_t, std::uint32_t>> sizes;
      if (mc_sizes != "none") sizes.insert({65536, 128});
      if (mc_sizes == "all") {
        for (const auto& w : workloads) {
          if (w.model == "raw") sizes.insert({w.piece_bytes, w.batch});
        }
      }
      std::string why_not;
      const std::string te = sizes.empty() ? "" : find_mooncake_bench(&why_not);
      if (!sizes.empty() && te.empty()) {
        report.references.push_back({"Mooncake transfer_engine_bench", false, 0, why_not});
      }
      // A peer's row at a raw case's block and batch, beside ucx_perftest over
      // TCP, and the ratio of each of our TCP cases of that size to it.
      auto peer_row = [&](const std::string& peer, const std::string& what, std::uint64_t block,
                          std::uint32_t batch, const ExternalResult& er) {
        CaseResult r;
        r.engine = peer;
        r.workload = raw_workload(block, batch, "piece");
        if (!er.ok) {
          r.error = er.error;
          r.skipped = true;  // a reference that did not run, not a failure of ours
          report.cases.push_back(r);
          return;
        }
        r.ok = true;
        r.gbps = Stat{er.gbps, er.gbps, er.gbps};
        r.requests_per_s = er.gbps * 1e9 / static_cast<double>(block * batch);  // batches/s
        r.piece_bytes = block;
        r.reads = batch;
        r.copies = batch;
        r.extra[peer] = er.gbps;
        if (const auto st = ucx_perf("tcp", block)) {
          r.baseline_name = "ucx_perftest stream_bw tcp " + size_name(block);
          r.baseline_gbps = *st;
          r.ratio = r.gbps.median / st->median;
        }
        report.notes.push_back(what + ": " + er.command + " -> " + std::to_string(er.gbps) +
                               " GB/s");
        for (CaseResult& c : report.cases) {
          if (c.ok && c.engine != peer && c.workload.model == "raw" &&
              c.workload.piece_bytes == block && c.workload.batch == batch &&
              over_tcp.count(c.engine) != 0) {
            c.extra[peer] = er.gbps;
            char buf[160];
            std::snprintf(buf, sizeof buf, "%s %s: %.2fx %s", c.engine.c_str(),
                          c.workload.name.c_str(), c.gbps.median / er.gbps, what.c_str());
            report.notes.push_back(buf);
          }
        }
        report.cases.push_back(r);
      };
      for (const auto& [block, batch] : sizes) {
        if (te.empty()) break;
        progress.set_label("Mooncake transfer_engine_bench " + size_name(block));
        peer_row("mooncake_te_bench", "Mooncake transfer_engine_bench", block, batch,
                 run_mooncake_bench(te, block, batch, 1, mc_duration));
      }
      // NVIDIA NIXL (PyPI wheel, UCX backend, DRAM) over the same TCP.
      for (const auto& [block, batch] : sizes) {
        progress.set_label("NIXL READ over UCX tcp " + size_name(block));
        peer_row("nixl_ucx_tcp", "NIXL over UCX tcp", block, batch,
                 run_nixl_peer("tcp", block, batch, 200));
      }
    }
  }
  progress.finish();

  // ---- output --------------------------------------------------------------------
  const bool stdout_taken = args.str("json", "") == "-" || args.str("csv", "") == "-";
  print_table(stdout_taken ? stderr : stdout, report);
  if (args.has("json"))
    write_to(args.str("json", ""), [&](std::FILE* f) { write_json(f, report); });
  if (args.has("csv")) write_to(args.str("csv", ""), [&](std::FILE* f) { write_csv(f, report); });
  if (args.has("plot")) write_to(args.str("plot", ""), [&](std::FILE* f) { write_svg(f, report); });
  for (const auto& c : report.cases) {
    if (!c.ok && !c.skipped) return 1;
  }
  return 0;
}

}  // namespace mstar::kv::cli
