// Copyright mstar-kv authors.
//
// KVTransferEngine's default methods and RemoteCache helpers (engine.hpp),
// in one place so that an engine linked without the factory still finds its
// vtable's entries.
#include "mstar/kv/core/engine.hpp"

#include <string>

namespace mstar::kv {

void throw_foreign_remote(const RemoteCache& remote, const char* engine) {
  throw Error(StatusCode::kInvalidArgument,
              "descriptor of engine '" + remote.info().engine + "' was not opened by the '" +
                  engine + "' engine (open it with that engine's open_remote)");
}

std::string KVTransferEngine::name() const {
  const std::string n = get_kv_transfer_info().engine;
  return n.empty() ? "local" : n;
}

std::optional<TransferFuture> KVTransferEngine::read_batched_async(
    const KVTransferInfo& remote, std::span<const KVReadInfo> read_info) {
  return read_batched_async(*open_remote(remote), read_info);
}

std::optional<KVLayout> KVTransferEngine::remote_layout(const KVTransferInfo& remote) const {
  return open_remote(remote)->layout();
}

void KVTransferEngine::notify_done(const RemoteCache& remote, std::uint64_t seq_id) {
  throw Error(StatusCode::kNotSupported,
              "the '" + remote.info().engine +
                  "' engine has no channel back to the owner for the done notice of "
                  "sequence " +
                  std::to_string(seq_id) +
                  ": send it over the side channel that carried the SequenceInfo (the owner "
                  "calls KVCachePool::done)");
}

std::unique_ptr<LayerWatch> KVTransferEngine::watch_layers(const RemoteCache& remote,
                                                           std::span<const KVReadInfo> read_info) {
  (void)read_info;
  const std::string name = remote.info().engine.empty() ? "local" : remote.info().engine;
  throw Error(StatusCode::kNotSupported,
              "layer-wise streaming over the '" + name +
                  "' engine: it has no readiness channel from the owner; "
                  "pull with start_async_retrieve after the owner finished");
}

}  // namespace mstar::kv
