// Copyright mstar-kv authors.
//
// KVTransferManager: plan -> engine, the shard form, streams, done notices.
// (Its constructor from TransferEngineInfo, which needs the factory, lives
// beside the factory.)
#include "mstar/kv/manager.hpp"

#include <string>

#include "manager/issue_reads.hpp"
#include "manager/request_registry.hpp"
#include "manager/stream_driver.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/pool.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

KVTransferManager::KVTransferManager(std::shared_ptr<KVCache> kv_cache,
                                     std::shared_ptr<KVTransferEngine> engine,
                                     std::chrono::milliseconds engine_timeout, ResourceScope scope)
    : kv_cache_(std::move(kv_cache)), engine_(std::move(engine)) {
  if (!kv_cache_ || !engine_) {
    throw Error(StatusCode::kInvalidArgument, "KVTransferManager needs a KV cache and an engine");
  }
  if (engine_timeout.count() <= 0) {
    throw Error(StatusCode::kInvalidArgument, "KVTransferManager engine_timeout " +
                                                  std::to_string(engine_timeout.count()) +
                                                  " ms must be > 0");
  }
  engine_timeout_ = engine_timeout;
  init_requests(std::move(scope));
  stats_ = std::make_shared<TransferStatsRecorder>(engine_->name());
}

KVTransferManager::~KVTransferManager() { cleanup(); }

void KVTransferManager::check_open(const char* what) const {
  if (closed()) {
    throw Error(StatusCode::kShutdown,
                std::string("KVTransferManager.") + what + "() after cleanup()");
  }
}

KVTransferInfo KVTransferManager::get_kv_transfer_info() const {
  check_open("get_kv_transfer_info");
  if (!scope_.needs_remote_transfer) return {};
  return engine_->get_kv_transfer_info();
}

namespace {

// A handle names one epoch: a descriptor whose pages carry several cannot
// be one (its shared pages would read as stale), so the forms that take a
// handle refuse it rather than fail its reads later.
void refuse_page_epochs(const KVTransferInfo& info, const char* what) {
  if (info.page_epochs.empty()) return;
  throw Error(StatusCode::kInvalidArgument,
              std::string(what) + ": the descriptor names " +
                  std::to_string(info.page_epochs.size()) +
                  " pages with epochs of their own (shared pages) besides epoch " +
                  std::to_string(info.epoch) +
                  ": one handle reads one epoch; pass the KVTransferInfo to "
                  "start_async_retrieve, sync_retrieve or start_streaming_retrieve");
}

}  // namespace

RemoteHandle KVTransferManager::open_remote(const KVTransferInfo& kv_transfer_info) const {
  check_open("open_remote");
  refuse_page_epochs(kv_transfer_info, "open_remote");
  return engine_->open_remote(kv_transfer_info);
}

std::optional<TransferFuture> KVTransferManager::tracked(
    const std::function<std::optional<TransferFuture>()>& issue) {
  if (!stats_enabled_.load(std::memory_order_relaxed)) return issue();
  return TransferStatsRecorder::track(stats_, issue);
}

namespace {

// plan_retrieve once the local table was checked.
std::vector<KVReadInfo> plan_checked_local(const KVLayout& local, const RemoteCache& remote,
                                           std::uint64_t start_len, std::uint64_t end_len,
                                           std::span<const std::uint32_t> local_page_indices,
                                           std::span<const std::uint32_t> remote_page_indices) {
  // The remote table against the remote layout, when the engine could tell
  // it: caches of different geometry meet there (page sizes, head shards).
  const std::optional<KVLayout>& rl = remote.layout();
  if (!rl) return plan_reads(local, start_len, end_len, local_page_indices, remote_page_indices);
  check_remote_pages(local, *rl, start_len, end_len, remote_page_indices);
  return plan_reads(local, *rl, start_len, end_len, local_page_indices, remote_page_indices);
}

}  // namespace

std::vector<KVReadInfo> plan_retrieve(const KVLayout& local, const RemoteCache& remote,
                                      std::uint64_t start_len, std::uint64_t end_len,
                                      std::span<const std::uint32_t> local_page_indices,
                                      std::span<const std::uint32_t> remote_page_indices) {
  // The caller's own table first (errors name its entries); an empty range
  // is validated the same way.
  check_local_pages(local, start_len, end_len, local_page_indices);
  return plan_checked_local(local, remote, start_len, end_len, local_page_indices,
                            remote_page_indices);
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const KVTransferInfo& kv_transfer_info) {
  if (kv_transfer_info.page_epochs.empty()) {
    return retrieve_opened(
        start_len, end_len, local_page_indices, remote_page_indices,
        [&] { return engine_->open_remote(kv_transfer_info); }, nullptr);
  }
  // The engine gets the descriptor without exceptions; read_shared opens
  // the other epochs.
  return retrieve_opened(
      start_len, end_len, local_page_indices, remote_page_indices,
      [&] { return engine_->open_remote(kv_transfer_info.with_epoch(kv_transfer_info.epoch)); },
      &kv_transfer_info);
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve_from(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RemoteOpener& open) {
  return retrieve_opened(start_len, end_len, local_page_indices, remote_page_indices, open,
                         nullptr);
}

std::optional<TransferFuture> KVTransferManager::read_shared(const KVTransferInfo& info,
                                                             RemoteHandle base,
                                                             std::span<const KVReadInfo> reads) {
  if (info.page_epochs.empty()) return engine_->read_batched_async(*base, reads);
  std::vector<RemoteHandle> opened{std::move(base)};
  return issue_by_epoch(
      *engine_, reads,
      [&](const KVReadInfo& r) {
        // The planner's remote pages are the caller's table, u32 each.
        return info.epoch_of(static_cast<std::uint32_t>(r.remote_page_idx));
      },
      opened, [&](std::uint64_t epoch) { return engine_->open_remote(info.with_epoch(epoch)); });
}

std::optional<TransferFuture> KVTransferManager::retrieve_opened(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RemoteOpener& open,
    const KVTransferInfo* shared) {
  check_open("start_async_retrieve");
  return tracked([&]() -> std::optional<TransferFuture> {
    // The local table before the descriptor, so that a bad table is named
    // as such whatever the descriptor.
    check_local_pages(kv_cache_->layout(), start_len, end_len, local_page_indices);
    const RemoteHandle remote = open();
    auto reads = plan_checked_local(kv_cache_->layout(), *remote, start_len, end_len,
                                    local_page_indices, remote_page_indices);
    if (shared != nullptr && !reads.empty()) return read_shared(*shared, remote, reads);
    auto f = engine_->read_batched_async(*remote, reads);
    return reads.empty() ? std::nullopt : f;
  });
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RemoteCache& remote) {
  check_open("start_async_retrieve");
  refuse_page_epochs(remote.info(), "start_async_retrieve");
  return tracked([&]() -> std::optional<TransferFuture> {
    auto reads = plan_retrieve(kv_cache_->layout(), remote, start_len, end_len, local_page_indices,
                               remote_page_indices);
    // No reads still goes to the engine, which checks the handle is its
    // own; the manager then returns nothing.
    auto f = engine_->read_batched_async(remote, reads);
    return reads.empty() ? std::nullopt : f;
  });
}

std::uint64_t KVTransferManager::sync_retrieve(std::uint64_t start_len, std::uint64_t end_len,
                                               std::span<const std::uint32_t> local_page_indices,
                                               std::span<const std::uint32_t> remote_page_indices,
                                               const KVTransferInfo& kv_transfer_info) {
  auto future = start_async_retrieve(start_len, end_len, local_page_indices, remote_page_indices,
                                     kv_transfer_info);
  return future ? future->get() : 0;
}

LayerStreamer& KVTransferManager::streamer() {
  std::lock_guard<std::mutex> lock(streams_mu_);
  if (streams_closed_) {
    throw Error(StatusCode::kShutdown, "the manager is shut down: no new streams");
  }
  if (!streams_) streams_ = std::make_unique<LayerStreamer>(*engine_, kv_cache_, engine_timeout_);
  return *streams_;  // lives until the manager goes; cleanup() only stops it
}

std::optional<LayerStream> KVTransferManager::start_streaming_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const KVTransferInfo& kv_transfer_info,
    StreamOptions options) {
  if (kv_transfer_info.page_epochs.empty()) {
    return stream_opened(
        start_len, end_len, local_page_indices, remote_page_indices,
        [&] { return engine_->open_remote(kv_transfer_info); }, nullptr, std::move(options));
  }
  // As start_async_retrieve: the engine gets the descriptor without
  // exceptions; the streamer opens and watches the other epochs.
  return stream_opened(
      start_len, end_len, local_page_indices, remote_page_indices,
      [&] { return engine_->open_remote(kv_transfer_info.with_epoch(kv_transfer_info.epoch)); },
      &kv_transfer_info, std::move(options));
}

std::optional<LayerStream> KVTransferManager::start_streaming_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RemoteCache& remote,
    StreamOptions options) {
  check_open("start_streaming_retrieve");
  refuse_page_epochs(remote.info(), "start_streaming_retrieve");
  return start_streaming_retrieve_from(
      start_len, end_len, local_page_indices, remote_page_indices,
      [&] { return remote.shared_from_this(); }, std::move(options));
}

std::optional<LayerStream> KVTransferManager::start_streaming_retrieve_from(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RemoteOpener& open,
    StreamOptions options) {
  return stream_opened(start_len, end_len, local_page_indices, remote_page_indices, open, nullptr,
                       std::move(options));
}

std::optional<LayerStream> KVTransferManager::stream_opened(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices, const RemoteOpener& open,
    const KVTransferInfo* shared, StreamOptions options) {
  check_open("start_streaming_retrieve");
  LayerStreamer& s = streamer();
  std::optional<LayerStream> stream;
  tracked([&]() -> std::optional<TransferFuture> {
    check_local_pages(kv_cache_->layout(), start_len, end_len, local_page_indices);
    const RemoteHandle remote = open();
    stream = s.start(start_len, end_len, local_page_indices, remote_page_indices, *remote, shared,
                     std::move(options));
    if (!stream) return std::nullopt;
    return stream->future();
  });
  return stream;
}

void KVTransferManager::stop_streams() noexcept {
  std::lock_guard<std::mutex> lock(streams_mu_);
  streams_closed_ = true;
  // Not destroyed: a concurrent start_streaming_retrieve may still hold it;
  // after stop() it refuses new streams.
  if (streams_) streams_->stop();
}

void KVTransferManager::cleanup() {
  closed_.store(true, std::memory_order_release);
  // Every published page released first: a descriptor of this manager is
  // stale from here on, whatever its engine still serves.
  if (requests_) requests_->clear();
  stop_streams();  // streams resolve once nothing of theirs is in flight
  if (engine_) engine_->shutdown();
}

void KVTransferManager::detach() noexcept {
  closed_.store(true, std::memory_order_release);
  if (requests_) requests_->clear();
  stop_streams();
  engine_.reset();
}

void KVTransferManager::connect(const KVTransferInfo& kv_transfer_info) {
  check_open("connect");
  if (kv_transfer_info.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "connect to a local-only descriptor: there is no owner to connect to");
  }
  const KVTransferInfo& info = kv_transfer_info;
  engine_->connect(
      *engine_->open_remote(info.page_epochs.empty() ? info : info.with_epoch(info.epoch)));
}

void KVTransferManager::notify_done(const SequenceInfo& seq) {
  check_open("notify_done");
  if (seq.kv_transfer_info.empty()) {
    throw Error(StatusCode::kInvalidArgument,
                "done notice for sequence " + std::to_string(seq.seq_id) +
                    " with a local-only descriptor: there is no owner to tell");
  }
  // The notice names the sequence's own epoch; its shared pages' do not
  // matter to the owner's done().
  const KVTransferInfo& info = seq.kv_transfer_info;
  engine_->notify_done(
      *engine_->open_remote(info.page_epochs.empty() ? info : info.with_epoch(info.epoch)),
      seq.seq_id);
}

void KVTransferManager::serve_done_notices(std::shared_ptr<KVCachePool> pool) {
  check_open("serve_done_notices");
  {
    std::lock_guard<std::mutex> lock(served_pool_mu_);
    served_pool_ = pool;
  }
  if (!pool) {
    engine_->set_done_handler(nullptr);
    return;
  }
  std::weak_ptr<KVCachePool> weak = pool;
  engine_->set_done_handler([weak](std::uint64_t seq_id, std::uint64_t epoch) {
    // A notice names the epoch it was published with: a late or forged
    // notice without it cannot free a newer request of the same id.
    if (epoch == 0) return;
    if (auto p = weak.lock()) p->done(seq_id, epoch);
  });
}

TransferStats KVTransferManager::stats() const {
  TransferStats s = stats_->snapshot();
  s.served = engine_->served_stats();
  std::shared_ptr<KVCachePool> pool;
  {
    std::lock_guard<std::mutex> lock(served_pool_mu_);
    pool = served_pool_.lock();
  }
  if (pool) {
    s.served.descriptors = pool->published_count();
    s.served.done_notices = pool->done_count();
  }
  return s;
}

}  // namespace mstar::kv
