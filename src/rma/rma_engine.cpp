// Copyright mstar-kv authors.
#include "rma_engine.hpp"

#include <random>
#include <string>
#include <utility>
#include <vector>

#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv::rma {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at cancel requests (TransferFuture::cancel
// has no callback into the engine).
constexpr std::chrono::milliseconds kCancelPoll{5};

std::uint64_t new_generation() {
  std::random_device rd;
  std::uint64_t g = 0;
  while (g == 0) g = (std::uint64_t{rd()} << 32) ^ rd();
  return g;
}

struct RmaKVTransferEngine::InFlight {
  TransferPromise promise;
  std::shared_ptr<RmaOperation> op;  // null until post_reads returned
  Clock::time_point deadline;
  std::uint64_t bytes = 0;
  std::string session_id;
  const RmaPeer* peer = nullptr;
  std::string what;                    // "read of N bytes in S spans from ..."
  std::optional<Status> abort_reason;  // set once, by watchdog or shutdown
  bool abort_sent = false;
};

struct RmaKVTransferEngine::PeerSlot {
  std::mutex mu;  // serialises connects to this peer
  std::shared_ptr<RmaPeer> peer MSTAR_KV_GUARDED_BY(mu);
};

RmaKVTransferEngine::RmaKVTransferEngine(std::shared_ptr<KVCache> cache,
                                         std::unique_ptr<RmaBackend> backend,
                                         const EngineOptions& options)
    : cache_(std::move(cache)),
      backend_(std::move(backend)),
      timeout_(options.timeout),
      check_epochs_(options.check_epochs),
      log_(options.log),
      engine_name_(backend_ ? std::string(backend_->engine_name()) : std::string()) {
  if (!cache_ || !backend_) {
    throw Error(StatusCode::kInvalidArgument, "RmaKVTransferEngine needs a cache and a backend");
  }
  if (timeout_.count() <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "engine timeout " + std::to_string(timeout_.count()) + " ms must be > 0");
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

RmaKVTransferEngine::~RmaKVTransferEngine() { shutdown(); }

KVTransferInfo RmaKVTransferEngine::get_kv_transfer_info() const {
  return KVTransferInfo{engine_name_, backend_->local_region().encode()};
}

std::shared_ptr<RmaPeer> RmaKVTransferEngine::peer_for(const RmaRegionInfo& remote) {
  std::shared_ptr<PeerSlot> slot;
  {
    std::lock_guard<std::mutex> lk(peers_mu_);
    auto& s = peers_[remote.session_id];
    if (!s) s = std::make_shared<PeerSlot>();
    slot = s;
  }
  std::lock_guard<std::mutex> lk(slot->mu);
  if (slot->peer && !slot->peer->failed()) {
    try {
      slot->peer->verify(remote);
      return slot->peer;
    } catch (const Error& e) {
      // A cached connection may predate a restart of the owner at the same
      // address; a stale verdict is only trusted from a fresh connection.
      if (e.code() != StatusCode::kStaleDescriptor) throw;
    }
  }
  slot->peer.reset();
  auto peer = backend_->connect(remote, timeout_);
  slot->peer = peer;
  peer->verify(remote);
  return peer;
}

bool RmaKVTransferEngine::evict_peer(const std::string& session_id, const RmaPeer* peer) {
  std::shared_ptr<PeerSlot> slot;
  {
    std::lock_guard<std::mutex> lk(peers_mu_);
    auto it = peers_.find(session_id);
    if (it == peers_.end()) return false;
    slot = it->second;
  }
  // try_lock: a connect in progress on this slot replaces the peer anyway.
  std::unique_lock<std::mutex> lk(slot->mu, std::try_to_lock);
  if (!lk.owns_lock()) return false;
  MSTAR_KV_ASSERT_HELD(slot->mu);
  if (slot->peer.get() == peer) {
    slot->peer.reset();
    return true;
  }
  return false;
}

RemoteHandle RmaKVTransferEngine::open_remote(const KVTransferInfo& remote) const {
  check_engine(remote);
  RmaRegionInfo region = RmaRegionInfo::decode(remote.payload);
  cache_->layout().check_same_model(region.layout);
  KVLayout layout = region.layout;
  return std::make_shared<TypedRemote<RmaRegionInfo>>(remote, std::move(region), layout);
}

void RmaKVTransferEngine::check_running() {
  std::lock_guard<std::mutex> lk(mu_);
  if (stopping_) {
    throw Error(StatusCode::kShutdown, "the " + engine_name_ + " engine is shut down");
  }
}

void RmaKVTransferEngine::check_engine(const KVTransferInfo& remote) const {
  if (remote.engine != engine_name_) {
    throw Error(StatusCode::kInvalidArgument, "descriptor of engine '" + remote.engine +
                                                  "' given to the '" + engine_name_ + "' engine");
  }
}

std::optional<TransferFuture> RmaKVTransferEngine::read_batched_async(
    const RemoteCache& remote_cache, std::span<const KVReadInfo> read_info) {
  check_running();
  const RmaRegionInfo& remote = remote_as<RmaRegionInfo>(remote_cache, engine_name_.c_str());
  if (read_info.empty()) return std::nullopt;  // the descriptor was validated by open_remote
  // Strided spans where the backend moves them natively, else rows.
  const bool strided = backend_->strided_reads();
  StridedPlan strided_plan;
  CopyPlan plan;
  if (strided) {
    strided_plan = plan_strided_copies(cache_->layout(), remote.layout, read_info);
  } else {
    plan = plan_copies(cache_->layout(), remote.layout, read_info);
  }
  const std::uint64_t total_bytes = strided ? strided_plan.total_bytes : plan.total_bytes;
  const std::size_t nspans = strided ? strided_plan.spans.size() : plan.spans.size();
  auto peer = peer_for(remote);

  auto entry = std::make_shared<InFlight>();
  entry->deadline = Clock::now() + timeout_;
  entry->bytes = total_bytes;
  entry->session_id = remote.session_id;
  entry->peer = peer.get();
  entry->what = "read of " + std::to_string(total_bytes) + " bytes in " + std::to_string(nspans) +
                " spans from '" + remote.entity_id + "' at " + remote.session_id;
  // Validating and planning include connecting to (and verifying) the peer.
  entry->promise.mark_planned(nspans);
  entry->promise.set_peer(remote.entity_id + "@" + remote.session_id);
  TransferFuture future = entry->promise.future();
  std::uint64_t id = 0;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (stopping_) {
      throw Error(StatusCode::kShutdown, "the " + engine_name_ + " engine is shut down");
    }
    id = next_id_++;
    inflight_.emplace(id, entry);
    cv_.notify_all();  // the watchdog sleeps while nothing is in flight
  }
  std::shared_ptr<RmaOperation> op;
  try {
    RmaEpochCheck check;
    if (check_epochs_ && remote_cache.epoch() != 0) {
      check.epoch = remote_cache.epoch();
      check.pages = remote_pages_of(read_info, remote.layout.num_pages);
    }
    RmaCompletion done = [this, id](Status st) { on_done(id, std::move(st)); };
    op = strided ? peer->post_strided_reads(std::move(strided_plan.spans), std::move(done),
                                            std::move(check))
                 : peer->post_reads(std::move(plan.spans), std::move(done), std::move(check));
  } catch (...) {
    std::lock_guard<std::mutex> lk(mu_);
    inflight_.erase(id);
    cv_.notify_all();
    throw;
  }
  bool abort_now = false;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = inflight_.find(id);
    if (it != inflight_.end()) {  // else it already completed inline
      it->second->op = op;
      if (it->second->abort_reason && !it->second->abort_sent) {
        it->second->abort_sent = true;
        abort_now = true;
      }
    }
  }
  if (abort_now) op->abort();
  entry->promise.mark_posted();  // ignored if it already completed
  return future;
}

std::unique_ptr<LayerWatch> RmaKVTransferEngine::watch_layers(
    const RemoteCache& remote_cache, std::span<const KVReadInfo> read_info) {
  check_running();
  if (read_info.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                engine_name_ + " layer watch of 0 reads: nothing to watch");
  }
  const RmaRegionInfo& remote = remote_as<RmaRegionInfo>(remote_cache, engine_name_.c_str());
  const std::uint64_t epoch = remote_cache.epoch();
  (void)plan_copies(cache_->layout(), remote.layout, read_info);  // validates as a read does
  if (epoch == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "layer-wise streaming needs a descriptor with a page epoch (published by a "
                "KVCachePool), got epoch 0");
  }
  auto peer = peer_for(remote);
  try {
    return peer->watch_layers(remote_pages_of(read_info, remote.layout.num_pages), epoch,
                              remote.layout.num_layers);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kNotSupported) throw;
    throw Error(StatusCode::kNotSupported,
                "layer-wise streaming over the '" + engine_name_ +
                    "' engine: " + e.status().message() +
                    "; pull with start_async_retrieve after the owner finished");
  }
}

void RmaKVTransferEngine::connect(const RemoteCache& remote_cache) {
  check_running();
  (void)peer_for(remote_as<RmaRegionInfo>(remote_cache, engine_name_.c_str()));
}

void RmaKVTransferEngine::notify_done(const RemoteCache& remote_cache, std::uint64_t seq_id) {
  const RmaRegionInfo& remote = remote_as<RmaRegionInfo>(remote_cache, engine_name_.c_str());
  if (remote_cache.epoch() == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "done notice for sequence " + std::to_string(seq_id) +
                    " with a cache descriptor (epoch 0): pass the SequenceInfo's descriptor");
  }
  peer_for(remote)->send_done(seq_id, remote_cache.epoch());
}

void RmaKVTransferEngine::set_done_handler(DoneHandler handler) {
  backend_->set_done_handler(std::move(handler));
}

void RmaKVTransferEngine::on_done(std::uint64_t id, Status status) {
  std::shared_ptr<InFlight> entry;
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = inflight_.find(id);
    if (it == inflight_.end()) return;  // a backend bug: second completion
    entry = std::move(it->second);
    inflight_.erase(it);
  }
  if (entry->abort_reason) {
    entry->promise.fail(*entry->abort_reason);
  } else if (status.is_ok()) {
    entry->promise.complete(entry->bytes);
  } else {
    // Logged once per failed connection (the read that evicts it), not per read.
    if (status.scope() == FailureScope::kPeer && !is_page_epoch_failure(status) &&
        evict_peer(entry->session_id, entry->peer)) {
      log_.warn(engine_name_ + " peer at " + entry->session_id + " failed: " + status.to_string() +
                " (reads on it fail; the next read reconnects)");
    }
    entry->promise.fail(Status(status.code(), entry->what + " failed: " + status.message()));
  }
  // Notify after resolving, under the lock: shutdown() may be waiting for an
  // empty set and destroy the engine right after.
  std::lock_guard<std::mutex> lk(mu_);
  cv_.notify_all();
}

void RmaKVTransferEngine::watchdog() {
  internal::UniqueLock lk(mu_);
  while (!backend_down_) {
    const auto now = Clock::now();
    std::vector<std::shared_ptr<RmaOperation>> to_abort;
    for (auto& [id, e] : inflight_) {
      if (e->abort_reason) continue;
      if (now >= e->deadline) {
        e->abort_reason =
            Status(StatusCode::kTimeout,
                   e->what + " did not finish in " + std::to_string(timeout_.count()) + " ms");
      } else if (e->promise.cancel_requested()) {
        e->abort_reason = Status(StatusCode::kCancelled, e->what + " was cancelled");
      } else {
        continue;
      }
      if (e->op) {
        e->abort_sent = true;
        to_abort.push_back(e->op);
      }
    }
    if (!to_abort.empty()) {
      lk.unlock();
      for (auto& op : to_abort) op->abort();
      lk.lock();
      continue;
    }
    if (inflight_.empty()) {
      cv_.wait(lk);
    } else {
      cv_.wait_for(lk, kCancelPoll);
    }
  }
}

void RmaKVTransferEngine::shutdown() {
  std::lock_guard<std::mutex> once(shutdown_mu_);
  {
    // Scoped: the engine holds no operation when the backend shuts down (an
    // operation may hold backend resources that the backend's shutdown
    // releases only once their holders let go, e.g. Mooncake's scratch
    // pages; rma_backend.hpp).
    std::vector<std::shared_ptr<RmaOperation>> to_abort;
    {
      std::lock_guard<std::mutex> lk(mu_);
      if (backend_down_) return;
      stopping_ = true;
      for (auto& [id, e] : inflight_) {
        if (!e->abort_reason) {
          e->abort_reason = Status(StatusCode::kShutdown, e->what + " was stopped: the " +
                                                              engine_name_ + " engine shut down");
        }
        if (e->op && !e->abort_sent) {
          e->abort_sent = true;
          to_abort.push_back(e->op);
        }
      }
    }
    for (auto& op : to_abort) op->abort();
  }
  {
    // Bounded by the backend's abort contract; the backend's own shutdown
    // below completes anything that is still outstanding.
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait_for(lk, timeout_ + std::chrono::seconds(5), [this] {
      MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
      return inflight_.empty();
    });
  }
  backend_->shutdown();
  {
    std::lock_guard<std::mutex> lk(mu_);
    backend_down_ = true;
    cv_.notify_all();
  }
  if (watchdog_.joinable()) watchdog_.join();
  std::lock_guard<std::mutex> lk(peers_mu_);
  peers_.clear();
}

}  // namespace mstar::kv::rma
