// Copyright mstar-kv authors.
//
// TransferFuture: the outcome of one asynchronous read; TransferPromise, the
// engine's side; join_futures.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace detail {
struct TransferState;
}

// Where one read's time went, stamped by the engine on its promise (steady
// clock). created: the promise was made (the engine began validating);
// planned: the descriptor and reads were validated and the copies planned;
// posted: the last byte range was handed to the transport (or copy workers);
// resolved: the future resolved. planned/posted equal created until the
// engine stamps them (*_marked tell; KVTransferManager then uses the time its
// call to the engine returned). `copies` is
// the number of byte ranges after coalescing; `peer` names the remote cache's
// owner for statistics ("entity@session", "pid 123"), empty if unknown.
struct TransferTiming {
  using Clock = std::chrono::steady_clock;
  Clock::time_point created;
  Clock::time_point planned;
  Clock::time_point posted;
  Clock::time_point resolved;  // time_point{} while unresolved
  bool planned_marked = false;
  bool posted_marked = false;
  std::uint64_t copies = 0;
  std::string peer;
};

// A future resolves exactly once, to the number of bytes read or to an error
// Status. Resolution is a promise from the engine: after it, no byte of that
// read lands in a local page (a failed or cancelled read may have written
// some of its destination pages before resolving; those pages hold undefined
// data, and no other page is touched).
//
// Thread safety: every method is safe from any thread. Dropping a future is
// safe at any time; the transfer then continues to completion unobserved
// (call cancel() first to stop it). Copies of a future share one state.
class TransferFuture {
 public:
  TransferFuture() = default;  // invalid: valid() is false

  bool valid() const noexcept { return state_ != nullptr; }
  // Non-blocking poll.
  bool ready() const noexcept;
  // Waits up to `timeout`; true if resolved. A false return does not resolve
  // the future: the engine's own timeout does that.
  bool wait_for(std::chrono::nanoseconds timeout) const;
  void wait() const;
  // Resolved status; StatusCode::kInProgress while unresolved.
  Status status() const;
  // Bytes read; 0 until resolved successfully.
  std::uint64_t bytes() const noexcept;
  // Waits, then returns the bytes read or throws Error with the status.
  std::uint64_t get() const;
  // Asks the engine to stop. The future still resolves (kCancelled, or
  // success if the bytes were already there); returns immediately.
  void cancel() const noexcept;

  // Runs `callback(status, bytes)` exactly once when the future resolves: on
  // the thread that resolves it (an engine's worker or progress thread), or
  // right here on the calling thread if it already resolved. Callbacks run
  // in registration order after waiters are woken, with no library lock
  // held; they must not block (hand work to another thread instead) and
  // must not throw (an exception is caught and dropped). This is how
  // bindings complete a foreign future (Python's concurrent.futures) without
  // parking a thread per read. bytes is 0 unless status is OK. Does nothing
  // on an invalid future.
  using Callback = std::function<void(const Status& status, std::uint64_t bytes)>;
  void on_resolved(Callback callback) const;
  // The same, but run before waiters are woken (and before on_resolved
  // callbacks): bookkeeping a thread must find done once wait() or get()
  // returned (the manager's statistics). Same rules; keep it short, every
  // waiter waits for it.
  void on_resolving(Callback callback) const;

  // The phase stamps so far (see TransferTiming). Final once resolved.
  TransferTiming timing() const;

 private:
  friend class TransferPromise;
  explicit TransferFuture(std::shared_ptr<detail::TransferState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::TransferState> state_;
};

// The engine's side. complete()/fail() resolve the shared state; only the
// first resolution counts (later ones return false and change nothing), so
// an engine may race a timeout against a completion safely.
// Copies of a promise share one state; when the last copy is destroyed with
// the future still unresolved, the future resolves with kInternal ("engine
// dropped the read") instead of waiting forever.
// Safe from any thread.
class TransferPromise {
 public:
  TransferPromise();

  TransferFuture future() const { return TransferFuture(state_); }
  bool complete(std::uint64_t bytes) noexcept;
  bool fail(Status status) noexcept;
  bool resolved() const noexcept;
  // True once cancel() was called on any copy of the future.
  bool cancel_requested() const noexcept;
  // Runs `hook` once, on the thread that first calls cancel() on a copy of
  // the future (right here if that already happened). It must not block or
  // throw. For engines that forward a cancel (join_futures).
  void on_cancel(std::function<void()> hook);

  // Phase stamps (TransferTiming): call mark_planned once the descriptor and
  // reads are validated and the copies planned, mark_posted once the last
  // byte range was handed over. set_peer names the remote owner. Cheap (a
  // clock read and a store under the state's lock); only the first call of
  // each counts.
  void mark_planned(std::uint64_t copies,
                    TransferTiming::Clock::time_point when = TransferTiming::Clock::now()) noexcept;
  void mark_posted() noexcept;
  void set_peer(std::string peer);

 private:
  std::shared_ptr<detail::TransferState> state_;
  // Shared by the copies of this promise; its deleter resolves an
  // unresolved state when the last copy goes away.
  std::shared_ptr<void> guard_;
};

// A future that is already resolved (for engines that finish synchronously).
TransferFuture make_ready_future(std::uint64_t bytes);
TransferFuture make_failed_future(Status status);

// One future for several reads (one per peer of a tensor-parallel merge):
// resolves once every part resolved, with the sum of their bytes, or with
// the first failure (a part that fails cancels the others; the whole still
// waits for them, so no byte lands after it resolves). cancel() cancels
// every part. One part: that part itself.
TransferFuture join_futures(std::vector<TransferFuture> parts);

}  // namespace mstar::kv
