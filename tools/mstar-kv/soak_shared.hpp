// Copyright mstar-kv authors.
//
// What `mstar-kv soak`'s parts share (private to the command): the prefill
// processes as the supervisor sees them (soak_supervisor.cpp), the state it
// shares with the decode threads, and those threads (soak_decode.cpp).
#pragma once

#include <signal.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "mstar/kv/engines/fault_injection.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "toolkit/child.hpp"
#include "toolkit/read_check.hpp"

namespace mstar::kv::cli::soak {

using toolkit::Ranges;

inline std::uint64_t pattern_seed(std::uint64_t seq_id) {
  return seq_id * 0x9E3779B97F4A7C15ULL + 17;
}

// A prefill process as the supervisor holds it.
struct Prefill {
  std::string engine;
  std::unique_ptr<toolkit::Child> child;  // null while stopped
  pid_t pid() const { return child ? child->pid() : -1; }
};

// SIGKILL and reap (bounded: a SIGKILLed process always exits).
void kill_prefill(Prefill& p);
// Starts `mstar-kv soak --role prefill ...` and reads its sequences.
// Throws Error(kPeerFailure) if it does not get ready within `timeout`.
std::vector<SequenceInfo> start_prefill(Prefill& p, const std::vector<std::string>& args,
                                        std::chrono::milliseconds timeout);

// ---- shared state between the supervisor and the decode threads -------------

struct Published {
  std::string engine;
  std::vector<SequenceInfo> seqs;
};

struct Stats {
  std::atomic<std::uint64_t> requests{0}, ok{0}, failed{0}, rejected{0}, bytes_verified{0},
      corruptions{0}, hangs{0}, wrong_sequence{0};
  std::mutex mu;
  std::map<std::string, std::uint64_t> failures_by_code MSTAR_KV_GUARDED_BY(mu);
  std::string first_corruption MSTAR_KV_GUARDED_BY(mu);
  // Set before any thread runs: told of every corruption at once (a decode
  // process passes them to the supervisor before it may be killed).
  std::function<void(bool wrong_sequence, const std::string& what)> on_corruption;

  void failure(StatusCode c) {
    std::lock_guard<std::mutex> lock(mu);
    ++failures_by_code[std::string(to_string(c))];
  }
  // `wrong`: a read reported success with another request's bytes.
  void corruption(const std::string& what, bool wrong = false) {
    corruptions.fetch_add(1, std::memory_order_relaxed);
    if (wrong) wrong_sequence.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu);
    if (first_corruption.empty()) first_corruption = what;
    if (on_corruption) on_corruption(wrong, what);
  }
};

struct Shared {
  std::mutex mu;
  std::vector<std::shared_ptr<const Published>> slots
      MSTAR_KV_GUARDED_BY(mu);  // null while restarting
  std::vector<pid_t> pids MSTAR_KV_GUARDED_BY(mu);

  explicit Shared(std::size_t n) : slots(n), pids(n, -1) {}
  std::size_t size() {
    std::lock_guard<std::mutex> lock(mu);
    return slots.size();
  }
  std::shared_ptr<const Published> get(std::size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    return slots[i];
  }
  // The kill hook of the fault injectors: SIGKILL one prefill at random
  // (the supervisor notices and restarts it).
  void kill_random(std::uint64_t r) {
    std::lock_guard<std::mutex> lock(mu);
    if (pids.empty()) return;
    const pid_t pid = pids[r % pids.size()];
    if (pid > 0) {
      hook_killed.insert(pid);
      ::kill(pid, SIGKILL);
    }
  }
  // Whether the kill hook SIGKILLed `pid` (an owner death that was meant).
  bool killed_by_hook(pid_t pid) {
    std::lock_guard<std::mutex> lock(mu);
    return hook_killed.count(pid) != 0;
  }

 private:
  std::set<pid_t> hook_killed MSTAR_KV_GUARDED_BY(mu);
};

// Sequences a prefill published since READY (page reuse, expired leases):
// appended to its slot, which keeps the newest `keep`, freed ones included,
// so that readers also pull sequences whose pages went to others.
// Returns them (also to the decode processes, soak_readers.hpp).
std::vector<SequenceInfo> take_published(Prefill& p, std::size_t i, std::size_t keep,
                                         Shared& shared);

struct DecodeConfig {
  std::chrono::milliseconds timeout;
  std::chrono::milliseconds grace;
  std::uint64_t seed;
  // Runs right after each read was issued, its future in flight (a decode
  // process asked to die kills itself there: inside a read).
  std::function<void()> after_issue;
};

// One decode thread: pulls random published sequences into its pages and
// checks every one (see cmd_soak.cpp) until `stop`.
void decode_thread(std::size_t t, const DecodeConfig& cfg, const KVCache& cache,
                   const KVLayout& remote_layout, std::vector<std::uint32_t> region,
                   std::map<std::string, KVTransferEngine*> engines, Shared& shared, Stats& stats,
                   const std::atomic<bool>& stop);

// The decode side's engine for `engine`: made by the factory over `cache`,
// wrapped in a FaultInjectingEngine injecting faults at `fault_rate` in all
// (delays, drops, partial reads, kill-hook calls, duplicate completions,
// cancels) from `seed`; `kill` kills a random prefill process.
std::unique_ptr<FaultInjectingEngine> make_decode_engine(const std::string& engine,
                                                         std::shared_ptr<KVCache> cache,
                                                         const DecodeConfig& cfg, double fault_rate,
                                                         std::uint64_t seed,
                                                         FaultInjectingEngine::KillHook kill);

// The engines to soak: `list` (comma-separated) checked, or, when empty,
// every built engine that moves host pages between processes with nothing
// beyond its build. Throws Error(kInvalidArgument / kUnavailable) naming them.
std::vector<std::string> soak_engines(const std::string& list);

// What a run did, for the report.
// What the decode processes did (soak_readers.hpp).
struct ReaderCounts {
  std::uint64_t started = 0;           // decode processes started
  std::uint64_t kills = 0;             // of them SIGKILLed
  std::uint64_t kills_in_read = 0;     // of those, by themselves inside a read, when asked
  std::uint64_t unexpected_exits = 0;  // ended otherwise (a reader's own failure)
  std::uint64_t requests = 0;          // theirs, of the run's requests (as they last reported)
  std::string first_unexpected;
};

struct SoakRun {
  std::uint64_t seconds = 0;
  std::vector<std::string> prefill_engines;  // one per prefill process
  std::size_t threads = 0;
  std::size_t decode_procs = 0;
  ReaderCounts readers;
  std::uint64_t unexpected_owner_exits = 0;  // prefill processes that died unasked
  std::string first_unexpected_owner_exit;
  std::uint64_t seed = 0;
  bool interrupted = false;
  std::uint64_t kills = 0, restarts = 0, deaths = 0, republished = 0;
  std::uint64_t reuse_ms = 0, lease_ms = 0;
  FaultCounters faults;
};
// `sum` += `c`, counter by counter.
void add_counters(FaultCounters& sum, const FaultCounters& c);
// Prints the run's totals (requests, bytes verified, faults injected,
// failures, corruptions).
void print_soak_report(const SoakRun& run, Stats& stats);

}  // namespace mstar::kv::cli::soak
