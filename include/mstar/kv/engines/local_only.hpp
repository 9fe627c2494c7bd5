// Copyright mstar-kv authors.
//
// LocalOnlyKVTransferEngine ("local"): the spec's KV cache that remains local
// to its worker. docs/engines/local_only.md.
#pragma once

#include <optional>
#include <span>

#include "mstar/kv/core/engine.hpp"

namespace mstar::kv {

// KV cache that remains local to its worker: its descriptor is empty, a read
// of nothing with the empty descriptor returns std::nullopt, a read of
// anything (or of nothing from another engine's descriptor) throws
// Error(kInvalidArgument). open_remote accepts any descriptor (with no
// layout): the read says what is wrong with it. Safe from any thread.
class LocalOnlyKVTransferEngine final : public KVTransferEngine {
 public:
  using KVTransferEngine::read_batched_async;
  std::string name() const override { return "local"; }
  KVTransferInfo get_kv_transfer_info() const override { return {}; }
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;
  void shutdown() override {}
};

}  // namespace mstar::kv
