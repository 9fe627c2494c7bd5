// Copyright mstar-kv authors.
//
// The Mooncake engine: the spec's MooncakeKVTransferEngine, moving pages with
// Mooncake's transfer engine (its TCP transport with the P2P handshake, or
// whatever transport and metadata service a deployment already runs).
//
// mstar-kv has no build-time dependency on Mooncake. The engine loads
// Mooncake's C API (transfer_engine_c.h) at run time from a shared library:
//   1. EngineOptions::extra["mooncake_lib"] (the CLI's --mooncake-lib PATH),
//   2. else the environment variable MSTAR_KV_MOONCAKE_LIB,
//   3. else "libtransfer_engine.so" through the dynamic loader's search path.
// A library that cannot be loaded, or lacks a C API symbol, makes the
// constructor throw Error(kUnavailable) naming the path (or the symbol) and
// how to point at another one. The PyPI wheel mooncake-transfer-engine-non-cuda
// does not carry such a library (its .so files are pybind11 modules); build
// Mooncake's libtransfer_engine.so from source (see README.md).
//
// How a read works. The owner registers its whole cache with Mooncake
// (registerLocalMemory, location "cpu:0") and publishes a descriptor: the
// spec's MooncakeKVTransferInfo (entity_id, session_id, data_ptr, layout) plus
// the region size, a random generation and the address of a small registered
// "identity" page in which the owner keeps its own descriptor. A reader opens
// the owner's Mooncake segment by session id (openSegment, once per peer),
// reads the identity page and compares it with the descriptor it was given:
// a descriptor of a restarted owner (kStaleDescriptor), a forged address or
// size (kPermissionDenied) or another layout (kIncompatibleLayout) is rejected
// before any page read is submitted; an owner that cannot be reached, or does
// not serve the identity page the descriptor names, fails with kPeerFailure.
// (The check runs once per connection: a descriptor of an owner that died
// after the last check fails at Mooncake instead, kPeerFailure with no byte
// written, and the next read reconnects.) Page reads are then submitted as one
// Mooncake batch of READ requests (target_offset = the owner's data_ptr +
// offset, i.e. the owner's absolute address) and completed by a progress
// thread polling getTransferStatus.
//
// Page epochs (epochs.hpp): the owner also registers its cache's page epoch
// table and names it in the descriptor (epochs_ptr). A read of a
// SequenceInfo's descriptor (epoch != 0) reads the epoch words of its pages
// into a registered scratch page before the page reads and again after them,
// and fails with kStaleDescriptor if any page changed owner. (Tested here only
// through the PyPI wheel's engine, python/mstar_kv/mooncake_wheel.py, which
// does the same; the C library path runs where MSTAR_KV_MOONCAKE_LIB is set.)
//
// Layer readiness (readiness.hpp): the owner registers its layer readiness
// words too (ready_ptr, descriptor blob v3), so that streaming readers can
// poll them with ordinary reads (bounded polling: Mooncake has no
// notification a reader could wait on across every transport): this
// reader's watch (mooncake_readiness.hpp) reads the epochs, the words and the
// epochs again of its pages, 128 at a time, at most every 0.5 ms, one round
// outstanding; the wheel engine's reader (mooncake_wheel.py) does the same.
// Runs where Mooncake's C library is (MSTAR_KV_MOONCAKE_LIB): the streaming
// conformance cases cover it there; this project's machines have only the
// wheel, whose path is tested.
//
// Options, all in EngineOptions::extra (all optional):
//   "mooncake_lib"       library path (see above)
//   "mooncake_metadata"  Mooncake's metadata connection string; default
//                        "P2PHANDSHAKE" (no metadata server: peers handshake
//                        directly). With anything else ("etcd://...",
//                        "http://..."), my_session_id names this process's
//                        segment and is required.
//   "mooncake_host"      P2P mode: the host/IP advertised to peers; default
//                        the host of my_session_id when it has the form
//                        "HOST:PORT" (the port is Mooncake's choice), else
//                        "127.0.0.1".
//   "mooncake_protocol"  the transport to install; default "tcp" (the only
//                        one tested here; "rdma" for RDMA deployments).
//   "mooncake_location"  registerLocalMemory location; default "cpu:0".
//   "mooncake_abort_grace_ms"  see "Timeouts" below; default 2000.
//   "mooncake_session_id"  shared handle only: the session id to publish
//                        (see "Sharing" below); default getLocalIpAndPort.
// Unknown "mooncake_*" keys are rejected (kInvalidArgument) so that a typo is
// not silently ignored, and so are keys of the other mode (mooncake_metadata,
// mooncake_host and mooncake_protocol configure an engine this one creates:
// they are rejected with a shared handle; mooncake_session_id is accepted
// only with one). Mooncake reads its configuration from the environment
// when its engine is created (its C API takes none), so the library sets
// MC_TCP_ENABLE_CONNECTION_POOL=1 and MC_LOG_LEVEL=WARNING once, while the
// program loads (a static initializer of the Mooncake engine, before main),
// unless the user already set them, and never later: no engine calls setenv
// (without the connection pool, Mooncake's TCP transport opens a connection
// per request and runs ~4x slower; Mooncake still logs a few INFO lines at
// start-up). The engine keeps
// at most MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER (default 1024) requests per
// peer in Mooncake's hands, because Mooncake's TCP transport fails requests
// beyond that queue instead of waiting.
//
// Caches of different geometry (layout.hpp: page sizes, head shards, NHD <->
// HND) work as for every engine, but Mooncake's batch API has no strided
// form: the engine submits the planner's coalesced spans (planner.hpp
// plan_copies), one READ request each, so a layout change that leaves rows
// of a few hundred bytes costs one request per row; prefer matching in-page
// orders with this engine (the ucx engine gathers such rows instead).
//
// Authentication: none on Mooncake's data path, and extra["auth_token"] does
// not change that. Mooncake's transports (TCP, RDMA) serve reads of any
// registered buffer to any peer that opened the segment, and its P2P
// handshake and metadata services (etcd, HTTP) carry no credential: anyone
// who can reach the owner's Mooncake port and knows (or guesses) a
// registered address can read the cache, whatever the control plane
// checks. The engine accepts auth_token (so that `mstar-kv serve
// --token-file` protects its HTTP control plane with this engine too) and
// logs a warning once that it authenticates nothing here. Run Mooncake
// owners only on networks where every host that can reach them may read
// their KV, or use the ucx engine, whose connect handshake proves the token.
//
// Timeouts and the "no byte after resolution" promise. Mooncake's C API has
// no way to cancel a submitted request, so a read's future resolves only once
// Mooncake reports every request of its batch COMPLETED or FAILED. A peer
// that dies resets its sockets and its requests fail within milliseconds. A
// read that outlives EngineOptions::timeout is aborted: its future resolves
// with kTimeout as soon as all its requests reached a final state. If some
// are still in flight `mooncake_abort_grace_ms` after the abort (the peer
// hangs with its connections open), the only way to stop Mooncake writing
// into our pages is to destroy Mooncake's engine: the engine does that (with
// its own engine; with a shared handle it does not, see below), every
// read still in flight then fails (kPeerFailure, naming the hung peer), and
// the engine is unusable from then on (further reads throw kUnavailable, its
// descriptor no longer works); create a new one. A hung peer thus costs the
// engine, never a late write into a page whose future already resolved.
// openSegment's handshake is synchronous inside Mooncake and bounded by
// Mooncake's own socket timeouts, not by EngineOptions::timeout.
//
// Sharing the application's Mooncake engine. An application that already
// runs Mooncake passes its own engine handle (Mooncake's transfer_engine_t,
// from createTransferEngine, installTransport done) to the second
// constructor, and both use the one engine, its transport and its session.
// The engine then
//   * loads the C API library by the rules above; it must be the library that
//     made the handle (the constructor throws kInvalidArgument, naming both
//     files, when another copy of Mooncake's C API is already in the
//     process's global symbol scope);
//   * never calls createTransferEngine, installTransport or
//     destroyTransferEngine on the handle (the MC_* defaults above were set
//     at load, before the application created it);
//   * registers the cache and its identity page on the handle
//     (registerLocalMemory, location mooncake_location) and unregisters them
//     in shutdown(), as it does the 4 KiB scratch page of each descriptor
//     check; segments it opened stay open (Mooncake's closeSegment is a no-op);
//   * publishes as its session id extra["mooncake_session_id"] when set, else
//     what getLocalIpAndPort reports ("HOST:PORT"), which is the segment name
//     peers open on a P2PHANDSHAKE engine. A handle made with a metadata
//     server ("etcd://...") must pass its local_server_name there.
// The per-peer limit of requests in Mooncake's hands (above) counts this
// engine's requests only: the application's own transfers to the same peer
// share Mooncake's queue. The handle must stay valid until shutdown() has
// returned (the destructor runs it); the application destroys it afterwards,
// and may create further engines on it.
//
// A hung peer with a shared handle: the engine does NOT destroy Mooncake's
// engine, which is the application's. Once a read is still in flight
// `mooncake_abort_grace_ms` after its abort, the engine stops taking work:
// read_batched_async (and connecting) throw kUnavailable naming the hung peer,
// and it says so once on stderr. Reads of other peers already in flight
// finish normally, and peers can still read this engine's cache until
// shutdown(). The hung read's future stays UNRESOLVED until Mooncake
// reports every request of it COMPLETED or FAILED (the peer resumes, or its
// connection breaks: Mooncake's TCP transport has no deadline of its own on
// a stalled payload), and then resolves (kTimeout, or kShutdown when
// shutdown() aborted it); shutdown() and the
// destructor wait for that too. So with a shared handle no byte lands in a
// page after its future resolved, and the application's engine keeps working,
// but a hung peer's read (and shutdown) is bounded by the peer and Mooncake's
// transport, not by EngineOptions::timeout. To end the wait, end the peer's
// connection (kill or restart it); never destroy the handle while it lasts.
//
// Thread safety: every method is safe from any thread. shutdown() resolves
// every read in flight (kShutdown), deregisters the memory and destroys
// Mooncake's engine (a shared handle: only deregisters); idempotent, run by
// the destructor. The library stays loaded until the engine is destroyed.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/engine.hpp"
#include "mstar/kv/layout.hpp"
#include "mstar/kv/engine_options.hpp"

namespace mstar::kv {

// The engine's settings, parsed from EngineOptions::extra (see above).
struct MooncakeOptions {
  std::string library_path;  // resolved: option, environment or default
  std::string metadata = "P2PHANDSHAKE";
  std::string host;          // empty: from my_session_id, else 127.0.0.1
  std::string protocol = "tcp";
  std::string location = "cpu:0";
  std::uint32_t abort_grace_ms = 2000;
  std::string session_id;    // shared handle only; empty: getLocalIpAndPort
  Logger log;                // EngineOptions::log (set by the engine's constructors)

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

  std::string entity_id;        // TransferEngineInfo::my_entity_id of the owner
  std::string session_id;       // what a peer passes to openSegment
  std::uint64_t data_ptr = 0;   // the owner's cache base address
  KVLayout layout;
  std::uint64_t size = 0;       // bytes registered from data_ptr
  std::uint64_t generation = 0; // random, nonzero, new for every engine
  std::uint64_t identity_ptr = 0;  // the owner's registered identity page
  // The owner's registered page epoch table (epochs.hpp): layout.num_pages
  // 8-byte words a reader fetches before and after its reads.
  std::uint64_t epochs_ptr = 0;
  // The owner's registered layer readiness words (readiness.hpp):
  // layout.num_pages 4-byte words a streaming reader polls (bounded: at most
  // once per poll interval, with the epochs, as a seqlock).
  std::uint64_t ready_ptr = 0;

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
  MooncakeKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                           const TransferEngineInfo& info);
  // The spec's shape, on the application's own Mooncake engine:
  // `transfer_engine` is a live transfer_engine_t from createTransferEngine
  // with its transport installed, borrowed, never destroyed (see "Sharing the
  // application's Mooncake engine" above). Loads the library and registers
  // the cache on the handle. Throws Error: kInvalidArgument (null handle, null
  // or device cache, bad option, another copy of Mooncake loaded),
  // kUnavailable (library absent or incomplete, a registration refused).
  // Nothing is left registered on the handle on failure.
  MooncakeKVTransferEngine(std::shared_ptr<KVCache> kv_cache, std::string entity_id,
                           MooncakeEngineHandle transfer_engine,
                           const EngineOptions& options = {});
  ~MooncakeKVTransferEngine() override;

  MooncakeKVTransferEngine(const MooncakeKVTransferEngine&) = delete;
  MooncakeKVTransferEngine& operator=(const MooncakeKVTransferEngine&) = delete;

  // Typed as for every engine: MooncakeKVTransferInfo::decode() of it.
  KVTransferInfo get_kv_transfer_info() const override;
  // The spec's TransferEngineInfo.my_session_id as Mooncake reports it
  // (P2P mode: getLocalIpAndPort, "HOST:PORT"; a shared handle: see above).
  const std::string& session_id() const noexcept { return session_id_; }

  std::optional<KVLayout> remote_layout(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(
      const KVTransferInfo& remote_kv_info,
      std::span<const KVReadInfo> read_info) override;

  void shutdown() override;

 private:
  std::string session_id_;
  std::unique_ptr<KVTransferEngine> impl_;  // the RMA engine over Mooncake
};

}  // namespace mstar::kv
