// Copyright mstar-kv authors.
//
// UcxProgress: the progress thread's loop (ucx_progress.hpp).
#include "ucx_progress.hpp"

#include <poll.h>
#include <pthread.h>

#include <chrono>

#include "ucx_worker.hpp"

namespace mstar::kv::ucx {

UcxProgress::UcxProgress(UcxWorker& worker, ProgressRounds& rounds, Progress mode)
    : worker_(worker), rounds_(rounds), mode_(mode) {
  thread_ = std::thread([this] { run(); });
}

UcxProgress::~UcxProgress() { stop(); }

bool UcxProgress::post(std::function<void()> cmd) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopped_) return false;
    commands_.push_back(std::move(cmd));
  }
  ucp_worker_signal(worker_.get());  // safe from any thread
  return true;
}

void UcxProgress::drain_deferred() {
  while (!deferred_.empty()) {
    auto work = std::move(deferred_);
    deferred_.clear();
    for (auto& w : work) w();
  }
}

void UcxProgress::run() {
  // Named, so a profiler or /proc/PID/task shows which thread moves the bytes.
  pthread_setname_np(pthread_self(), "mstar-kv-ucx");
  using Clock = std::chrono::steady_clock;
  int idle = 0;
  bool closing_all = false;
  auto deadline = Clock::time_point::max();
  // Reused across iterations: a libstdc++ deque allocates even when empty,
  // and this loop spins while transfers are in flight.
  std::deque<std::function<void()>> cmds;
  for (;;) {
    cmds.clear();
    {
      std::lock_guard<std::mutex> lk(mu_);
      cmds.swap(commands_);
    }
    for (auto& c : cmds) c();
    unsigned progressed = 0;
    while (unsigned n = ucp_worker_progress(worker_.get())) {
      progressed += n;
      drain_deferred();
    }
    drain_deferred();
    rounds_.after_round();
    if (!closing_all && stop_requested_.load(std::memory_order_acquire)) {
      closing_all = true;
      deadline = Clock::now() + std::chrono::seconds(2);
      std::deque<std::function<void()>> last;
      {
        std::lock_guard<std::mutex> lk(mu_);
        stopped_ = true;  // post() refuses from now on
        last.swap(commands_);
      }
      for (auto& c : last) c();
      rounds_.close_all();
      continue;
    }
    if (closing_all) {
      if (rounds_.settled() || Clock::now() > deadline) break;
      continue;
    }
    if (progressed != 0 || !cmds.empty()) {
      idle = 0;
      continue;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (!commands_.empty()) continue;
    }
    // Idle (ucx_progress): adaptive keeps polling (yielding the core: the
    // machine may be shared) while reads or data replies are in flight and
    // sleeps on the worker's event fd after 256 idle rounds otherwise; event
    // sleeps at once; busy never sleeps. An event sleep with transfers in
    // flight is 1 ms at most: shared-memory transports raise no event when
    // the peer frees room in a fifo or a get completes.
    const ProgressRounds::Activity now = rounds_.activity();
    const bool busy = now.busy;
    if (mode_ == Progress::kBusy) continue;
    const bool event = mode_ == Progress::kEvent;
    if (now.holding && (event || idle >= 32)) {
      // Held readiness requests: the owner's pool marks layers with plain
      // stores (no event), so look again every 20 us.
      idle = 0;
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      continue;
    }
    if (worker_.efd() < 0) {  // no event fd: poll, resting 50 us per round once idle a while
      if (!busy && ++idle >= 256) std::this_thread::sleep_for(std::chrono::microseconds(50));
      std::this_thread::yield();
      continue;
    }
    if (!event && (busy || ++idle < 256)) {
      std::this_thread::yield();
      continue;
    }
    idle = 0;
    if (ucp_worker_arm(worker_.get()) == UCS_ERR_BUSY) continue;
    pollfd pfd{worker_.efd(), POLLIN, 0};
    (void)::poll(&pfd, 1, busy ? 1 : (now.draining ? 10 : 100));
  }
  // What UCX did not complete in the grace period: the worker is destroyed
  // right after this returns, so nothing can land any more.
  rounds_.abandon();
}

void UcxProgress::stop() noexcept {
  if (thread_.joinable()) {
    stop_requested_.store(true, std::memory_order_release);
    ucp_worker_signal(worker_.get());
    thread_.join();
  }
  std::lock_guard<std::mutex> lk(mu_);
  stopped_ = true;
  commands_.clear();
}

}  // namespace mstar::kv::ucx
