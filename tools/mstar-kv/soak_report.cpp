// Copyright mstar-kv authors.
//
// What `mstar-kv soak` prints at the end of a run.
#include <cstdio>
#include <mutex>
#include <string>

#include "soak_shared.hpp"

namespace mstar::kv::cli::soak {

void add_counters(FaultCounters& sum, const FaultCounters& c) {
  sum.batches += c.batches;
  sum.delayed += c.delayed;
  sum.dropped += c.dropped;
  sum.failed_after_bytes += c.failed_after_bytes;
  sum.kills += c.kills;
  sum.duplicates += c.duplicates;
  sum.duplicates_ignored += c.duplicates_ignored;
  sum.cancels += c.cancels;
}

void print_soak_report(const SoakRun& run, Stats& stats) {
  const std::uint64_t injected = run.faults.total() + run.kills;
  std::printf(
      "soak: %llu s, %zu prefill processes (%s), %zu decode threads, seed %llu%s\n",
      static_cast<unsigned long long>(run.seconds), run.prefill_engines.size(),
      [&] {
        std::string s;
        for (const auto& e : run.prefill_engines) s += (s.empty() ? "" : ", ") + e;
        return s;
      }()
          .c_str(),
      run.threads, static_cast<unsigned long long>(run.seed),
      run.interrupted ? " (interrupted)" : "");
  std::printf("requests: %llu (ok %llu, failed %llu, rejected before any byte %llu)\n",
              static_cast<unsigned long long>(stats.requests.load()),
              static_cast<unsigned long long>(stats.ok.load()),
              static_cast<unsigned long long>(stats.failed.load()),
              static_cast<unsigned long long>(stats.rejected.load()));
  std::printf("bytes verified: %llu (%.2f GiB)\n",
              static_cast<unsigned long long>(stats.bytes_verified.load()),
              static_cast<double>(stats.bytes_verified.load()) / (1 << 30));
  std::printf(
      "faults injected: %llu (prefill kills %llu, kill-hook kills %llu, delays %llu, "
      "drops %llu, fail-after-bytes %llu, duplicate completions %llu, cancels %llu; "
      "prefill restarts %llu, of which after kill-hook deaths %llu)\n",
      static_cast<unsigned long long>(injected), static_cast<unsigned long long>(run.kills),
      static_cast<unsigned long long>(run.faults.kills),
      static_cast<unsigned long long>(run.faults.delayed),
      static_cast<unsigned long long>(run.faults.dropped),
      static_cast<unsigned long long>(run.faults.failed_after_bytes),
      static_cast<unsigned long long>(run.faults.duplicates),
      static_cast<unsigned long long>(run.faults.cancels),
      static_cast<unsigned long long>(run.restarts), static_cast<unsigned long long>(run.deaths));
  const ReaderCounts& r = run.readers;
  std::printf(
      "reader kills: %llu (%llu inside a read, by their own SIGKILL when asked; %llu at "
      "random times); decode processes: %zu at a time, %llu started, %llu of the "
      "requests, %llu ended otherwise%s%s\n",
      static_cast<unsigned long long>(r.kills), static_cast<unsigned long long>(r.kills_in_read),
      static_cast<unsigned long long>(r.kills - r.kills_in_read), run.decode_procs,
      static_cast<unsigned long long>(r.started), static_cast<unsigned long long>(r.requests),
      static_cast<unsigned long long>(r.unexpected_exits), r.first_unexpected.empty() ? "" : ": ",
      r.first_unexpected.c_str());
  std::printf("unexpected owner exits: %llu%s%s\n",
              static_cast<unsigned long long>(run.unexpected_owner_exits),
              run.first_unexpected_owner_exit.empty() ? "" : " (first: ",
              run.first_unexpected_owner_exit.empty()
                  ? ""
                  : (run.first_unexpected_owner_exit + ")").c_str());
  {
    std::lock_guard<std::mutex> lock(stats.mu);
    std::string by;
    for (const auto& [code, count] : stats.failures_by_code) {
      by += (by.empty() ? "" : ", ") + code + " " + std::to_string(count);
    }
    std::printf(
        "pages reused: %llu new sequences published on freed pages (page reuse every "
        "~%llu ms per prefill, lease %llu ms)\n",
        static_cast<unsigned long long>(run.republished),
        static_cast<unsigned long long>(run.reuse_ms),
        static_cast<unsigned long long>(run.lease_ms));
    std::printf("failures reported (expected): %llu (%s)\n",
                static_cast<unsigned long long>(stats.failed.load()) +
                    static_cast<unsigned long long>(stats.rejected.load()),
                by.empty() ? "none" : by.c_str());
    std::printf("corruptions: %llu\n", static_cast<unsigned long long>(stats.corruptions.load()));
    std::printf("wrong-sequence reads: %llu\n",
                static_cast<unsigned long long>(stats.wrong_sequence.load()));
    if (!stats.first_corruption.empty()) {
      std::printf("first corruption: %s\n", stats.first_corruption.c_str());
    }
  }
}

}  // namespace mstar::kv::cli::soak
