// Copyright mstar-kv authors.
#include "bench_driver.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <sstream>
#include <thread>

#include "bench_server.hpp"
#include "layout_args.hpp"
#include "mstar/kv/kv.hpp"
#include "toolkit/child.hpp"
#include "util/parse.hpp"

namespace mstar::kv::cli::bench {

namespace {

// The options every program on the driver takes.
const char* kCommonOptions =
    "selection:\n"
    "  --suite NAME        default, full or tiny\n"
    "  --engine LIST       comma-separated engines or variants (local, shm, shm-cma,\n"
    "                      shm-cma-layers, shm-mapped-layers, ucx, ucx-tcp, ucx-sm,\n"
    "                      ucx-tcp-layers, ucx-tcp-staged, ucx-tcp-device, mooncake,\n"
    "                      cuda_ipc, cuda_ipc-kernel); shm-cma: the prefill cache in\n"
    "                      private memory, read by cross-memory attach; shm-mapped-*:\n"
    "                      the same re-backed in place by a memfd (shm_map_private);\n"
    "                      *-layers: both caches one region per layer;\n"
    "                      ucx-tcp-staged: host caches through staging buffers;\n"
    "                      ucx-tcp-device: GPU caches (staged); cuda_ipc-kernel:\n"
    "                      the copy kernel whatever the build's default copy path\n"
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

std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
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

// The variants --engine names; `plan.pseudo_named` gets the names of the
// extension's own that were named.
std::vector<EngineVariant> select_variants(const Args& args, const BenchExtension& ext,
                                           BenchPlan& plan, Report& report) {
  const std::vector<EngineTraits> table = engine_table();
  const std::vector<EngineVariant> all = engine_variants(table);
  if (!args.has("engine")) return all;
  std::vector<EngineVariant> out;
  std::set<std::string> known = ext.pseudo_engines;
  for (const EngineTraits& e : table) {
    known.insert(e.name);
    for (const LoopbackSetup& setup : e.loopback) known.insert(setup.name);
  }
  for (const std::string& name : split(args.str("engine", ""), ',')) {
    if (ext.pseudo_engines.count(name) != 0) {
      plan.pseudo_named.insert(name);
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

}  // namespace

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, sep)) {
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

int bench_main(int argc, char** argv, const BenchExtension& ext) {
  // A server that dies must show up as an error of its case, not kill us.
  std::signal(SIGPIPE, SIG_IGN);
  if (argc >= 1 && std::string(argv[0]) == "--internal-serve") {
    return serve_main(argc - 1, argv + 1);
  }
  std::set<std::string> flags = {"help",      "quiet", "no-verify", "epoch-ab", "epoch-ab-control",
                                 "with-plain"};
  std::set<std::string> options = {"suite",
                                   "engine",
                                   "case",
                                   "model",
                                   "tokens",
                                   "page-size",
                                   "table",
                                   "prefix-hit",
                                   "cache-order",
                                   "page-order",
                                   "piece",
                                   "remote-cache-order",
                                   "remote-page-order",
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
                                   "mooncake-lib",
                                   "json",
                                   "csv",
                                   "plot"};
  flags.insert(ext.flags.begin(), ext.flags.end());
  options.insert(ext.options.begin(), ext.options.end());
  Args args(argc, argv, flags, options);
  if (args.flag("help")) {
    std::printf("%s\n%s%s", ext.help_header.c_str(), kCommonOptions, ext.help_options.c_str());
    return 0;
  }
  if (!args.positional().empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "bench takes no positional arguments, got '" + args.positional()[0] + "'");
  }
  Report report;
  report.tool = ext.tool;
  report.date = utc_now();
  report.nproc = std::max(1u, std::thread::hardware_concurrency());
  report.suite = args.has("piece") || args.has("model") || args.has("tokens") || args.has("batch")
                     ? "custom"
                     : args.str("suite", "default");
  report.engines_built = built_engines();

  BenchPlan plan;
  RunOptions& ro = plan.run;
  // The default follows the cores, within the limit --threads has.
  ro.threads = static_cast<std::uint32_t>(args.u64("threads", std::min(report.nproc, 256u)));
  ro.repeat = static_cast<std::uint32_t>(args.u64("repeat", 3));
  ro.min_time_s = args.f64("min-time", 0.15);
  ro.timeout = std::chrono::milliseconds(args.u64("timeout-ms", 30000));
  ro.verify = !args.flag("no-verify");
  ro.epoch_ab_control = args.flag("epoch-ab-control");
  ro.epoch_ab = args.flag("epoch-ab") || ro.epoch_ab_control;
  ro.serve_argv = {toolkit::self_exe()};
  ro.serve_argv.insert(ro.serve_argv.end(), ext.serve_argv.begin(), ext.serve_argv.end());
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

  plan.workloads = select_workloads(args);
  plan.variants = select_variants(args, ext, plan, report);
  if (args.has("mooncake-lib")) {
    for (auto& v : plan.variants) {
      const std::string key = engine_traits(v.engine).library_option;
      if (!key.empty()) v.extra[key] = args.str("mooncake-lib", "");
    }
  }
  if (ext.prepare) ext.prepare(args, plan);
  const std::vector<Workload>& workloads = plan.workloads;
  const std::vector<EngineVariant>& variants = plan.variants;

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
        report.cases.push_back(run_case(v, w, plan.run));
        report.cases.back().wall_s =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (report.cases.back().skipped) unavailable = report.cases.back().error;
      }
      progress.step();
    }
  }

  // Mixed geometry beside the same request unconverted (--with-plain).
  note_plain_twins(report);
  if (ext.after_engines) ext.after_engines(args, plan, report, progress);
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

}  // namespace mstar::kv::cli::bench
