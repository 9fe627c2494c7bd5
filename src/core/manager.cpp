// Copyright mstar-kv authors.
#include "mstar/kv/manager.hpp"

#include "mstar/kv/planner.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

KVTransferManager::KVTransferManager(
    std::optional<TransferEngineInfo> transfer_engine_info,
    std::shared_ptr<KVCache> kv_cache)
    : kv_cache_(std::move(kv_cache)) {
  if (!kv_cache_) {
    throw Error(StatusCode::kInvalidArgument, "KVTransferManager needs a KV cache");
  }
  engine_ = make_engine(transfer_engine_info, kv_cache_);
  if (transfer_engine_info) engine_timeout_ = transfer_engine_info->options.timeout;
  stats_ = std::make_shared<TransferStatsRecorder>(
      transfer_engine_info && !transfer_engine_info->transfer_engine.empty()
          ? transfer_engine_info->transfer_engine
          : "local");
}

KVTransferManager::KVTransferManager(std::shared_ptr<KVCache> kv_cache,
                                     std::unique_ptr<KVTransferEngine> engine)
    : kv_cache_(std::move(kv_cache)), engine_(std::move(engine)) {
  if (!kv_cache_ || !engine_) {
    throw Error(StatusCode::kInvalidArgument,
                "KVTransferManager needs a KV cache and an engine");
  }
  const std::string name = engine_->get_kv_transfer_info().engine;
  stats_ = std::make_shared<TransferStatsRecorder>(name.empty() ? "local" : name);
}

KVTransferManager::~KVTransferManager() { cleanup(); }

KVTransferInfo KVTransferManager::get_kv_transfer_info() const {
  return engine_->get_kv_transfer_info();
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices,
    const KVTransferInfo& kv_transfer_info) {
  auto issue = [&]() -> std::optional<TransferFuture> {
    const std::vector<KVReadInfo> reads =
        plan_reads(kv_cache_->layout(), start_len, end_len, local_page_indices,
                   remote_page_indices);
    return engine_->read_batched_async(kv_transfer_info, reads);
  };
  if (!stats_enabled_.load(std::memory_order_relaxed)) return issue();
  return TransferStatsRecorder::track(stats_, issue);
}

std::uint64_t KVTransferManager::sync_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices,
    const KVTransferInfo& kv_transfer_info) {
  auto future = start_async_retrieve(start_len, end_len, local_page_indices,
                                     remote_page_indices, kv_transfer_info);
  return future ? future->get() : 0;
}

void KVTransferManager::cleanup() {
  stop_streams();  // streaming.cpp: streams resolve once nothing is in flight
  if (engine_) engine_->shutdown();
}

}  // namespace mstar::kv
