// Copyright mstar-kv authors.
//
// UcxProgress, the ucx engine's progress thread (internal to the engine).
// It owns the thread, the queue of work posted from other threads, and the
// work deferred to the end of a progress round; it drives the worker
// (ucp_worker_progress, sleeping on its event fd per ucx_progress) and asks
// the engine's sides for their per-round checks through ProgressRounds.
// Threads: post() and stopping() from any thread; stop() from any thread but
// the progress thread; defer() and later() on the progress thread only.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "mstar/kv/util/thread_annotations.hpp"
#include "ucx_backend.hpp"
#include "ucx_test_seam.hpp"

namespace mstar::kv::ucx {

class UcxWorker;

// What the progress loop asks of the engine's sides, on the progress
// thread (UcxCore answers for them).
class ProgressRounds {
 public:
  // What is in flight, for the loop's choice of how to idle.
  struct Activity {
    bool busy = false;      // reads, data replies or staged gathers in flight
    bool holding = false;   // readiness requests held by the owner
    bool draining = false;  // aborted reads whose gets still drain
  };
  virtual ~ProgressRounds() = default;
  // After every round of progress: the sides' periodic checks.
  virtual void after_round() = 0;
  // Once, when stop() asked: every connection and the listener close.
  virtual void close_all() = 0;
  // While closing: true once nothing is left to wait for.
  virtual bool settled() const = 0;
  virtual Activity activity() const = 0;
  // After the loop, before the worker goes: fails what UCX did not complete.
  virtual void abandon() = 0;
};

class UcxProgress {
 public:
  // Starts the progress thread over `worker`; `rounds` outlives it.
  UcxProgress(UcxWorker& worker, ProgressRounds& rounds, Progress mode);
  ~UcxProgress();
  UcxProgress(const UcxProgress&) = delete;
  UcxProgress& operator=(const UcxProgress&) = delete;

  // Runs `cmd` on the progress thread; false when stopped.
  bool post(std::function<void()> cmd);
  // Closes everything (ProgressRounds::close_all, within a grace period),
  // joins the thread and refuses posts from then on. Idempotent.
  void stop() noexcept;
  // True from the moment stop() asked the loop to end.
  bool stopping() const noexcept { return stop_requested_.load(std::memory_order_acquire); }
  // [progress] Runs `fn` after this progress round.
  void defer(std::function<void()> fn) { deferred_.push_back(std::move(fn)); }
  // [progress] Runs the continuation `fn` after this progress round, or
  // when a test's seam holds it (ucx_test_seam.hpp), once the seam lets it go.
  void later(std::function<void()> fn) {
    if (seam_ != nullptr && seam_->hold(fn)) return;
    deferred_.push_back(std::move(fn));
  }

 private:
  friend struct UcxTestAccess;  // tests: installs seam_ (tests/engines/ucx)
  void run();
  void drain_deferred();

  UcxWorker& worker_;
  ProgressRounds& rounds_;
  const Progress mode_;
  std::mutex mu_;
  std::deque<std::function<void()>> commands_ MSTAR_KV_GUARDED_BY(mu_);
  bool stopped_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::atomic<bool> stop_requested_{false};
  std::vector<std::function<void()>> deferred_;  // [progress]
  std::unique_ptr<ContinuationSeam> seam_;       // [progress] null but in tests
  std::thread thread_;
};

}  // namespace mstar::kv::ucx
