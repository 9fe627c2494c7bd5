// Copyright mstar-kv authors.
//
// KVTransferEngine: the one interface every engine implements, and
// RemoteCache, a peer's descriptor as the engine decoded it.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>

#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/future.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

// A remote cache as one engine sees it: the descriptor it was opened from,
// decoded and validated once (KVTransferEngine::open_remote), so that a
// pull plans against its layout and every read of the pull reuses it.
// Immutable; safe to share between threads and reads. Always made shared
// (std::make_shared, by open_remote), so that a read that outlives its call
// keeps it with shared_from_this(). Engines subclass it (TypedRemote below)
// to keep their decoded form.
class RemoteCache : public std::enable_shared_from_this<RemoteCache> {
 public:
  RemoteCache(KVTransferInfo info, std::optional<KVLayout> layout)
      : info_(std::move(info)), layout_(layout) {}
  virtual ~RemoteCache() = default;
  RemoteCache(const RemoteCache&) = delete;
  RemoteCache& operator=(const RemoteCache&) = delete;

  // The descriptor as received (its epoch names the sequence's pages).
  const KVTransferInfo& info() const noexcept { return info_; }
  std::uint64_t epoch() const noexcept { return info_.epoch; }
  // The remote cache's geometry; std::nullopt when the engine cannot tell
  // (a Python engine without remote_layout): the manager then plans as for
  // one geometry and the engine checks the remote pages itself.
  const std::optional<KVLayout>& layout() const noexcept { return layout_; }

 private:
  KVTransferInfo info_;
  std::optional<KVLayout> layout_;
};
using RemoteHandle = std::shared_ptr<const RemoteCache>;

// An engine's decoded descriptor: `typed` is its own info struct
// (ShmKVTransferInfo, ...). remote_as<T>() gets it back.
template <typename T>
class TypedRemote final : public RemoteCache {
 public:
  TypedRemote(KVTransferInfo info, T typed, std::optional<KVLayout> layout)
      : RemoteCache(std::move(info), layout), typed_(std::move(typed)) {}
  const T& typed() const noexcept { return typed_; }

 private:
  T typed_;
};

[[noreturn]] void throw_foreign_remote(const RemoteCache& remote, const char* engine);
// The T an engine opened `remote` with; throws Error(kInvalidArgument) when
// another engine opened it (naming the descriptor's engine and `engine`).
template <typename T>
const T& remote_as(const RemoteCache& remote, const char* engine) {
  if (const auto* t = dynamic_cast<const TypedRemote<T>*>(&remote)) return t->typed();
  throw_foreign_remote(remote, engine);
}

// Moves pages of a remote cache into the engine's local cache.
//
// Contract for every implementation (the conformance suite checks it):
// * open_remote decodes and validates a descriptor (engine, format,
//   generation, layout compatibility with the local cache) without
//   contacting the owner, throwing Error on a bad one. It is the only place
//   a descriptor is decoded: a pull opens its descriptor once and hands the
//   result to every read, watch and done notice.
// * read_batched_async validates every read before any byte moves, throwing
//   Error on a bad argument. It never blocks on the transfer itself. It
//   returns std::nullopt when there is nothing to read, else a future that
//   resolves with the bytes read or an error within the engine's timeout.
// * Pages not named in a read are never touched; the remote cache is never
//   written.
// * shutdown() resolves every in-flight future (kShutdown unless it already
//   finished) and releases every mapping, handle and registration; later
//   reads throw Error(kShutdown). Idempotent.
// Engines are safe to call from any thread unless their header says not.
// The default methods below live in src/core/engine.cpp.
class KVTransferEngine {
 public:
  virtual ~KVTransferEngine() = default;

  // Descriptor another process needs to read this engine's cache; empty for
  // the local-only engine.
  virtual KVTransferInfo get_kv_transfer_info() const = 0;
  // The engine's name, for statistics and messages: by default the engine
  // its descriptor names ("local" for the empty one).
  virtual std::string name() const;

  // Decodes and validates `remote` (above). Never null.
  virtual RemoteHandle open_remote(const KVTransferInfo& remote) const = 0;

  // `remote` from this engine's open_remote.
  virtual std::optional<TransferFuture> read_batched_async(
      const RemoteCache& remote, std::span<const KVReadInfo> read_info) = 0;
  // open_remote + read_batched_async.
  std::optional<TransferFuture> read_batched_async(const KVTransferInfo& remote,
                                                   std::span<const KVReadInfo> read_info);

  virtual void shutdown() = 0;

  // Opens what reads from `remote`'s owner need, so that the first read
  // does not wait for it (ucx, mooncake: the connection and its handshake,
  // cached per peer as a read would cache it; shm: the mapping or the
  // cross-memory attach). Moves no byte. Bounded by the engine's timeout;
  // throws the Errors a read throws before it is posted (kPeerFailure,
  // kTimeout, kUnavailable, kStaleDescriptor for an owner that no longer
  // serves `remote`, kShutdown). The default, for engines with nothing to
  // open ahead (local, cuda_ipc, Python engines), does nothing.
  virtual void connect(const RemoteCache& remote) { (void)remote; }

  // open_remote(remote)->layout(): the geometry of the cache `remote`
  // describes, validated (throws what open_remote throws).
  std::optional<KVLayout> remote_layout(const KVTransferInfo& remote) const;

  // Done notices (leases, pool.hpp). Reader side: tells the owner of
  // `remote` (the descriptor of a SequenceInfo, which carries the epoch)
  // that this reader is done with sequence seq_id, over the engine's own
  // channel; returns once the notice is queued (it is not acknowledged). The
  // default, for engines with no channel back to the owner (shm, cuda_ipc,
  // mooncake), throws Error(kNotSupported): send "done" over the side channel
  // that carried the SequenceInfo instead.
  virtual void notify_done(const RemoteCache& remote, std::uint64_t seq_id);
  // Owner side: `handler(seq_id, epoch)` runs on an engine thread for every
  // done notice that arrives (e.g. KVCachePool::done). It must not block
  // nor call back into this engine. The default never calls it.
  using DoneHandler = std::function<void(std::uint64_t seq_id, std::uint64_t epoch)>;
  virtual void set_done_handler(DoneHandler handler) { (void)handler; }

  // Owner side: what this engine served to readers of its cache
  // (stats.hpp, ServedStats), as far as it sees it. The default, for engines
  // whose readers never reach them (shm and cuda_ipc readers map the
  // owner's memory; the Mooncake transfer engine serves reads inside its
  // own library), is all zeros. Safe from any thread.
  virtual ServedStats served_stats() const { return {}; }

  // Layer-wise streaming (readiness.hpp, streaming.hpp). Validates the reads
  // as read_batched_async would (throwing the same Errors, before any byte
  // moves) and returns a watch on the owner's layer readiness for the remote
  // pages of those reads, over the engine's own channel (shm: the readiness
  // words in the mapped owner memory; ucx: notices from the owner; cuda_ipc:
  // the owner's host tables; mooncake: bounded polls of the owner's words).
  // The default, for engines without such a channel (local), throws
  // Error(kNotSupported) naming the engine: pull after the owner finished.
  virtual std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info);
};

}  // namespace mstar::kv
