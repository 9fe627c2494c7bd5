// Copyright mstar-kv authors.
//
// The UCX engine ("ucx"): cross-host reads of a host-memory KV cache through
// UCX (Debian's libucx), built when UCX is found (MSTAR_KV_ENGINE_UCX).
// Create it through the factory: make_engine / KVTransferManager with
// TransferEngineInfo{entity, "HOST:PORT", "ucx", options} and a cache from
// make_kv_cache(layout, MemoryKind::kHost).
//
// How it works
// * At construction the engine registers the whole cache with ucp_mem_map
//   (once), packs its remote key and opens a ucp_listener on
//   my_session_id = "HOST:PORT" (empty, or a bare label without ':':
//   127.0.0.1 and a free port in 20000-29999, outside the ephemeral range).
//   The listen address is how peers reach it; the descriptor carries it.
// * Progress: one dedicated progress thread per engine owns the UCP worker;
//   every UCP call other than registration runs on it. Callers never drive
//   progress; read_batched_async posts and returns, futures resolve from the
//   progress thread.
// * Connecting: the first read from a peer connects to its listener (client
//   / server endpoints with UCP_ERR_HANDLING_MODE_PEER, so both sides hold an
//   endpoint) and asks the peer for the region it serves now and its worker
//   address; the descriptor must equal that region (generation, region,
//   remote key, layout), otherwise the read is rejected before anything is
//   posted. For gets a second endpoint is opened to the worker address (UCX
//   1.13 gives client/server endpoints only the connection manager's
//   transports, i.e. tcp, never shared memory). Endpoints are cached per
//   peer; a failed peer is evicted and the next read connects afresh.
// * Page epochs (epochs.hpp): a read of a SequenceInfo's descriptor names
//   the sequence's epoch and its remote pages. In the am modes the owner
//   checks them against its own table before sending the first byte and
//   again once every send completed, and answers with its verdict; the read
//   resolves only after it (a changed page fails it with kStaleDescriptor).
//   With gets the reader asks the owner for the same check before posting
//   and after the last get landed. A stale read keeps the connection.
// * Done notices: notify_done() sends an active message naming the sequence
//   and its epoch; the owner's handler (serve_done_notices) frees it.
// * Ways to read, chosen per connection ("ucx_mode"):
//     am     peer-served: the reader sends the planned byte ranges in one
//            active message over the client/server endpoint; the owner
//            validates them against its registered region and generation
//            and answers with active-message sends straight from its
//            registered pages (rendezvous, zero-copy on the owner, for
//            replies of 32 KiB and more; eager below); the reader lands them
//            in its own registered pages. Many spans of under 256 KiB on
//            average (a scattered page table's blocks; the rows of a change
//            of in-page order or head shard, planned as strided spans,
//            planner.hpp, and crossing as such, one per (page, layer, k|v,
//            head) at worst) are gathered by the owner from its pages into
//            messages of up to 1 MiB (UCX packs them into its segments, from
//            an iov; a strided span's rows the owner packs itself, never
//            listing them), and the reader unpacks each into its pages
//            (non-temporal stores in reads of 16 MiB and more). The owner
//            keeps at most 32 replies of a read in flight. TCP segments are
//            64 KiB unless UCX_TCP_TX_SEG_SIZE / UCX_TCP_RX_SEG_SIZE are set.
//     get    one-sided ucp_get_nbx with the peer's remote key, on a second
//            endpoint opened to the owner's worker address (UCX 1.13 gives
//            client/server endpoints only the connection manager's
//            transports, i.e. tcp); at most 16 gets per read in flight.
//     am_shm like am, but over the worker-address endpoint when its am lane
//            is shared memory (sysv/posix fifo), with eager replies only.
//     auto (default) opens the worker-address endpoint, asks it which
//            transports carry its lanes (ucp_ep_print_info: UCX 1.13's
//            ucp_ep_query does not tell) and uses get when an RMA lane is an
//            RDMA transport (rc/dc), am otherwise.
//   Measured with UCX 1.13 on this machine: ucp_get_nbx is a software
//   emulation over active messages on tcp and on shared memory as well
//   (posix/sysv map only memory UCX allocated itself; cma serves rendezvous,
//   not gets): 0.2-1.2 GB/s, where am replies reach the transport's send
//   bandwidth. Shared-memory endpoints cannot have peer error handling in
//   UCX 1.13 (only cma supports it; asking for it makes UCX pick tcp), and
//   an owner killed mid-transfer was seen to abort the reader (cma
//   rendezvous) or to stall the reader's receive fifo for every other peer;
//   and a reader killed while it still wrote a request (a 12 MiB span list
//   is ~1,500 fifo elements) into the owner's receive fifo was seen to stall
//   the owner's fifo for every later reader on shared memory (the
//   ReaderKilled data-path test, 1 in 30-50 runs under load, 2026-12-03).
//   That is why auto does not use shared memory, and why am_shm and get over
//   shared memory are opt-in: they pass every test here except kill -9 of an
//   owner during a pull, or of a reader while it sends. The public API is a
//   read either way.
// * Faults: a dead peer fails every read on it with kPeerFailure as soon as
//   UCX's peer error handling reports it, and in any case within the
//   engine's timeout (kTimeout). A read that is timed out, cancelled or shut
//   down is stopped without letting a byte land afterwards:
//     am   data messages of a stopped read are dropped on arrival (eager data
//          is copied only while the read is live, on the progress thread);
//          rendezvous receives still outstanding are completed by closing
//          the endpoint with UCP_EP_CLOSE_FLAG_FORCE (UCX completes them
//          with UCS_ERR_CANCELED) before the read resolves. Closing evicts
//          the peer: other reads on it fail with kPeerFailure, the next read
//          reconnects.
//     get  at most 16 gets per read are in flight; a stopped read posts no
//          more and resolves when those have completed. If they have not
//          after 250 ms (a hung owner), or the owner died, the endpoint is
//          closed by force and they are written off: gets are executed by
//          the progress thread inside UCX calls on that endpoint (shared
//          memory copies, tcp's emulated replies), so once it is closed
//          nothing of them can land. (On RDMA hardware, which this build was
//          not tested on, a NIC writes; there UCX's forced close is relied
//          on.)
//
// Options (EngineOptions.extra)
//   ucx_mode        auto | get | am | am_shm   (default auto)
//   ucx_am_proto    auto | eager | rndv    how this engine, as an owner,
//                                           sends am replies (default auto:
//                                           rendezvous from 32 KiB; always
//                                           eager for am_shm readers)
//   ucx_chunk_bytes bytes per get / am reply, in [4096, 2^30] (default 4 MiB)
//   ucx_progress    adaptive | busy | event   how the progress thread waits
//                   when UCX has nothing to do: adaptive (default) keeps
//                   polling, yielding the core between rounds, while reads
//                   or replies are in flight (a read of a hung owner polls
//                   until its timeout) and sleeps on the worker's event fd
//                   after 256 idle rounds otherwise; event sleeps at once
//                   (least CPU, slowest); busy never sleeps, idle or not (a
//                   core per engine, as ucx_perftest does). Measured in
//                   bench/README.md ("UCX progress policies").
//   auth_token      a shared secret of at least 16 bytes (default none). With
//                   it, connecting is a mutual challenge-response (HMAC-SHA-256
//                   over fresh nonces from both sides; the secret never
//                   crosses the wire): the owner proves the secret first, then
//                   the reader, and only then does the owner describe its
//                   region (address, remote key, worker address); every later
//                   request carries a random per-connection ticket the owner
//                   checks, revoked when the connection closes. Refusals are
//                   kPermissionDenied before any byte moves: a reader without
//                   the token, with another one, or (a reader with a token)
//                   an owner without one. It authenticates peers; it does not
//                   encrypt: KV bytes and tickets cross in clear, and a
//                   descriptor carries the remote key, so descriptors travel
//                   over an authenticated channel (mstar-kv serve with
//                   --token-file). Wire format: src/engines/ucx/ucx_wire.hpp.
// UCX itself is configured by its environment (UCX_TLS, UCX_NET_DEVICES).
// MSTAR_KV_UCX_DEBUG=1 prints each rma endpoint's lanes (what auto decides on).
// An owner restarted on the same port while its old connections sit in
// TIME_WAIT needs UCX_TCP_CM_REUSEADDR=y (SO_REUSEADDR; UCX's default is
// off, and ucp_config_modify cannot set it); `mstar-kv serve` sets it.
//
// Thread safety, errors and shutdown are those of every engine (engine.hpp):
// safe from any thread; shutdown() resolves every in-flight read with
// kShutdown, closes every endpoint and the listener, deregisters the memory.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/layout.hpp"

namespace mstar::kv {

// The "ucx" engine's descriptor: the spec's MooncakeKVTransferInfo fields
// plus what UCX needs. Value type. Available when the ucx engine is built.
struct UcxKVTransferInfo {
  std::string entity_id;   // the owner's TransferEngineInfo::my_entity_id
  std::string session_id;  // "HOST:PORT" of the owner's ucp_listener
  std::uint64_t data_ptr = 0;  // base address of the owner's cache
  std::uint64_t size = 0;      // bytes registered from data_ptr
  KVLayout layout;
  std::uint64_t generation = 0;   // new for every engine instance
  std::vector<std::uint8_t> rkey; // ucp_rkey_pack of the registration

  // Throws Error(kInvalidArgument) when info is not a "ucx" descriptor and
  // Error(kCorruptDescriptor) naming the field when its payload is malformed.
  static UcxKVTransferInfo decode(const KVTransferInfo& info);
  KVTransferInfo encode() const;
};

}  // namespace mstar::kv
