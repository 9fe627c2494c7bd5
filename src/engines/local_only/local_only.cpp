// Copyright mstar-kv authors.
#include "mstar/kv/engines/local_only.hpp"

#include <string>

namespace mstar::kv {

RemoteHandle LocalOnlyKVTransferEngine::open_remote(const KVTransferInfo& remote) const {
  return std::make_shared<RemoteCache>(remote, std::nullopt);
}

std::optional<TransferFuture> LocalOnlyKVTransferEngine::read_batched_async(
    const RemoteCache& remote, std::span<const KVReadInfo> read_info) {
  const KVTransferInfo& remote_kv_info = remote.info();
  if (read_info.empty()) {
    // Nothing to read from no remote cache: the only valid empty read. A
    // descriptor of another engine is refused as a non-empty read would be.
    if (remote_kv_info.empty()) return std::nullopt;
    throw Error(StatusCode::kInvalidArgument,
                "LocalOnlyKVTransferEngine cannot read a '" + remote_kv_info.engine +
                    "' descriptor: it reads no remote cache (expected the empty descriptor)");
  }
  throw Error(StatusCode::kInvalidArgument,
              "LocalOnlyKVTransferEngine (local-only) cannot read remote pages: " +
                  std::to_string(read_info.size()) + " reads given" +
                  (remote_kv_info.empty() ? std::string()
                                          : " from a '" + remote_kv_info.engine + "' descriptor") +
                  ", limit 0");
}

}  // namespace mstar::kv
