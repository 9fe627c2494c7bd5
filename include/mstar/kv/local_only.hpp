// Copyright mstar-kv authors.
#pragma once

#include <optional>
#include <span>

#include "mstar/kv/engine.hpp"

namespace mstar::kv {

// KV cache that remains local to its worker: its descriptor is empty, a read
// of nothing with the empty descriptor returns std::nullopt, a read of
// anything (or of nothing from another engine's descriptor) throws
// Error(kInvalidArgument). Safe from any thread.
class LocalOnlyKVTransferEngine final : public KVTransferEngine {
 public:
  KVTransferInfo get_kv_transfer_info() const override { return {}; }
  std::optional<TransferFuture> read_batched_async(
      const KVTransferInfo& remote_kv_info,
      std::span<const KVReadInfo> read_info) override;
  void shutdown() override {}
};

}  // namespace mstar::kv
