// Copyright mstar-kv authors.
#include "mstar/kv/engines/fault_injection.hpp"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "mstar/kv/util/status.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv {

namespace {

using Clock = std::chrono::steady_clock;

// How often the wrapper's thread looks at inner futures in flight. The
// future type has no completion callback, so the wrapper polls; 1 ms is
// far below any timeout the tests use.
constexpr auto kPollInterval = std::chrono::milliseconds(1);
// How long shutdown() waits for the inner engine to resolve what it was
// given before reporting the inner engine as broken.
constexpr auto kShutdownGrace = std::chrono::seconds(10);

std::string ms(std::chrono::milliseconds d) { return std::to_string(d.count()) + " ms"; }

// One batch as the wrapper sees it. Fields other than the atomics are
// written before the batch is shared or under Impl::mu.
struct Batch {
  TransferPromise promise;
  RemoteHandle remote;
  std::vector<KVReadInfo> reads;  // what will be issued (a prefix for fail-after)
  std::uint64_t batch_bytes = 0;  // bytes of the whole batch as asked
  std::optional<std::uint64_t> fail_after;
  bool drop = false;
  bool duplicate = false;
  KillPoint kill_point = KillPoint::kNever;
  std::chrono::milliseconds kill_after{0};
  std::optional<std::chrono::milliseconds> cancel_after;
  std::chrono::milliseconds drop_timeout{0};
  // Guarded by Impl::mu: set while a caller's thread issues the batch (the
  // wrapper's thread then leaves it alone), and the inner future once issued.
  bool issuing = false;
  std::optional<TransferFuture> inner;
};

enum class TaskKind : std::uint8_t { kIssue, kDropTimeout, kKill, kCancel };
struct Task {
  TaskKind kind;
  std::shared_ptr<Batch> batch;
};

}  // namespace

struct FaultInjectingEngine::Impl {
  Impl(std::shared_ptr<KVTransferEngine> in, const KVLayout& l, FaultConfig c, KillHook k)
      : inner(std::move(in)), local(l), kill(std::move(k)), cfg(c), rng(cfg.seed) {}

  std::shared_ptr<KVTransferEngine> inner;
  const KVLayout local;
  const KillHook kill;  // fixed at construction: called without the lock

  mutable std::mutex mu;
  std::condition_variable cv;
  FaultConfig cfg MSTAR_KV_GUARDED_BY(mu);
  std::mt19937_64 rng MSTAR_KV_GUARDED_BY(mu);
  std::multimap<Clock::time_point, Task> timers MSTAR_KV_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Batch>> batches MSTAR_KV_GUARDED_BY(mu);  // watched until resolved
  int issuing MSTAR_KV_GUARDED_BY(mu) = 0;                              // caller threads mid-issue
  bool shut MSTAR_KV_GUARDED_BY(mu) = false;
  bool stopping MSTAR_KV_GUARDED_BY(mu) = false;
  std::mutex shutdown_mu;  // serialises shutdown()
  std::thread thread;

  std::atomic<std::uint64_t> n_batches{0}, n_delayed{0}, n_dropped{0}, n_failed_after{0},
      n_kills{0}, n_duplicates{0}, n_duplicates_ignored{0}, n_cancels{0};

  std::uint64_t bytes_per_token() const { return local.token_bytes() * local.num_kv(); }

  // The local side of every read, checked before anything is issued (the
  // remote side needs the remote layout, which only the inner engine knows).
  void check_local(std::span<const KVReadInfo> reads) const {
    for (std::size_t n = 0; n < reads.size(); ++n) {
      const KVReadInfo& r = reads[n];
      const std::string where = "read " + std::to_string(n) + ": ";
      if (r.layer_idx < 0 || r.layer_idx >= std::int64_t{local.num_layers}) {
        throw Error(StatusCode::kInvalidArgument, where + "layer " + std::to_string(r.layer_idx) +
                                                      " out of range [0, " +
                                                      std::to_string(local.num_layers) + ")");
      }
      if (r.local_page_idx < 0 || r.local_page_idx >= std::int64_t{local.num_pages}) {
        throw Error(StatusCode::kInvalidArgument,
                    where + "local page " + std::to_string(r.local_page_idx) +
                        " out of range [0, " + std::to_string(local.num_pages) +
                        ") in local cache");
      }
      if (r.token_start < 0 || r.token_start >= r.token_end ||
          r.token_end > std::int64_t{local.page_size}) {
        throw Error(StatusCode::kInvalidArgument,
                    where + "token range [" + std::to_string(r.token_start) + ", " +
                        std::to_string(r.token_end) +
                        ") must satisfy 0 <= start < end <= " + std::to_string(local.page_size));
      }
    }
  }

  // Draws this batch's faults: the fixed ones plus at most one random one.
  void decide(Batch& b, std::chrono::milliseconds& delay) {
    std::lock_guard<std::mutex> lock(mu);
    delay = cfg.delay;
    b.drop = cfg.drop;
    b.fail_after = cfg.fail_after_bytes;
    b.kill_point = cfg.kill_point;
    b.kill_after = cfg.kill_after;
    b.duplicate = cfg.duplicate_completion;
    b.cancel_after = cfg.cancel_after;
    b.drop_timeout = cfg.drop_timeout;
    const double sum =
        cfg.p_delay + cfg.p_drop + cfg.p_fail_after + cfg.p_kill + cfg.p_duplicate + cfg.p_cancel;
    if (sum <= 0) return;
    const double u = std::uniform_real_distribution<double>(0.0, 1.0)(rng);
    auto random_ms = [&] {
      MSTAR_KV_ASSERT_HELD(mu);  // called below, under the lock
      return std::chrono::milliseconds(std::uniform_int_distribution<std::int64_t>(
          0, std::max<std::int64_t>(0, cfg.max_random_delay.count()))(rng));
    };
    double edge = cfg.p_delay;
    if (u < edge) {
      delay += random_ms();
      return;
    }
    if (u < (edge += cfg.p_drop)) {
      b.drop = true;
      return;
    }
    if (u < (edge += cfg.p_fail_after)) {
      b.fail_after = b.batch_bytes == 0
                         ? 0
                         : std::uniform_int_distribution<std::uint64_t>(0, b.batch_bytes - 1)(rng);
      return;
    }
    if (u < (edge += cfg.p_kill)) {
      b.kill_point = KillPoint::kAfterDelay;
      b.kill_after = random_ms();
      return;
    }
    if (u < (edge += cfg.p_duplicate)) {
      b.duplicate = true;
      return;
    }
    if (u < edge + cfg.p_cancel) b.cancel_after = random_ms();
  }

  // Keeps the reads covering the first n bytes, splitting the read that
  // crosses n at a token boundary.
  void truncate_to(Batch& b, std::uint64_t n) const {
    const std::uint64_t bpt = bytes_per_token();
    std::vector<KVReadInfo> prefix;
    std::uint64_t acc = 0;
    for (const KVReadInfo& r : b.reads) {
      const std::uint64_t rb = static_cast<std::uint64_t>(r.token_end - r.token_start) * bpt;
      if (acc + rb <= n) {
        prefix.push_back(r);
        acc += rb;
        continue;
      }
      const std::uint64_t tokens = (n - acc) / bpt;
      if (tokens > 0) {
        KVReadInfo part = r;
        part.token_end = r.token_start + static_cast<std::int64_t>(tokens);
        prefix.push_back(part);
      }
      break;
    }
    b.reads = std::move(prefix);
  }

  void call_kill() {
    n_kills.fetch_add(1, std::memory_order_relaxed);
    if (kill) kill();
  }

  void schedule(Clock::time_point at, TaskKind kind, std::shared_ptr<Batch> b) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (!stopping) {
        timers.emplace(at, Task{kind, b});
        b.reset();
      }
    }
    if (b && kind == TaskKind::kDropTimeout) {
      // Shutting down: the timer would never run, resolve now.
      b->promise.fail({StatusCode::kShutdown, "FaultInjectingEngine shut down"});
    }
    cv.notify_all();
  }

  // Issues the batch to the inner engine. On the caller's thread
  // (`rethrow`), an Error from the inner engine propagates as it would from
  // a bare engine; on the wrapper's thread it fails the batch.
  // Returns false when the batch was resolved here.
  bool issue(const std::shared_ptr<Batch>& b, bool rethrow) {
    if (b->promise.resolved()) return false;
    if (b->promise.cancel_requested()) {
      b->promise.fail({StatusCode::kCancelled, "cancelled before the batch was issued"});
      return false;
    }
    if (b->kill_point == KillPoint::kBeforeIssue) call_kill();
    std::optional<TransferFuture> f;
    if (b->drop) {
      n_dropped.fetch_add(1, std::memory_order_relaxed);
      schedule(Clock::now() + b->drop_timeout, TaskKind::kDropTimeout, b);
    } else if (!b->reads.empty()) {
      try {
        f = inner->read_batched_async(*b->remote, b->reads);
      } catch (const Error& e) {
        if (rethrow) throw;
        b->promise.fail(e.status());
        return false;
      } catch (const std::exception& e) {
        if (rethrow) throw;
        b->promise.fail({StatusCode::kInternal, std::string("inner engine threw: ") + e.what()});
        return false;
      }
    }
    if (f) {
      // A cancel of the outer future reaches the inner one at once, on the
      // cancelling thread (here, when it came before this line).
      b->promise.on_cancel([inner = *f] { inner.cancel(); });
      std::lock_guard<std::mutex> lock(mu);
      b->inner = std::move(f);
    }
    if (b->kill_point == KillPoint::kAfterIssue) call_kill();
    if (b->kill_point == KillPoint::kAfterDelay) {
      schedule(Clock::now() + b->kill_after, TaskKind::kKill, b);
    }
    if (b->cancel_after) {
      schedule(Clock::now() + *b->cancel_after, TaskKind::kCancel, b);
    }
    bool has_inner;
    {
      std::lock_guard<std::mutex> lock(mu);
      has_inner = b->inner.has_value();
    }
    if (!b->drop && !has_inner) {
      // Nothing was issued: an empty prefix, or nothing to read.
      finish(*b, Status::ok(), 0);
      return false;
    }
    cv.notify_all();
    return true;
  }

  // Resolves the outer future once the inner read is over.
  void finish(Batch& b, const Status& inner_status, std::uint64_t inner_bytes) {
    bool ok = inner_status.is_ok();
    if (b.fail_after) {
      ok = false;
      b.promise.fail({StatusCode::kPeerFailure,
                      "fault injection: failed after " + std::to_string(*b.fail_after) + " of " +
                          std::to_string(b.batch_bytes) + " bytes (" +
                          std::to_string(inner_status.is_ok() ? inner_bytes : 0) +
                          " issued and read; inner status " + inner_status.to_string() + ")"});
    } else if (ok) {
      b.promise.complete(inner_bytes);
    } else {
      b.promise.fail(inner_status);
    }
    if (b.duplicate) {
      n_duplicates.fetch_add(1, std::memory_order_relaxed);
      const bool second =
          ok ? b.promise.fail({StatusCode::kInternal, "fault injection: duplicate completion"})
             : b.promise.complete(b.batch_bytes + 1);
      if (!second) n_duplicates_ignored.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void run_task(const Task& t) {
    Batch& b = *t.batch;
    switch (t.kind) {
      case TaskKind::kIssue:
        issue(t.batch, /*rethrow=*/false);
        break;
      case TaskKind::kDropTimeout:
        b.promise.fail({StatusCode::kTimeout,
                        "fault injection: batch of " + std::to_string(b.reads.size()) +
                            " reads dropped, no completion within " + ms(b.drop_timeout)});
        break;
      case TaskKind::kKill:
        call_kill();
        break;
      case TaskKind::kCancel:
        n_cancels.fetch_add(1, std::memory_order_relaxed);
        b.promise.future().cancel();
        break;
    }
  }

  // The wrapper's thread: runs due timers, resolves outer futures whose
  // inner futures resolved and cancels batches not issued yet (issued ones
  // forward a cancel themselves: issue()).
  void loop() {
    internal::UniqueLock lock(mu);
    for (;;) {
      const auto now = Clock::now();
      if (!timers.empty() && timers.begin()->first <= now) {
        Task t = std::move(timers.begin()->second);
        timers.erase(timers.begin());
        lock.unlock();
        run_task(t);
        lock.lock();
        continue;
      }
      // Look at every batch in flight (copies: finish() runs unlocked).
      std::vector<std::shared_ptr<Batch>> done;
      std::vector<std::shared_ptr<Batch>> cancel_unissued;
      for (auto it = batches.begin(); it != batches.end();) {
        Batch& b = **it;
        if (b.issuing) {
          ++it;
          continue;
        }
        if (b.inner) {
          if (b.inner->ready()) {
            done.push_back(*it);
            it = batches.erase(it);
            continue;
          }
        } else if (b.promise.resolved()) {
          it = batches.erase(it);
          continue;
        } else if (b.promise.cancel_requested()) {
          // Not issued (delayed or dropped): nothing can land, resolve now.
          cancel_unissued.push_back(*it);
          it = batches.erase(it);
          continue;
        }
        ++it;
      }
      if (!done.empty() || !cancel_unissued.empty()) {
        lock.unlock();
        for (auto& b : done) finish(*b, b->inner->status(), b->inner->bytes());
        for (auto& b : cancel_unissued) {
          b->promise.fail({StatusCode::kCancelled, "cancelled before the batch was issued"});
        }
        lock.lock();
        continue;
      }
      if (stopping && batches.empty() && timers.empty() && issuing == 0) return;
      if (!batches.empty()) {
        auto until = now + kPollInterval;
        if (!timers.empty()) until = std::min(until, timers.begin()->first);
        cv.wait_until(lock, until);
      } else if (!timers.empty()) {
        cv.wait_until(lock, timers.begin()->first);
      } else {
        cv.wait(lock);
      }
    }
  }
};

FaultInjectingEngine::FaultInjectingEngine(std::shared_ptr<KVTransferEngine> inner,
                                           const KVLayout& local, FaultConfig config,
                                           KillHook kill) {
  if (!inner) {
    throw Error(StatusCode::kInvalidArgument, "FaultInjectingEngine needs an inner engine");
  }
  local.validate();
  impl_ = std::make_unique<Impl>(std::move(inner), local, config, std::move(kill));
  impl_->thread = std::thread([this] { impl_->loop(); });
}

FaultInjectingEngine::~FaultInjectingEngine() { shutdown(); }

KVTransferInfo FaultInjectingEngine::get_kv_transfer_info() const {
  return impl_->inner->get_kv_transfer_info();
}

std::string FaultInjectingEngine::name() const { return impl_->inner->name(); }

RemoteHandle FaultInjectingEngine::open_remote(const KVTransferInfo& remote) const {
  return impl_->inner->open_remote(remote);
}

std::optional<TransferFuture> FaultInjectingEngine::read_batched_async(
    const RemoteCache& remote_kv_info, std::span<const KVReadInfo> read_info) {
  Impl& im = *impl_;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    if (im.shut) throw Error(StatusCode::kShutdown, "FaultInjectingEngine is shut down");
  }
  if (read_info.empty()) return im.inner->read_batched_async(remote_kv_info, read_info);
  im.check_local(read_info);

  auto b = std::make_shared<Batch>();
  b->remote = remote_kv_info.shared_from_this();
  b->reads.assign(read_info.begin(), read_info.end());
  for (const KVReadInfo& r : read_info) {
    b->batch_bytes +=
        static_cast<std::uint64_t>(r.token_end - r.token_start) * im.bytes_per_token();
  }
  std::chrono::milliseconds delay{0};
  im.decide(*b, delay);
  im.n_batches.fetch_add(1, std::memory_order_relaxed);
  if (b->fail_after) {
    im.n_failed_after.fetch_add(1, std::memory_order_relaxed);
    im.truncate_to(*b, *b->fail_after);
  }
  TransferFuture outer = b->promise.future();

  if (delay.count() > 0) {
    im.n_delayed.fetch_add(1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(im.mu);
      if (im.shut) throw Error(StatusCode::kShutdown, "FaultInjectingEngine is shut down");
      im.batches.push_back(b);  // watched for cancellation until issued
      im.timers.emplace(Clock::now() + delay, Task{TaskKind::kIssue, b});
    }
    im.cv.notify_all();
    return outer;
  }

  {
    std::lock_guard<std::mutex> lock(im.mu);
    if (im.shut) throw Error(StatusCode::kShutdown, "FaultInjectingEngine is shut down");
    ++im.issuing;
    b->issuing = true;
    im.batches.push_back(b);
  }
  // Hands the batch to the wrapper's thread however issue() ends.
  struct Done {
    Impl& im;
    Batch& b;
    bool threw = true;
    ~Done() {
      {
        std::lock_guard<std::mutex> lock(im.mu);
        --im.issuing;
        b.issuing = false;
        if (threw) {
          std::erase_if(im.batches, [this](const auto& p) { return p.get() == &b; });
        }
      }
      im.cv.notify_all();
    }
  } done{im, *b};
  im.issue(b, /*rethrow=*/true);
  done.threw = false;
  return outer;
}

void FaultInjectingEngine::shutdown() {
  Impl& im = *impl_;
  std::lock_guard<std::mutex> serial(im.shutdown_mu);
  {
    std::lock_guard<std::mutex> lock(im.mu);
    if (im.shut && !im.thread.joinable()) return;
    im.shut = true;
  }
  im.inner->shutdown();
  std::multimap<Clock::time_point, Task> pending;
  {
    std::lock_guard<std::mutex> lock(im.mu);
    pending.swap(im.timers);
    im.stopping = true;
  }
  for (auto& [at, t] : pending) {
    if (t.kind == TaskKind::kIssue || t.kind == TaskKind::kDropTimeout) {
      t.batch->promise.fail(
          {StatusCode::kShutdown, "FaultInjectingEngine shut down before the batch was issued"});
    }
  }
  im.cv.notify_all();
  // Issued batches resolve as the inner engine resolves them (its shutdown
  // resolves everything in flight); an inner engine that breaks that
  // contract is reported, not waited on forever.
  const auto deadline = Clock::now() + kShutdownGrace;
  for (;;) {
    {
      internal::UniqueLock lock(im.mu);
      if (im.batches.empty() && im.issuing == 0) break;
      if (Clock::now() >= deadline) {
        for (auto& b : im.batches) {
          b->promise.fail({StatusCode::kInternal,
                           "inner engine did not resolve a read within 10 s of its shutdown"});
        }
        im.batches.clear();
        break;
      }
    }
    std::this_thread::sleep_for(kPollInterval);
  }
  im.cv.notify_all();
  if (im.thread.joinable()) im.thread.join();
}

void FaultInjectingEngine::set_config(FaultConfig config) {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (config.seed != impl_->cfg.seed) impl_->rng.seed(config.seed);
  impl_->cfg = config;
}

FaultConfig FaultInjectingEngine::config() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->cfg;
}

FaultCounters FaultInjectingEngine::counters() const {
  const Impl& im = *impl_;
  FaultCounters c;
  c.batches = im.n_batches.load(std::memory_order_relaxed);
  c.delayed = im.n_delayed.load(std::memory_order_relaxed);
  c.dropped = im.n_dropped.load(std::memory_order_relaxed);
  c.failed_after_bytes = im.n_failed_after.load(std::memory_order_relaxed);
  c.kills = im.n_kills.load(std::memory_order_relaxed);
  c.duplicates = im.n_duplicates.load(std::memory_order_relaxed);
  c.duplicates_ignored = im.n_duplicates_ignored.load(std::memory_order_relaxed);
  c.cancels = im.n_cancels.load(std::memory_order_relaxed);
  return c;
}

std::uint64_t FaultInjectingEngine::in_flight() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<std::uint64_t>(
      std::count_if(impl_->batches.begin(), impl_->batches.end(),
                    [](const auto& b) { return !b->promise.resolved(); }));
}

KVTransferEngine& FaultInjectingEngine::inner() noexcept { return *impl_->inner; }

}  // namespace mstar::kv

namespace mstar::kv {

void FaultInjectingEngine::notify_done(const RemoteCache& remote, std::uint64_t seq_id) {
  inner().notify_done(remote, seq_id);
}

void FaultInjectingEngine::connect(const RemoteCache& remote) { inner().connect(remote); }

std::unique_ptr<LayerWatch> FaultInjectingEngine::watch_layers(
    const RemoteCache& remote_kv_info, std::span<const KVReadInfo> read_info) {
  // The readiness comes from the inner engine; each layer's read goes
  // through this wrapper's read_batched_async (and its faults).
  return inner().watch_layers(remote_kv_info, read_info);
}

void FaultInjectingEngine::set_done_handler(DoneHandler handler) {
  inner().set_done_handler(std::move(handler));
}

ServedStats FaultInjectingEngine::served_stats() const { return impl_->inner->served_stats(); }

}  // namespace mstar::kv
