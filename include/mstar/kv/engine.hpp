// Copyright mstar-kv authors.
//
// KVTransferEngine: the one interface every engine implements.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>

#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/future.hpp"
#include "mstar/kv/layout.hpp"
#include "mstar/kv/read_info.hpp"
#include "mstar/kv/readiness.hpp"
#include <memory>

namespace mstar::kv {

// Moves pages of a remote cache into the engine's local cache.
//
// Contract for every implementation (the conformance suite checks it):
// * read_batched_async validates the descriptor (engine, generation, layout
//   compatibility, bounds) and every read before any byte moves, throwing
//   Error on a bad argument. It never blocks on the transfer itself.
// * It returns std::nullopt when there is nothing to read (after validating
//   the descriptor all the same: engine, format, layout compatibility), else
//   a future that resolves with the bytes read or an error, within the
//   engine's timeout.
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

  // The layout of the cache `remote` describes, decoded and validated as
  // read_batched_async decodes it (throws the same Error for a descriptor it
  // would refuse), without contacting the owner. KVTransferManager uses it
  // to check the remote page table before planning, so that errors name the
  // caller's table entries, and to plan between caches of different
  // geometry (planner.hpp: page sizes, head shards). The default,
  // std::nullopt, is for engines that cannot tell: the manager then plans as
  // for one geometry and read_batched_async checks the remote pages.
  virtual std::optional<KVLayout> remote_layout(const KVTransferInfo& remote) const;

  // Done notices (leases, pool.hpp). Reader side: tells the owner of
  // `remote` (the descriptor of a SequenceInfo, which carries the epoch)
  // that this reader is done with sequence seq_id, over the engine's own
  // channel; returns once the notice is queued (it is not acknowledged). The
  // default, for engines with no channel back to the owner (shm, cuda_ipc,
  // mooncake), throws Error(kUnavailable): send "done" over the side channel
  // that carried the SequenceInfo instead.
  virtual void notify_done(const KVTransferInfo& remote, std::uint64_t seq_id);
  // Owner side: `handler(seq_id, epoch)` runs on an engine thread for every
  // done notice that arrives (e.g. KVCachePool::done). It must not block
  // nor call back into this engine. The default never calls it.
  using DoneHandler = std::function<void(std::uint64_t seq_id, std::uint64_t epoch)>;
  virtual void set_done_handler(DoneHandler handler) { (void)handler; }

  // Layer-wise streaming (readiness.hpp, streaming.hpp). Validates
  // `remote_kv_info` and `read_info` exactly as read_batched_async would
  // (throwing the same Errors, before any byte moves) and returns a watch on
  // the owner's layer readiness for the remote pages of those reads, over
  // the engine's own channel (shm: the readiness words in the mapped owner
  // memory; ucx: notices from the owner, ucx_wire.hpp; cuda_ipc: the
  // owner's host tables, cuda_ipc.hpp). The default, for
  // engines without such a channel (local; mooncake polls the owner's
  // words, mooncake_readiness.hpp), throws
  // Error(kUnavailable) naming the engine: pull after the owner finished
  // instead.
  virtual std::unique_ptr<LayerWatch> watch_layers(const KVTransferInfo& remote_kv_info,
                                                   std::span<const KVReadInfo> read_info);
};

}  // namespace mstar::kv
