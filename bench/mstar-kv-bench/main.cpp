// Copyright mstar-kv authors.
//
// mstar-kv-bench: the development benchmark (built with the benchmarks, never
// installed). It runs `mstar-kv bench`'s cases (tools/mstar-kv/bench_driver.hpp)
// and sets beside them, in the same run, what the product does not ship: the
// transport's own best (ucx_perftest stream_bw at the same message size, the
// baseline of the cases over TCP), plain TCP on loopback (one round trip or
// one stream of the same bytes, bench_tcp.hpp), iperf3, and the peers:
// Mooncake's transfer_engine_bench and NVIDIA NIXL (nixl_peer.py), both over
// the same loopback TCP. See bench/README.md.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "bench_driver.hpp"
#include "bench_external.hpp"
#include "bench_tcp.hpp"
#include "mstar/kv/util/status.hpp"
#include "util/parse.hpp"

namespace mstar::kv::cli::bench {
namespace {

const char* kHeader =
    "usage: mstar-kv-bench [options]\n"
    "\n"
    "The development benchmark: `mstar-kv bench`'s cases (every built engine against\n"
    "the fastest copy of the same spans), and in the same run, unless --no-external:\n"
    "for the cases over TCP, ucx_perftest stream_bw at the same message size as their\n"
    "baseline (instead of the copy) and one plain TCP round trip or stream of the same\n"
    "bytes; with the peers (no --engine, --engine peers, or an engine whose peers may\n"
    "be on other hosts): iperf3 (one stream, 1 MiB writes), Mooncake's\n"
    "transfer_engine_bench and NIXL over UCX tcp (nixl_peer.py), 64 KiB x 128 reads.\n"
    "A missing tool is skipped with the reason. Built with the benchmarks, not\n"
    "installed; see bench/README.md.\n";

const char* kOptions =
    "\n"
    "references (this tool only):\n"
    "  --engine peers      the external references only (with other engines: also them)\n"
    "  --no-external       skip ucx_perftest, plain TCP, iperf3 and the peers\n"
    "  --mooncake-duration S  transfer_engine_bench seconds (default 5)\n"
    "  --mooncake-sizes W  the peers' sizes: default (64 KiB x 128 only), all (every\n"
    "                      raw case) or none\n";

// ucx_perftest runs at the case's message size, up to this (a contiguous
// request is one 512 MiB span; at that size the tool only measures TCP).
constexpr std::uint64_t kMaxPerftestMessage = 16u << 20;

// ucx_perftest stream_bw over tcp at each message size asked, run once per
// size (up to 3 repetitions, as many as the cases have).
class Perftest {
 public:
  Perftest(Progress& progress, std::uint32_t repeat)
      : progress_(progress), repeat_(std::min<std::uint32_t>(repeat, 3)) {}

  // The GB/s at `size`, or nullopt and error(size) says why.
  std::optional<Stat> at(std::uint64_t size) {
    if (auto it = done_.find(size); it != done_.end()) return it->second;
    progress_.set_label("ucx_perftest stream_bw tcp " + std::to_string(size) + " B");
    std::vector<double> g;
    for (std::uint32_t i = 0; i < repeat_; ++i) {
      const ExternalResult er = run_ucx_perftest("tcp", "stream_bw", size);
      if (!er.ok) {
        errors_[size] = er.error;
        break;
      }
      g.push_back(er.gbps);
    }
    std::optional<Stat> s;
    if (!g.empty()) s = make_stat(g);
    done_[size] = s;
    return s;
  }
  std::string error(std::uint64_t size) const {
    const auto it = errors_.find(size);
    return it == errors_.end() ? "" : it->second;
  }

 private:
  Progress& progress_;
  std::uint32_t repeat_;
  std::map<std::uint64_t, std::optional<Stat>> done_;
  std::map<std::uint64_t, std::string> errors_;
};

// Over TCP the transport's own best is the limit, not memcpy: every case of
// a variant in `over_tcp` gets ucx_perftest at its median copy span as its
// baseline. (For ucx-sm memcpy is the limit: ucx_perftest re-sends one
// cache-hot buffer.)
void set_tcp_baselines(Report& report, const std::set<std::string>& over_tcp, Perftest& perftest) {
  for (CaseResult& c : report.cases) {
    if (!c.ok || c.piece_bytes == 0) continue;
    if (over_tcp.count(c.engine) == 0) continue;
    const std::uint64_t size = std::min(c.piece_bytes, kMaxPerftestMessage);
    const auto s = perftest.at(size);
    const std::string name = "ucx_perftest stream_bw tcp " + size_name(size);
    if (!s) {
      report.notes.push_back(c.engine + " " + c.workload.name + ": no " + name +
                             " baseline: " + perftest.error(size));
      continue;
    }
    c.extra["ucx_perftest_stream_bw_tcp"] = s->median;
    c.baseline_name = name;
    c.baseline_gbps = *s;
    c.ratio = s->median > 0 ? std::optional<double>(c.gbps.median / s->median) : std::nullopt;
  }
}

// iperf3, one stream with 1 MiB writes: the wire's best here (iperf3's
// default 128 KiB writes carry less than half of it on some machines); a
// note with the ratio of every case over TCP to it.
void note_iperf3(Report& report, const std::set<std::string>& over_tcp, Progress& progress) {
  progress.set_label("iperf3 tcp loopback");
  const ExternalResult ip = run_iperf3(2.0, 1u << 20);
  report.references.push_back({"iperf3 tcp loopback (1 stream, 1 MiB writes)", ip.ok, ip.gbps,
                               ip.ok ? ip.command : ip.error});
  if (!ip.ok || ip.gbps <= 0) return;
  for (CaseResult& c : report.cases) {
    if (!c.ok || over_tcp.count(c.engine) == 0) continue;
    c.extra["iperf3_tcp"] = ip.gbps;
    char line[256];
    std::snprintf(line, sizeof line, "%s %s: %.2f GB/s = %.2f of iperf3 (1 stream, 1 MiB writes)",
                  c.engine.c_str(), c.workload.name.c_str(), c.gbps.median,
                  c.gbps.median / ip.gbps);
    report.notes.push_back(line);
  }
}

// A peer's row at a raw case's block and batch, beside ucx_perftest over
// TCP, and a note with the ratio of each of our TCP cases of that size to it.
void peer_row(Report& report, const std::set<std::string>& over_tcp, Perftest& perftest,
              const std::string& peer, const std::string& what, std::uint64_t block,
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
  if (const auto st = perftest.at(block)) {
    r.baseline_name = "ucx_perftest stream_bw tcp " + size_name(block);
    r.baseline_gbps = *st;
    r.ratio = r.gbps.median / st->median;
  }
  report.notes.push_back(what + ": " + er.command + " -> " + std::to_string(er.gbps) + " GB/s");
  for (CaseResult& c : report.cases) {
    if (c.ok && c.engine != peer && c.workload.model == "raw" && c.workload.piece_bytes == block &&
        c.workload.batch == batch && over_tcp.count(c.engine) != 0) {
      c.extra[peer] = er.gbps;
      char buf[160];
      std::snprintf(buf, sizeof buf, "%s %s: %.2fx %s", c.engine.c_str(), c.workload.name.c_str(),
                    c.gbps.median / er.gbps, what.c_str());
      report.notes.push_back(buf);
    }
  }
  report.cases.push_back(r);
}

// The peers (Mooncake's transfer_engine_bench, NVIDIA NIXL: PyPI wheel, UCX
// backend, DRAM) over the same TCP, at the raw cases' block and batch sizes
// (--mooncake-sizes).
void run_peers(const Args& args, const BenchPlan& plan, Report& report,
               const std::set<std::string>& over_tcp, Perftest& perftest, Progress& progress) {
  const int mc_duration = static_cast<int>(args.u64("mooncake-duration", 5));
  const std::string mc_sizes = args.str("mooncake-sizes", "default");
  std::set<std::pair<std::uint64_t, std::uint32_t>> sizes;
  if (mc_sizes != "none") sizes.insert({65536, 128});
  if (mc_sizes == "all") {
    for (const auto& w : plan.workloads) {
      if (w.model == "raw") sizes.insert({w.piece_bytes, w.batch});
    }
  }
  if (sizes.empty()) return;
  std::string why_not;
  const std::string te = find_mooncake_bench(&why_not);
  if (te.empty()) {
    report.references.push_back({"Mooncake transfer_engine_bench", false, 0, why_not});
  } else {
    for (const auto& [block, batch] : sizes) {
      progress.set_label("Mooncake transfer_engine_bench " + size_name(block));
      peer_row(report, over_tcp, perftest, "mooncake_te_bench", "Mooncake transfer_engine_bench",
               block, batch, run_mooncake_bench(te, block, batch, 1, mc_duration));
    }
  }
  for (const auto& [block, batch] : sizes) {
    progress.set_label("NIXL READ over UCX tcp " + size_name(block));
    peer_row(report, over_tcp, perftest, "nixl_ucx_tcp", "NIXL over UCX tcp", block, batch,
             run_nixl_peer("tcp", block, batch, 200));
  }
}

// The references, after the engine cases.
void measure_references(const Args& args, const BenchPlan& plan, Report& report,
                        Progress& progress) {
  std::set<std::string> over_tcp;  // the variants whose bytes cross a TCP socket
  for (const EngineVariant& v : plan.variants) {
    if (v.over_tcp) over_tcp.insert(v.name);
  }
  Perftest perftest(progress, plan.run.repeat);
  set_tcp_baselines(report, over_tcp, perftest);
  // Beside plain TCP: small requests against one round trip of their
  // bytes, large ones against one stream of them (bench_tcp.hpp).
  note_tcp_floors(report, over_tcp, progress);
  // The peers run with no --engine, with --engine peers, or beside an engine
  // whose peers may be on other hosts.
  const bool peers = !args.has("engine") || plan.pseudo_named.count("peers") != 0 ||
                     std::any_of(plan.variants.begin(), plan.variants.end(),
                                 [](const EngineVariant& v) { return v.crosses_hosts; });
  if (!peers) return;
  note_iperf3(report, over_tcp, progress);
  run_peers(args, plan, report, over_tcp, perftest, progress);
}

int run(int argc, char** argv) {
  BenchExtension ext;
  ext.tool = "mstar-kv-bench";
  ext.help_header = kHeader;
  ext.help_options = kOptions;
  ext.flags = {"no-external"};
  ext.options = {"mooncake-duration", "mooncake-sizes"};
  ext.pseudo_engines = {"peers"};
  ext.prepare = [](const Args& args, BenchPlan& plan) {
    const std::string mc_sizes = args.str("mooncake-sizes", "default");
    if (mc_sizes != "default" && mc_sizes != "all" && mc_sizes != "none") {
      throw Error(StatusCode::kInvalidArgument,
                  "--mooncake-sizes wants default, all or none, got '" + mc_sizes + "'");
    }
    (void)util::parse_u64(args.str("mooncake-duration", "5"), "--mooncake-duration", 1, 3600);
    if (args.flag("no-external")) return;
    // Over TCP ucx_perftest is the baseline; skip the copy to save time.
    for (auto& v : plan.variants) {
      if (v.over_tcp) v.memcpy_baseline = false;
    }
  };
  ext.after_engines = [](const Args& args, const BenchPlan& plan, Report& report,
                         Progress& progress) {
    if (!args.flag("no-external")) measure_references(args, plan, report, progress);
  };
  return bench_main(argc, argv, ext);
}

}  // namespace
}  // namespace mstar::kv::cli::bench

int main(int argc, char** argv) {
  // As `mstar-kv`: the library logs warnings unless MSTAR_KV_LOG says
  // otherwise; set before any thread starts, inherited by the servers.
  ::setenv("MSTAR_KV_LOG", "warn", /*overwrite=*/0);
  try {
    return mstar::kv::cli::bench::run(argc - 1, argv + 1);
  } catch (const mstar::kv::Error& err) {
    std::fprintf(stderr, "mstar-kv-bench: error: %s\n", err.what());
    return err.code() == mstar::kv::StatusCode::kInvalidArgument ? 2 : 1;
  } catch (const std::exception& err) {
    std::fprintf(stderr, "mstar-kv-bench: error: %s\n", err.what());
    return 1;
  }
}
