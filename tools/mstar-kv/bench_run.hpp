// Copyright mstar-kv authors.
//
// Running one benchmark case: the engine moving a workload's pages through
// the public API (KVTransferManager, the remote cache in a server process),
// interleaved with its baseline: the fastest copy of the same copy spans this
// machine makes (toolkit::BestCopy). Not thread-safe: one case at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bench_workload.hpp"

namespace mstar::kv::cli::bench {

struct RunOptions {
  std::uint32_t threads = 2;                        // engine max_workers
  std::uint32_t repeat = 3;                         // repetitions (median, min, max)
  double min_time_s = 0.15;                         // per repetition, per side
  std::uint32_t min_requests = 1;                   // per repetition
  std::chrono::milliseconds timeout{30000};         // engine timeout for one read
  std::map<std::string, std::string> engine_extra;  // EngineOptions::extra
  // This binary and the arguments before --internal-serve that start a
  // case's server process (bench_driver.hpp).
  std::vector<std::string> serve_argv;
  bool verify = true;
  // Page epoch checks on and off in the same case: each repetition also
  // pulls through a second manager with EngineOptions::check_epochs = false
  // (extra "gbps_no_epoch_check", "epoch_check_cost_pct"). Measurement only.
  bool epoch_ab = false;
  // Control run of the same method: the second manager checks too, so the
  // "cost" printed is the A/B method's own bias.
  bool epoch_ab_control = false;
  // Called between repetitions with a short status, for the progress bar.
  std::function<void(const std::string&)> progress;
};

// Runs `workload` on `variant` with its memcpy baseline. Never throws: a
// failure or a skip comes back in CaseResult::error.
CaseResult run_case(const EngineVariant& variant, const Workload& workload,
                    const RunOptions& options);

}  // namespace mstar::kv::cli::bench
