// Copyright mstar-kv authors.
#include "mstar/kv/core/future.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <vector>

namespace mstar::kv {

namespace detail {

struct TransferState {
  std::mutex mu;
  std::condition_variable cv;
  // Written once under mu before `resolved` is released; read after an
  // acquire load of `resolved` sees true.
  Status status{StatusCode::kInProgress, ""};
  std::uint64_t bytes = 0;
  std::atomic<bool> resolved{false};
  std::atomic<bool> cancel{false};
  // Guarded by mu; taken (emptied) by the resolving thread: observers
  // (on_resolving) before waiters wake, callbacks (on_resolved) after.
  std::vector<TransferFuture::Callback> observers;
  std::vector<TransferFuture::Callback> callbacks;
  // Set under mu with status and bytes when resolution starts (observers
  // run), before `resolved` is released to waiters.
  bool settling MSTAR_KV_GUARDED_BY(mu) = false;
  std::vector<std::function<void()>> cancel_hooks MSTAR_KV_GUARDED_BY(mu);  // run once
  TransferTiming timing MSTAR_KV_GUARDED_BY(mu);

  TransferState() {
    timing.created = timing.planned = timing.posted = TransferTiming::Clock::now();
  }

  bool resolve(Status s, std::uint64_t b) noexcept {
    std::vector<TransferFuture::Callback> first;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (settling) return false;
      settling = true;
      status = std::move(s);
      bytes = b;
      timing.resolved = TransferTiming::Clock::now();
      first.swap(observers);
    }
    // What a waiter must find done once it wakes (statistics).
    for (auto& cb : first) invoke(cb);
    std::vector<TransferFuture::Callback> run;
    {
      std::lock_guard<std::mutex> lock(mu);
      run.swap(callbacks);
      resolved.store(true, std::memory_order_release);
    }
    cv.notify_all();
    // status and bytes never change after resolution, so reading them
    // without the lock is safe here.
    for (auto& cb : run) invoke(cb);
    return true;
  }

  void invoke(const TransferFuture::Callback& cb) const noexcept {
    try {
      cb(status, status.is_ok() ? bytes : 0);
    } catch (...) {
      // A callback must not throw (future.hpp); nothing to hand it to.
    }
  }
};

}  // namespace detail

bool TransferFuture::ready() const noexcept {
  return state_ && state_->resolved.load(std::memory_order_acquire);
}

bool TransferFuture::wait_for(std::chrono::nanoseconds timeout) const {
  if (!state_) return false;
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_for(lock, timeout,
                             [&] { return state_->resolved.load(std::memory_order_acquire); });
}

void TransferFuture::wait() const {
  if (!state_) return;
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->resolved.load(std::memory_order_acquire); });
}

Status TransferFuture::status() const {
  if (!state_) return {StatusCode::kInvalidArgument, "invalid TransferFuture"};
  if (!ready()) return {StatusCode::kInProgress, ""};
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status;
}

std::uint64_t TransferFuture::bytes() const noexcept {
  if (!ready()) return 0;
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->status.is_ok() ? state_->bytes : 0;
}

std::uint64_t TransferFuture::get() const {
  if (!state_) {
    throw Error(StatusCode::kInvalidArgument, "get() on an invalid TransferFuture");
  }
  wait();
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->status.is_ok()) throw Error(state_->status);
  return state_->bytes;
}

void TransferFuture::cancel() const noexcept {
  if (!state_ || state_->cancel.exchange(true, std::memory_order_acq_rel)) return;
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    run.swap(state_->cancel_hooks);
  }
  for (auto& h : run) {
    try {
      h();
    } catch (...) {
      // A hook must not throw (future.hpp).
    }
  }
}

void TransferPromise::on_cancel(std::function<void()> hook) {
  if (!hook) return;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->cancel.load(std::memory_order_acquire)) {
      state_->cancel_hooks.push_back(std::move(hook));
      return;
    }
  }
  hook();
}

TransferFuture join_futures(std::vector<TransferFuture> parts) {
  if (parts.empty()) return make_ready_future(0);
  if (parts.size() == 1) return parts[0];
  struct Join {
    std::mutex mu;
    std::size_t left = 0;
    std::uint64_t bytes = 0;
    std::optional<Status> failure;
  };
  TransferPromise promise;
  auto join = std::make_shared<Join>();
  join->left = parts.size();
  promise.on_cancel([parts] {
    for (const TransferFuture& f : parts) f.cancel();
  });
  for (const TransferFuture& f : parts) {
    f.on_resolved([promise, join](const Status& st, std::uint64_t bytes) mutable {
      bool last = false;
      std::optional<Status> failure;
      std::uint64_t total = 0;
      {
        std::lock_guard<std::mutex> lk(join->mu);
        if (st.is_ok())
          join->bytes += bytes;
        else if (!join->failure)
          join->failure = st;
        last = --join->left == 0;
        failure = join->failure;
        total = join->bytes;
      }
      if (!last) return;
      if (failure)
        promise.fail(*failure);
      else
        promise.complete(total);
    });
  }
  // A part that failed early does not resolve the whole before the others
  // resolved (no byte of theirs may land after it), but it stops them.
  for (const TransferFuture& f : parts) {
    f.on_resolved([parts](const Status& st, std::uint64_t) {
      if (!st.is_ok()) {
        for (const TransferFuture& g : parts) g.cancel();
      }
    });
  }
  return promise.future();
}

void TransferFuture::on_resolving(Callback callback) const {
  if (!state_ || !callback) return;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->settling) {
      state_->observers.push_back(std::move(callback));
      return;
    }
  }
  state_->invoke(callback);  // status and bytes are final once settling
}

void TransferFuture::on_resolved(Callback callback) const {
  if (!state_ || !callback) return;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (!state_->resolved.load(std::memory_order_relaxed)) {
      state_->callbacks.push_back(std::move(callback));
      return;
    }
  }
  state_->invoke(callback);
}

TransferTiming TransferFuture::timing() const {
  if (!state_) return {};
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->timing;
}

void TransferPromise::mark_planned(std::uint64_t copies,
                                   TransferTiming::Clock::time_point when) noexcept {
  std::lock_guard<std::mutex> lock(state_->mu);
  TransferTiming& t = state_->timing;
  if (t.planned_marked || state_->settling) return;
  t.planned_marked = true;
  t.planned = t.posted = when;
  t.copies = copies;
}

void TransferPromise::mark_posted() noexcept {
  std::lock_guard<std::mutex> lock(state_->mu);
  TransferTiming& t = state_->timing;
  if (t.posted_marked || state_->settling) return;
  t.posted_marked = true;
  t.posted = TransferTiming::Clock::now();
  if (!t.planned_marked) {
    t.planned_marked = true;
    t.planned = t.posted;
  }
}

void TransferPromise::set_peer(std::string peer) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->timing.peer = std::move(peer);
}

TransferPromise::TransferPromise()
    : state_(std::make_shared<detail::TransferState>()),
      guard_(nullptr, [state = state_](void*) noexcept {
        state->resolve(Status(StatusCode::kInternal,
                              "engine dropped the read: its promise was destroyed unresolved"),
                       0);
      }) {}

bool TransferPromise::complete(std::uint64_t bytes) noexcept {
  return state_->resolve(Status::ok(), bytes);
}

bool TransferPromise::fail(Status status) noexcept {
  if (status.is_ok()) {
    status = Status(StatusCode::kInternal, "fail() called with an OK status");
  }
  return state_->resolve(std::move(status), 0);
}

bool TransferPromise::resolved() const noexcept {
  return state_->resolved.load(std::memory_order_acquire);
}

bool TransferPromise::cancel_requested() const noexcept {
  return state_->cancel.load(std::memory_order_acquire);
}

TransferFuture make_ready_future(std::uint64_t bytes) {
  TransferPromise p;
  p.complete(bytes);
  return p.future();
}

TransferFuture make_failed_future(Status status) {
  TransferPromise p;
  p.fail(std::move(status));
  return p.future();
}

}  // namespace mstar::kv
