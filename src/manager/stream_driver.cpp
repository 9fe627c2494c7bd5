// Copyright mstar-kv authors.
//
// Layer-wise streaming (streaming.hpp): the stream state, the driver thread
// that polls the owners' readiness and issues each layer's reads, and
// KVTransferManager::start_streaming_retrieve.
#include "mstar/kv/streaming.hpp"

#include "manager/stream_driver.hpp"

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "manager/issue_reads.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv {

using Clock = std::chrono::steady_clock;

namespace detail {

// Wakes the driver; shared with the callbacks of the futures in flight, which
// may run after the driver is gone.
struct Waker {
  std::mutex mu;
  std::condition_variable cv;
  bool kicked MSTAR_KV_GUARDED_BY(mu) = false;
  void kick() {
    {
      std::lock_guard<std::mutex> lock(mu);
      kicked = true;
    }
    cv.notify_one();
  }
};

struct StreamState {
  // Set before the stream is handed to the driver, then read-only.
  std::uint32_t num_layers = 0;
  // One per epoch the stream's remote pages carry (one, unless the
  // descriptor names page_epochs for shared pages): the handle, opened once
  // with that epoch for every layer's read of its pages, the watch on those
  // pages (which checks the same epoch), and the reads by layer. The watch
  // is the driver thread's alone (below).
  struct Source {
    RemoteHandle remote;
    std::unique_ptr<LayerWatch> watch;
    std::vector<std::vector<KVReadInfo>> layer_reads;
  };
  std::vector<Source> sources;
  StreamOptions options;
  std::chrono::milliseconds ready_timeout{0};
  TransferPromise promise;
  TransferFuture whole = promise.future();
  std::atomic<bool> cancel{false};

  // Waiters (wait_for_layer).
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  std::atomic<std::uint32_t> done{0};  // written under mu
  bool failed MSTAR_KV_GUARDED_BY(mu) = false;
  Status error MSTAR_KV_GUARDED_BY(mu);

  // The driver thread's alone. The sources' watches are dropped as the
  // stream resolves, before its future does: the stream's copies
  // (LayerStream) live as long as the caller likes, but a watch holds the
  // engine's resources (a registered scratch page, a request to the owner),
  // which the engine's shutdown releases, and must not outlive the engine.
  void drop_watches() {
    for (Source& src : sources) src.watch.reset();
  }
  // How long the driver may sleep between polls of this stream: the
  // options' poll_interval, or the watch's interval when it wakes the
  // driver itself (LayerWatch::wake_on_news).
  std::chrono::microseconds idle_poll{0};
  struct Group {
    std::uint32_t first = 0, end = 0;  // layers [first, end)
    TransferFuture future;
  };
  std::deque<Group> in_flight;
  std::uint32_t next_issue = 0;  // first layer not issued
  std::uint32_t ready_seen = 0;
  Clock::time_point last_ready = Clock::now();
  std::uint64_t bytes = 0;
  bool stopping = false;
  bool prefix_broken = false;  // a group failed: later layers are not "done"
  Status stop_status;

  void set_failed(const Status& s) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failed) return;
      failed = true;
      error = s;
    }
    cv.notify_all();
  }
  void set_done(std::uint32_t n) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done.store(n, std::memory_order_release);
    }
    cv.notify_all();
  }
};

}  // namespace detail

namespace {

using detail::StreamState;

std::string layers_text(std::uint32_t first, std::uint32_t end) {
  return end == first + 1 ? "layer " + std::to_string(first)
                          : "layers [" + std::to_string(first) + ", " + std::to_string(end) + ")";
}

class StreamDriver {
 public:
  explicit StreamDriver(KVTransferEngine& engine)
      : engine_(engine), waker_(std::make_shared<detail::Waker>()), thread_([this] { loop(); }) {}
  ~StreamDriver() { stop(); }
  StreamDriver(const StreamDriver&) = delete;
  StreamDriver& operator=(const StreamDriver&) = delete;

  void add(std::shared_ptr<StreamState> s) {
    // A watch that answers asynchronously wakes the driver when it has news
    // (the Waker outlives the driver: a late call does nothing).
    std::weak_ptr<detail::Waker> weak = waker_;
    std::optional<std::chrono::microseconds> watch_idle;
    for (auto& src : s->sources) {
      const auto idle = src.watch->wake_on_news([weak] {
        if (auto w = weak.lock()) w->kick();
      });
      // A watch that never wakes the driver (0) sets the pace for all.
      watch_idle = std::min(watch_idle.value_or(idle), idle);
    }
    s->idle_poll =
        std::max(s->options.poll_interval, watch_idle.value_or(std::chrono::microseconds{0}));
    {
      std::lock_guard<std::mutex> lock(waker_->mu);
      incoming_.push_back(std::move(s));
      waker_->kicked = true;
    }
    waker_->cv.notify_one();
  }

  // Every unfinished stream stops (kShutdown, once nothing is in flight);
  // joins the thread. Idempotent.
  void stop() noexcept {
    {
      std::lock_guard<std::mutex> lock(waker_->mu);
      stopping_ = true;
      waker_->kicked = true;
    }
    waker_->cv.notify_one();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void loop() {
    std::vector<std::shared_ptr<StreamState>> active;
    for (;;) {
      bool shutting = false;
      std::chrono::microseconds wait{1000};
      {
        internal::UniqueLock lock(waker_->mu);
        for (auto& s : incoming_) active.push_back(std::move(s));
        incoming_.clear();
        shutting = stopping_;
        if (active.empty()) {
          if (shutting) return;
          waker_->cv.wait(lock, [&] { return stopping_ || !incoming_.empty(); });
          continue;
        }
        waker_->kicked = false;
      }
      bool progressed = false;
      for (auto& s : active) {
        progressed |= step(*s, shutting);
        wait = std::min(wait, s->idle_poll);
      }
      std::erase_if(active, [](const auto& s) { return s->promise.resolved(); });
      if (!progressed && !active.empty()) {
        std::unique_lock<std::mutex> lock(waker_->mu);
        waker_->cv.wait_for(lock, wait, [&] {
          MSTAR_KV_ASSERT_HELD(waker_->mu);  // the condition runs under the lock
          return waker_->kicked || stopping_;
        });
      }
    }
  }

  void stop_stream(StreamState& s, Status status) {
    if (s.stopping) return;
    s.stopping = true;
    s.stop_status = std::move(status);
    for (auto& g : s.in_flight) g.future.cancel();
    s.set_failed(s.stop_status);
  }

  // One look at one stream; true when something moved.
  bool step(StreamState& s, bool shutting) {
    bool progressed = false;
    if (!s.stopping) {
      if (shutting) {
        stop_stream(s, {StatusCode::kShutdown, "the manager shut down with the stream at layer " +
                                                   std::to_string(s.done.load()) + " of " +
                                                   std::to_string(s.num_layers)});
      } else if (s.cancel.load(std::memory_order_acquire) || s.promise.cancel_requested()) {
        stop_stream(s, {StatusCode::kCancelled,
                        "stream cancelled with " + std::to_string(s.done.load()) + " of " +
                            std::to_string(s.num_layers) + " layers in place"});
      }
    }
    // A failed read anywhere stops the stream at once.
    for (const auto& g : s.in_flight) {
      if (!s.stopping && g.future.ready() && !g.future.status().is_ok()) {
        const Status st = g.future.status();
        stop_stream(s, {st.code(), "read of " + layers_text(g.first, g.end) + ": " + st.message()});
      }
    }
    // Layers are done in order: only the oldest read completes a prefix.
    while (!s.in_flight.empty() && s.in_flight.front().future.ready()) {
      const auto g = s.in_flight.front();
      s.in_flight.pop_front();
      progressed = true;
      if (!g.future.status().is_ok()) {
        s.prefix_broken = true;
        continue;
      }
      s.bytes += g.future.bytes();
      if (s.prefix_broken) continue;
      for (std::uint32_t l = g.first; l < g.end; ++l) {
        s.set_done(l + 1);
        if (s.options.on_layer) {
          try {
            s.options.on_layer(l);
          } catch (...) {
            // on_layer must not throw (streaming.hpp); nothing to hand it to.
          }
        }
      }
    }
    const std::uint32_t done = s.done.load(std::memory_order_acquire);
    if (done == s.num_layers && s.in_flight.empty()) {
      s.drop_watches();  // before the future resolves (see StreamState::drop_watches)
      s.promise.complete(s.bytes);
      return true;
    }
    if (s.stopping) {
      if (s.in_flight.empty()) {
        s.drop_watches();
        s.promise.fail(s.stop_status);
        return true;
      }
      return progressed;
    }
    if (s.next_issue >= s.num_layers || s.in_flight.size() >= s.options.max_reads_in_flight) {
      return progressed;
    }
    // Ready: what every source's pages have (each watch only rises).
    std::uint32_t ready = s.num_layers;
    for (auto& src : s.sources) {
      std::uint32_t src_ready = 0;
      Status st = src.watch->poll(&src_ready);
      if (!st.is_ok()) {
        stop_stream(s, {st.code(), "layer readiness of " + layers_text(s.next_issue, s.num_layers) +
                                       ": " + st.message()});
        return true;
      }
      ready = std::min(ready, src_ready);
    }
    const auto now = Clock::now();
    if (ready > s.ready_seen) {
      s.ready_seen = ready;
      s.last_ready = now;
    }
    if (s.ready_seen <= s.next_issue) {
      if (now - s.last_ready > s.ready_timeout) {
        stop_stream(s,
                    {StatusCode::kTimeout, "layer " + std::to_string(s.next_issue) + " of " +
                                               std::to_string(s.num_layers) +
                                               " was not marked ready by the owner within " +
                                               std::to_string(s.ready_timeout.count()) + " ms (" +
                                               std::to_string(s.ready_seen) + " layers ready)"});
        return true;
      }
      return progressed;
    }
    // Everything ready now goes as one read, in layer order.
    const std::uint32_t first = s.next_issue;
    const std::uint32_t end = s.ready_seen;
    auto reads_of = [&](const StreamState::Source& src) {
      std::vector<KVReadInfo> reads;
      for (std::uint32_t l = first; l < end; ++l) {
        reads.insert(reads.end(), src.layer_reads[l].begin(), src.layer_reads[l].end());
      }
      return reads;
    };
    s.next_issue = end;
    std::optional<TransferFuture> f;
    try {
      if (s.sources.size() == 1) {
        f = engine_.read_batched_async(*s.sources.front().remote, reads_of(s.sources.front()));
      } else {
        f = issue_joined([&](std::vector<TransferFuture>& issued) {
          for (const auto& src : s.sources) {
            auto g = engine_.read_batched_async(*src.remote, reads_of(src));
            if (g) issued.push_back(std::move(*g));
          }
        });
      }
    } catch (const Error& e) {
      stop_stream(s,
                  {e.code(), "read of " + layers_text(first, end) + ": " + e.status().message()});
      return true;
    } catch (const std::exception& e) {
      stop_stream(s,
                  {StatusCode::kInternal, "read of " + layers_text(first, end) + ": " + e.what()});
      return true;
    }
    if (!f) f = make_ready_future(0);
    std::weak_ptr<detail::Waker> weak = waker_;
    f->on_resolved([weak](const Status&, std::uint64_t) {
      if (auto w = weak.lock()) w->kick();
    });
    s.in_flight.push_back({first, end, *f});
    return true;
  }

  KVTransferEngine& engine_;
  std::shared_ptr<detail::Waker> waker_;
  // Guarded by waker_->mu.
  std::vector<std::shared_ptr<StreamState>> incoming_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace

TransferFuture LayerStream::future() const { return state_ ? state_->whole : TransferFuture(); }

std::uint32_t LayerStream::num_layers() const noexcept { return state_ ? state_->num_layers : 0; }

std::uint32_t LayerStream::layers_done() const noexcept {
  return state_ ? state_->done.load(std::memory_order_acquire) : 0;
}

Status LayerStream::wait_for_layer(std::uint32_t layer, std::chrono::nanoseconds timeout) const {
  if (!state_) return {StatusCode::kInvalidArgument, "wait_for_layer on an invalid LayerStream"};
  if (layer >= state_->num_layers) {
    throw Error(StatusCode::kInvalidArgument, "wait_for_layer of layer " + std::to_string(layer) +
                                                  " out of range [0, " +
                                                  std::to_string(state_->num_layers) + ")");
  }
  internal::UniqueLock lock(state_->mu);
  const bool ended = state_->cv.wait_for(lock, timeout, [&] {
    MSTAR_KV_ASSERT_HELD(state_->mu);  // the condition runs under the lock
    return state_->done.load(std::memory_order_acquire) > layer || state_->failed;
  });
  if (state_->done.load(std::memory_order_acquire) > layer) return Status::ok();
  if (ended && state_->failed) return state_->error;
  return {StatusCode::kInProgress, "layer " + std::to_string(layer) + " not in place yet (" +
                                       std::to_string(state_->done.load()) + " of " +
                                       std::to_string(state_->num_layers) + " layers done)"};
}

void LayerStream::cancel() const noexcept {
  if (state_) state_->cancel.store(true, std::memory_order_release);
}

struct LayerStreamer::Impl {
  KVTransferEngine& engine;
  std::shared_ptr<KVCache> cache;
  std::chrono::milliseconds engine_timeout;
  std::mutex mu;
  std::unique_ptr<StreamDriver> driver MSTAR_KV_GUARDED_BY(mu);  // made by the first stream
  bool closed MSTAR_KV_GUARDED_BY(mu) = false;
};

LayerStreamer::LayerStreamer(KVTransferEngine& engine, std::shared_ptr<KVCache> cache,
                             std::chrono::milliseconds engine_timeout)
    : impl_(new Impl{engine, std::move(cache), engine_timeout, {}, nullptr, false}) {
  if (!impl_->cache) throw Error(StatusCode::kInvalidArgument, "LayerStreamer needs a KV cache");
}

LayerStreamer::~LayerStreamer() { stop(); }

std::optional<LayerStream> LayerStreamer::start(std::uint64_t start_len, std::uint64_t end_len,
                                                std::span<const std::uint32_t> local_page_indices,
                                                std::span<const std::uint32_t> remote_page_indices,
                                                const RemoteCache& remote,
                                                const KVTransferInfo* shared,
                                                StreamOptions options) {
  if (options.max_reads_in_flight == 0 || options.max_reads_in_flight > 64) {
    throw Error(StatusCode::kInvalidArgument, "stream max_reads_in_flight " +
                                                  std::to_string(options.max_reads_in_flight) +
                                                  " out of range [1, 64]");
  }
  if (options.poll_interval.count() <= 0 || options.poll_interval > std::chrono::seconds(1)) {
    throw Error(StatusCode::kInvalidArgument, "stream poll_interval " +
                                                  std::to_string(options.poll_interval.count()) +
                                                  " us out of range [1, 1000000]");
  }
  if (options.ready_timeout.count() < 0) {
    throw Error(StatusCode::kInvalidArgument, "stream ready_timeout " +
                                                  std::to_string(options.ready_timeout.count()) +
                                                  " ms must be >= 0 (0: the engine's timeout)");
  }
  const KVLayout& layout = impl_->cache->layout();
  // As start_async_retrieve plans: against the remote layout where the
  // engine can tell it (page sizes and head shards may differ).
  std::vector<KVReadInfo> reads =
      plan_retrieve(layout, remote, start_len, end_len, local_page_indices, remote_page_indices);
  if (reads.empty()) return std::nullopt;
  auto s = std::make_shared<StreamState>();
  s->num_layers = layout.num_layers;
  EpochGroups groups;
  if (shared == nullptr || shared->page_epochs.empty()) {
    groups.emplace_back(remote.epoch(), std::move(reads));
  } else {
    groups = group_by_epoch(reads, [&](const KVReadInfo& r) {
      // The planner's remote pages are the caller's table, u32 each.
      return shared->epoch_of(static_cast<std::uint32_t>(r.remote_page_idx));
    });
  }
  for (auto& [epoch, group] : groups) {
    StreamState::Source src;
    src.remote = epoch == remote.epoch() ? remote.shared_from_this()
                                         : impl_->engine.open_remote(shared->with_epoch(epoch));
    src.watch = impl_->engine.watch_layers(*src.remote, group);  // validates, may throw
    src.layer_reads.resize(layout.num_layers);
    for (const KVReadInfo& r : group) {
      src.layer_reads[static_cast<std::size_t>(r.layer_idx)].push_back(r);
    }
    s->sources.push_back(std::move(src));
  }
  s->ready_timeout =
      options.ready_timeout.count() > 0 ? options.ready_timeout : impl_->engine_timeout;
  s->options = std::move(options);
  s->last_ready = Clock::now();
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (impl_->closed) {
    throw Error(StatusCode::kShutdown, "the stream driver is shut down: no new streams");
  }
  if (!impl_->driver) impl_->driver = std::make_unique<StreamDriver>(impl_->engine);
  impl_->driver->add(s);
  return LayerStream(s);
}

void LayerStreamer::stop() noexcept {
  std::unique_ptr<StreamDriver> driver;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->closed = true;
    driver = std::move(impl_->driver);
  }
  if (driver) driver->stop();
}

}  // namespace mstar::kv
