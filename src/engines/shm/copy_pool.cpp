// Copyright mstar-kv authors.
#include "copy_pool.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::shm {

namespace {

enum Stop : std::uint8_t { kRunning = 0, kCancel, kDeadline, kShutdownStop, kFailed };

// Pieces: large enough that the per-piece bookkeeping vanishes next to the
// copy, small enough that the pool balances and stops within ~1 ms.
constexpr std::uint64_t kMinPiece = 256u << 10;
constexpr std::uint64_t kMaxPiece = 4u << 20;
constexpr auto kPollPeriod = std::chrono::milliseconds(10);

}  // namespace

std::vector<StridedSpan> split_strided(std::span<const StridedSpan> spans,
                                       std::uint64_t max_bytes) {
  std::vector<StridedSpan> out;
  out.reserve(spans.size());
  for (const StridedSpan& s : spans) {
    if (s.bytes() <= max_bytes) {
      out.push_back(s);
    } else if (s.rows == 1) {
      for (std::uint64_t done = 0; done < s.length; done += max_bytes) {
        out.push_back(
            {s.local_offset + done, s.remote_offset + done, std::min(max_bytes, s.length - done)});
      }
    } else {  // whole rows per piece (a row longer than a piece stays whole)
      const std::uint64_t per = std::max<std::uint64_t>(1, max_bytes / s.length);
      for (std::uint64_t row = 0; row < s.rows; row += per) {
        const std::uint64_t n = std::min(per, s.rows - row);
        out.push_back({s.local_offset + row * s.local_stride,
                       s.remote_offset + row * s.remote_stride, s.length, n,
                       n > 1 ? s.local_stride : 0, n > 1 ? s.remote_stride : 0});
      }
    }
  }
  return out;
}

struct CopyPool::Job {
  TransferPromise promise;
  CopyJobSpec spec;
  std::vector<std::uint32_t> piece_begin;  // piece i: spans (or reads) [begin[i], begin[i+1])
  std::uint32_t pieces = 0;
  std::chrono::steady_clock::time_point deadline;
  std::chrono::milliseconds timeout{0};

  // Dekker-style handshake between workers and stoppers (all seq_cst): a
  // worker raises `inflight` and then reads `stop`; a stopper writes `stop`
  // and then reads `inflight`. At least one of them sees the other, so either
  // the worker backs off or the stopper leaves resolution to the last worker.
  std::atomic<std::uint32_t> next_piece{0};
  std::atomic<std::uint32_t> done_pieces{0};
  std::atomic<std::uint32_t> inflight{0};
  std::atomic<std::uint8_t> stop{kRunning};
  std::mutex failure_mu;
  Status failure MSTAR_KV_GUARDED_BY(failure_mu);  // the first failed piece's (kFailed)

  void resolve_stopped() noexcept {
    switch (stop.load()) {
      case kFailed: {
        std::lock_guard<std::mutex> lock(failure_mu);
        promise.fail(failure);
        break;
      }
      case kCancel:
        promise.fail({StatusCode::kCancelled, spec.what + " was cancelled"});
        break;
      case kDeadline:
        promise.fail({StatusCode::kTimeout,
                      spec.what + " did not finish in " + std::to_string(timeout.count()) + " ms"});
        break;
      default:
        promise.fail({StatusCode::kShutdown, spec.what + " was stopped by engine shutdown"});
        break;
    }
  }

  // A piece failed: the job stops with `why` (the first failure's).
  void fail_piece(Status why) noexcept {
    {
      std::lock_guard<std::mutex> lock(failure_mu);
      if (failure.is_ok()) failure = std::move(why);
    }
    std::uint8_t expected = kRunning;
    stop.compare_exchange_strong(expected, kFailed);
  }

  void request_stop(Stop why) noexcept {
    std::uint8_t expected = kRunning;
    stop.compare_exchange_strong(expected, why);
    if (inflight.load() == 0) resolve_stopped();
  }

  // Copies at most one piece; false when nothing is left for this worker.
  bool work_one() noexcept {
    inflight.fetch_add(1);
    bool more = false;
    if (stop.load() == kRunning) {
      std::uint8_t expected = kRunning;
      if (promise.cancel_requested()) {
        stop.compare_exchange_strong(expected, kCancel);
      } else if (std::chrono::steady_clock::now() >= deadline) {
        stop.compare_exchange_strong(expected, kDeadline);
      }
    }
    if (stop.load() == kRunning) {
      const std::uint32_t i = next_piece.fetch_add(1, std::memory_order_relaxed);
      if (i < pieces) {
        const StridedSpan* s = spec.spans.data() + piece_begin[i];
        const StridedSpan* e = spec.spans.data() + piece_begin[i + 1];
        if (spec.plan) {  // plan this run of reads first
          thread_local StridedPlan planned;
          planned.spans.clear();
          spec.plan(std::span<const KVReadInfo>(spec.reads)
                        .subspan(piece_begin[i], piece_begin[i + 1] - piece_begin[i]),
                    planned);
          s = planned.spans.data();
          e = s + planned.spans.size();
        }
        Status copied = Status::ok();
        if (spec.cma != nullptr) {
          copied = spec.cma->copy(spec.dst, s, e, spec.total_bytes >= kStreamBytes);
        } else {
          const bool streaming = spec.total_bytes >= kStreamBytes;
          for (; s != e; ++s) {
            const StridedSpan* next = s + 1 != e ? s + 1 : nullptr;
            copy_span_at(
                spec.dst.pointer(s->local_offset),
                spec.src.pointer<const std::byte>(s->remote_offset), *s, streaming,
                next != nullptr ? spec.src.pointer<const std::byte>(next->remote_offset) : nullptr,
                next);
          }
          if (streaming) stream_fence();  // before the count publishes the piece
        }
        if (!copied.is_ok()) {
          fail_piece(std::move(copied));
        } else if (done_pieces.fetch_add(1, std::memory_order_acq_rel) + 1 == pieces) {
          Status v = spec.verify ? spec.verify() : Status::ok();
          if (v.is_ok()) {
            promise.complete(spec.total_bytes);
          } else {
            promise.fail(std::move(v));
          }
        }
        more = i + 1 < pieces;
      }
    }
    if (inflight.fetch_sub(1) == 1 && stop.load() != kRunning) resolve_stopped();
    return more;
  }
};

CopyPool::CopyPool(std::uint32_t workers, std::chrono::milliseconds timeout)
    : workers_(workers), timeout_(timeout) {
  threads_.reserve(workers_);
  try {
    for (std::uint32_t i = 0; i < workers_; ++i) threads_.emplace_back([this] { worker_loop(); });
    watchdog_ = std::thread([this] { watchdog_loop(); });
  } catch (...) {
    shutdown();
    throw;
  }
}

CopyPool::~CopyPool() { shutdown(); }

TransferFuture CopyPool::submit(CopyJobSpec spec, bool caller_helps) {
  auto job = std::make_shared<Job>();
  job->timeout = timeout_;
  job->deadline = std::chrono::steady_clock::now() + timeout_;
  // Split so that no span exceeds one piece, then cut the span list into
  // pieces of about total / (4 x workers) bytes, within [kMinPiece, kMaxPiece].
  const std::uint64_t target = std::clamp<std::uint64_t>(
      spec.total_bytes / (std::uint64_t{workers_} * 4), kMinPiece, kMaxPiece);
  job->promise.mark_planned(spec.plan ? spec.copies : spec.spans.size(), spec.planned_at);
  job->promise.set_peer(spec.peer);
  job->piece_begin.reserve(spec.total_bytes / target + 2);
  if (spec.plan) {
    // Runs of reads of about `target` bytes each (reads of one request are
    // pages of one size, but for the partial first and last ones).
    const std::size_t n = spec.reads.size();
    const std::uint64_t pieces = std::clamp<std::uint64_t>(spec.total_bytes / target, 1, n);
    const std::size_t per = static_cast<std::size_t>((n + pieces - 1) / pieces);
    for (std::size_t i = 0; i < n; i += per) {
      job->piece_begin.push_back(static_cast<std::uint32_t>(i));
    }
    job->pieces = static_cast<std::uint32_t>(job->piece_begin.size());
    job->piece_begin.push_back(static_cast<std::uint32_t>(n));
  } else {
    bool needs_split = false;
    for (const StridedSpan& s : spec.spans) needs_split |= s.bytes() > target;
    if (needs_split) spec.spans = split_strided(spec.spans, target);
    std::uint64_t acc = 0;
    for (std::size_t i = 0; i < spec.spans.size(); ++i) {
      if (acc == 0) job->piece_begin.push_back(static_cast<std::uint32_t>(i));
      acc += spec.spans[i].bytes();
      if (acc >= target) acc = 0;
    }
    job->pieces = static_cast<std::uint32_t>(job->piece_begin.size());
    job->piece_begin.push_back(static_cast<std::uint32_t>(spec.spans.size()));
  }
  job->spec = std::move(spec);
  TransferFuture future = job->promise.future();
  if (job->pieces == 0) {  // nothing to copy
    job->promise.complete(job->spec.total_bytes);
    return future;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) {
      throw Error(StatusCode::kShutdown, job->spec.what + " refused: the engine is shut down");
    }
    queue_.push_back(job);
    active_.push_back(job);
  }
  work_cv_.notify_all();
  watch_cv_.notify_one();
  job->promise.mark_posted();  // ignored if the workers already finished it
  if (caller_helps) {
    while (job->work_one()) {
    }
  }
  return future;
}

void CopyPool::worker_loop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      internal::UniqueLock lock(mu_);
      work_cv_.wait(lock, [&] {
        MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
        return stopping_ || !queue_.empty();
      });
      if (queue_.empty()) return;  // stopping, and every job was handed out
      job = queue_.front();
    }
    while (job->work_one()) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (!queue_.empty() && queue_.front() == job) queue_.pop_front();
  }
}

void CopyPool::watchdog_loop() {
  internal::UniqueLock lock(mu_);
  while (!stopping_) {
    std::erase_if(active_, [](const auto& j) { return j->promise.resolved(); });
    if (active_.empty()) {
      watch_cv_.wait(lock);
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    auto wake = now + kPollPeriod;
    for (const auto& j : active_) {
      // Jobs still queued behind others resolve here, not when a worker
      // finally reaches them.
      if (j->promise.cancel_requested()) {
        j->request_stop(kCancel);
      } else if (now >= j->deadline) {
        j->request_stop(kDeadline);
      } else {
        wake = std::min(wake, j->deadline);
      }
    }
    watch_cv_.wait_until(lock, wake);
  }
}

void CopyPool::shutdown() {
  std::lock_guard<std::mutex> serial(shutdown_mu_);
  std::vector<std::shared_ptr<Job>> active;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    active = active_;
    for (const auto& j : active) j->request_stop(kShutdownStop);
  }
  work_cv_.notify_all();
  watch_cv_.notify_all();
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  if (watchdog_.joinable()) watchdog_.join();
  // No worker runs any more: whatever is unresolved can be resolved now.
  for (const auto& j : active) {
    std::uint8_t expected = kRunning;
    j->stop.compare_exchange_strong(expected, kShutdownStop);
    j->resolve_stopped();
  }
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
  active_.clear();
}

}  // namespace mstar::kv::shm
