// Copyright mstar-kv authors.
//
// The driver of `mstar-kv bench`: its options, the engine cases against the
// fastest copy of the same spans, and the table, JSON, CSV and plot. The
// development benchmark bench/mstar-kv-bench (not installed) runs the same
// driver and adds the transports' own best and the peers (ucx_perftest,
// iperf3, plain TCP, Mooncake's transfer_engine_bench, NIXL) through a
// BenchExtension. Not thread-safe.
#pragma once

#include <functional>
#include <set>
#include <string>
#include <vector>

#include "args.hpp"
#include "bench_report.hpp"
#include "bench_run.hpp"
#include "bench_workload.hpp"

namespace mstar::kv::cli::bench {

// What one run measures, from its options.
struct BenchPlan {
  std::vector<Workload> workloads;
  std::vector<EngineVariant> variants;
  RunOptions run;
  // --engine names the extension claims (BenchExtension::pseudo_engines) that
  // were named.
  std::set<std::string> pseudo_named;
};

// What a program built on the driver adds to it.
struct BenchExtension {
  // The program, as the table, JSON and plot name it.
  std::string tool = "mstar-kv bench";
  // The usage line and what the run measures, before the common options.
  std::string help_header;
  // Its own options' help, after the common ones.
  std::string help_options;
  // Its own bare flags and options taking a value.
  std::set<std::string> flags, options;
  // --engine names that select no engine of the library ("peers").
  std::set<std::string> pseudo_engines;
  // The arguments after this binary that reach serve_main: {"bench"} for
  // `mstar-kv bench`, {} for a program whose argv[1] is --internal-serve.
  std::vector<std::string> serve_argv;
  // Called once the plan is made, before any case runs.
  std::function<void(const Args&, BenchPlan&)> prepare;
  // Called after the engine cases, before the output: more rows, notes and
  // references.
  std::function<void(const Args&, const BenchPlan&, Report&, Progress&)> after_engines;
};

// Runs the bench on argv (the arguments after the command's name), or, for
// "--internal-serve ...", the server of one case. The exit code: 0, 1 when a
// case failed, 2 on bad options (Error(kInvalidArgument) thrown).
int bench_main(int argc, char** argv, const BenchExtension& ext);

// `s` cut at every `sep`, empty items dropped.
std::vector<std::string> split(const std::string& s, char sep);

}  // namespace mstar::kv::cli::bench
