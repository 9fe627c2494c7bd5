// Copyright mstar-kv authors.
//
// KVTransferEngine: the one interface every engine implements.
#pragma once

#include <optional>
#include <span>

#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/future.hpp"
#include "mstar/kv/read_info.hpp"

namespace mstar::kv {

// Moves pages of a remote cache into the engine's local cache.
//
// Contract for every implementation (the conformance suite checks it):
// * read_batched_async validates the descriptor (engine, generation, layout
//   compatibility, bounds) and every read before any byte moves, throwing
//   Error on a bad argument. It never blocks on the transfer itself.
// * It returns std::nullopt when there is nothing to read, else a future that
//   resolves with the bytes read or an error, within the engine's timeout.
// * Pages not named in a read are never touched; the remote cache is never
//   written.
// * shutdown() resolves every in-flight future (kShutdown unless it already
//   finished) and releases every mapping, handle and registration; later
//   calls to read_batched_async throw Error(kShutdown). Idempotent.
// Engines are safe to call from any thread unless their header says not.
class KVTransferEngine {
 public:
  virtual ~KVTransferEngine() = default;

  // Descriptor another process needs to read this engine's cache; empty for
  // the local-only engine.
  virtual KVTransferInfo get_kv_transfer_info() const = 0;

  virtual std::optional<TransferFuture> read_batched_async(
      const KVTransferInfo& remote_kv_info,
      std::span<const KVReadInfo> read_info) = 0;

  virtual void shutdown() = 0;
};

}  // namespace mstar::kv
