// Copyright mstar-kv authors.
//
// The Mooncake engine ("mooncake"): the spec's MooncakeKVTransferEngine over
// Mooncake's transfer engine, whose C API is loaded at run time. How it works,
// how to build Mooncake's library, and the Python wheel engine:
// docs/engines/mooncake.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"
#include "mstar/kv/core/layout.hpp"

namespace mstar::kv {

// Loading: no build-time dependency on Mooncake. The engine loads Mooncake's
// C API (transfer_engine_c.h) from, in this order, extra["mooncake_lib"]
// (the CLI's --mooncake-lib), the environment variable MSTAR_KV_MOONCAKE_LIB,
// or "libtransfer_engine.so" on the loader's search path. A library that
// cannot be loaded, or lacks a C API symbol, makes the constructor throw
// Error(kUnavailable) naming the path (or the symbol). Loading this library
// sets MC_TCP_ENABLE_CONNECTION_POOL=1 and MC_LOG_LEVEL=WARNING in the
// environment once, before main, unless they are set; no engine calls setenv.
//
// Reads: a reader checks the descriptor against the owner's registered
// identity page once per connection, before any page read is submitted: a
// restarted owner is kStaleDescriptor, a forged address or size
// kPermissionDenied, another layout kIncompatibleLayout, an owner that cannot
// be reached or serves no such identity page kPeerFailure. Page reads go as
// Mooncake batches (at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, default
// 1024, requests per peer in Mooncake's hands). A read of a SequenceInfo's
// descriptor checks the page epochs of its pages before and after (epochs.hpp;
// kStaleDescriptor). No strided form: a change of in-page order costs one
// request per row. notify_done() throws kNotSupported (no channel back to
// the owner).
//
// Timeouts, and no byte after resolution: Mooncake cannot cancel a submitted
// request, so a read's future resolves only once Mooncake reports every
// request of it final. A read past EngineOptions::timeout is aborted and
// resolves with kTimeout once its requests are final; if some are still in
// flight mooncake_abort_grace_ms after the abort (a hung peer), the engine
// destroys its Mooncake engine: every read in flight fails with kPeerFailure
// naming the peer, and later reads throw kUnavailable (make a new engine).
// With a shared handle (second constructor) the engine does not destroy the
// application's engine: it stops taking work (reads throw kUnavailable naming
// the hung peer) and the hung read, shutdown() and the destructor wait until
// Mooncake reports its requests final, which the peer and Mooncake's transport
// bound, not EngineOptions::timeout. openSegment is bounded by Mooncake's own
// socket timeouts.
//
// Authentication: none on Mooncake's data path; extra["auth_token"] is
// accepted (it protects `mstar-kv serve`'s control plane) and the engine logs
// once that it authenticates nothing here.
//
// Thread safety: every method is safe from any thread. shutdown() resolves
// every read in flight (kShutdown), deregisters the memory and destroys
// Mooncake's engine (a shared handle: only deregisters, and the handle must
// stay valid until shutdown() returned); idempotent, run by the destructor.
// The library stays loaded until the engine is destroyed.

// The engine's settings, parsed from EngineOptions::extra (all optional):
//   "mooncake_lib"       library path (see "Loading" above)
//   "mooncake_metadata"  Mooncake's metadata connection string; default
//                        "P2PHANDSHAKE" (peers handshake directly). Anything
//                        else ("etcd://...", "http://...") needs my_session_id
//                        to name this process's segment.
//   "mooncake_host"      P2P mode: the host advertised to peers; default the
//                        host of my_session_id when it is "HOST:PORT", else
//                        "127.0.0.1".
//   "mooncake_protocol"  the transport to install; default "tcp".
//   "mooncake_location"  registerLocalMemory location; default "cpu:0".
//   "mooncake_abort_grace_ms"  grace after a timed-out read's abort; default
//                        2000.
//   "mooncake_session_id"  shared handle only: the session id to publish;
//                        default what getLocalIpAndPort reports.
struct MooncakeOptions {
  std::string library_path;  // resolved: option, environment or default
  std::string metadata = "P2PHANDSHAKE";
  std::string host;  // empty: from my_session_id, else 127.0.0.1
  std::string protocol = "tcp";
  std::string location = "cpu:0";
  std::uint32_t abort_grace_ms = 2000;
  std::string session_id;  // shared handle only; empty: getLocalIpAndPort
  Logger log;              // EngineOptions::log (set by the engine's constructors)

  // The "mooncake_*" keys of options.extra (every engine's options parse
  // the same way: XOptions::parse(EngineOptions)). Throws
  // Error(kInvalidArgument) naming an unknown "mooncake_*" key, a key of the
  // other mode (shared_handle: the engine borrows the application's Mooncake
  // engine) or a value outside its limit.
  static MooncakeOptions parse(const EngineOptions& options, bool shared_handle = false);
};

// Mooncake's C API engine handle, transfer_engine_t (a void* there).
using MooncakeEngineHandle = void*;

// The spec's MooncakeKVTransferInfo plus what makes it checkable. Value type.
struct MooncakeKVTransferInfo {
  static constexpr const char* kEngineName = "mooncake";

  std::string entity_id;       // TransferEngineInfo::my_entity_id of the owner
  std::string session_id;      // what a peer passes to openSegment
  std::uint64_t data_ptr = 0;  // the owner's cache base address
  KVLayout layout;
  std::uint64_t size = 0;          // bytes registered from data_ptr
  std::uint64_t generation = 0;    // random, nonzero, new for every engine
  std::uint64_t identity_ptr = 0;  // the owner's registered identity page
  // The owner's registered page epoch table (epochs.hpp): layout.num_pages
  // 8-byte words a reader fetches before and after its reads.
  std::uint64_t epochs_ptr = 0;
  // The owner's registered layer readiness words (readiness.hpp):
  // layout.num_pages 4-byte words a streaming reader polls (bounded: at most
  // once per poll interval, with the epochs, as a seqlock).
  std::uint64_t ready_ptr = 0;
  // A cache of one region per layer (regions.hpp; the wheel engine serves
  // such caches, registering each region): each layer's address, data_ptr
  // being layer 0's. Empty for a cache of one region at data_ptr.
  std::vector<std::uint64_t> layer_regions;

  // KVTransferInfo{engine = "mooncake", payload}.
  KVTransferInfo encode() const;
  // Treats the bytes as untrusted: throws Error(kInvalidArgument) when
  // info.engine is not "mooncake", Error(kCorruptDescriptor) naming the field
  // when the payload is truncated, oversized or inconsistent (null address,
  // zero generation, a layout larger than size, overflow).
  static MooncakeKVTransferInfo decode(const KVTransferInfo& info);

  bool operator==(const MooncakeKVTransferInfo&) const = default;
};

class MooncakeKVTransferEngine final : public KVTransferEngine {
 public:
  // The spec's MooncakeKVTransferEngine(kv_cache, entity_id, transfer_engine):
  // loads Mooncake, creates its engine, installs the transport and registers
  // the cache's memory (kHost or kSharedHost). Throws Error: kUnavailable
  // (library absent or incomplete, Mooncake refused to start),
  // kInvalidArgument (bad option, device memory, P2P-less metadata without a
  // session id). Nothing is left registered or loaded on failure.
  MooncakeKVTransferEngine(std::shared_ptr<KVCache> kv_cache, const TransferEngineInfo& info);
  // The spec's shape, on the application's own Mooncake engine:
  // `transfer_engine` is a live transfer_engine_t from createTransferEngine
  // with its transport installed, borrowed, never created, installed into or
  // destroyed (docs/engines/mooncake.md, "Sharing"). Loads the library (it
  // must be the one that made the handle) and registers the cache and its
  // identity page on the handle. Throws Error: kInvalidArgument (null handle,
  // null or device cache, bad option, another copy of Mooncake loaded),
  // kUnavailable (library absent or incomplete, a registration refused).
  // Nothing is left registered on the handle on failure.
  MooncakeKVTransferEngine(std::shared_ptr<KVCache> kv_cache, std::string entity_id,
                           MooncakeEngineHandle transfer_engine, const EngineOptions& options = {});
  ~MooncakeKVTransferEngine() override;

  MooncakeKVTransferEngine(const MooncakeKVTransferEngine&) = delete;
  MooncakeKVTransferEngine& operator=(const MooncakeKVTransferEngine&) = delete;

  // Typed as for every engine: MooncakeKVTransferInfo::decode() of it.
  KVTransferInfo get_kv_transfer_info() const override;
  // The spec's TransferEngineInfo.my_session_id as Mooncake reports it
  // (P2P mode: getLocalIpAndPort, "HOST:PORT"; a shared handle: see above).
  const std::string& session_id() const noexcept { return session_id_; }

  using KVTransferEngine::read_batched_async;
  std::string name() const override { return "mooncake"; }
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;
  // Layer-wise streaming: bounded polls of the owner's readiness words
  // (mooncake_readiness.hpp).
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> read_info) override;
  void connect(const RemoteCache& remote) override;

  void shutdown() override;

 private:
  std::string session_id_;
  std::unique_ptr<KVTransferEngine> impl_;  // the RMA engine over Mooncake
};

}  // namespace mstar::kv
