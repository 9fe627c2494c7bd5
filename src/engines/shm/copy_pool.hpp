// Copyright mstar-kv authors.
//
// CopyPool: a persistent pool of copy threads that runs byte-span copies and
// resolves one TransferFuture per submitted job (private to the shm engine).
//
// A job is cut into pieces (contiguous ranges of spans of roughly equal
// bytes; a span larger than a piece is split, by bytes or by rows; or runs
// of reads that the worker plans itself); workers claim pieces with one
// atomic increment, so several workers
// share one large job and a piece costs no lock, allocation or syscall.
// Between pieces a worker checks the job's stop conditions (cancel, deadline,
// shutdown, a piece that failed: only reads of another process's memory
// can). A stopped job resolves only once no worker is inside one of its
// pieces: after resolution no byte of it is written.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cma_reader.hpp"
#include "mstar/kv/core/future.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "span_copy.hpp"

namespace mstar::kv::shm {

struct CopyJobSpec {
  RegionMap dst;  // the local cache: local offsets -> addresses here
  RegionMap src;  // a mapped owner: remote offsets -> addresses here
  // Set: the owner's private memory, read with process_vm_readv (src is
  // then unused; keep_alive keeps the peer). A failed read fails the job.
  const CmaPeer* cma = nullptr;
  std::vector<StridedSpan> spans;  // local_offset -> dst, remote_offset -> src
  std::uint64_t total_bytes = 0;
  std::shared_ptr<const void> keep_alive;        // e.g. the source mapping
  std::string what;                              // "read of 12 MiB from pid 7" for messages
  TransferTiming::Clock::time_point planned_at;  // when the copies were planned
  std::string peer;                              // for statistics: "pid 7"
  // Run once every byte is copied, before the future resolves: a failure
  // fails the read (the page epochs' after-copy check). May be empty.
  std::function<Status()> verify;
  // Planned piece by piece on the copy threads instead (many small reads:
  // planning them is a sizeable share of the read, and the threads are idle
  // until it is done): `spans` stays empty, the pieces are runs of `reads`
  // (checked already, by the caller), and a thread plans its run with
  // `plan` into a buffer of its own, then copies it. `copies` is what the
  // timing reports (the spans before coalescing).
  std::vector<KVReadInfo> reads;
  std::function<void(std::span<const KVReadInfo>, StridedPlan&)> plan;
  std::uint64_t copies = 0;
};

// Splits spans of more than max_bytes (> 0): contiguous ones by bytes,
// strided ones by whole rows.
std::vector<StridedSpan> split_strided(std::span<const StridedSpan> spans, std::uint64_t max_bytes);

class CopyPool {
 public:
  // Starts `workers` copy threads and one watchdog thread.
  CopyPool(std::uint32_t workers, std::chrono::milliseconds timeout);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Queues the job; never waits for it, except that with `caller_helps` the
  // calling thread copies pieces too until none is left to claim (pieces
  // the workers took may still be in flight when it returns). Throws
  // Error(kShutdown) after shutdown().
  TransferFuture submit(CopyJobSpec spec, bool caller_helps = false);

  // Resolves every unfinished job with kShutdown (pieces being copied finish
  // first) and joins the threads. Idempotent, safe from any thread but a
  // worker.
  void shutdown();

  struct Job;

 private:
  void worker_loop();
  void watchdog_loop();

  const std::uint32_t workers_;
  const std::chrono::milliseconds timeout_;
  std::mutex shutdown_mu_;  // serialises shutdown() callers
  std::mutex mu_;
  std::condition_variable work_cv_;   // workers wait for jobs
  std::condition_variable watch_cv_;  // the watchdog waits for jobs
  bool stopping_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::deque<std::shared_ptr<Job>> queue_ MSTAR_KV_GUARDED_BY(mu_);    // jobs with pieces left
  std::vector<std::shared_ptr<Job>> active_ MSTAR_KV_GUARDED_BY(mu_);  // unresolved jobs
  std::vector<std::thread> threads_;
  std::thread watchdog_;
};

}  // namespace mstar::kv::shm
