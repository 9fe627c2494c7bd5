// Copyright mstar-kv authors.
//
// KVTransferManager's constructor from TransferEngineInfo: the engine comes
// from the factory (factory.hpp), which the manager sits above.
#include "manager/request_registry.hpp"
#include "manager/stream_driver.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

KVTransferManager::KVTransferManager(std::optional<TransferEngineInfo> transfer_engine_info,
                                     std::shared_ptr<KVCache> kv_cache, ResourceScope scope)
    : kv_cache_(std::move(kv_cache)) {
  if (!kv_cache_) {
    throw Error(StatusCode::kInvalidArgument, "KVTransferManager needs a KV cache");
  }
  init_requests(std::move(scope));
  engine_ = make_engine(transfer_engine_info, kv_cache_);
  if (transfer_engine_info) engine_timeout_ = transfer_engine_info->options.timeout;
  stats_ = std::make_shared<TransferStatsRecorder>(engine_->name());
}

}  // namespace mstar::kv
