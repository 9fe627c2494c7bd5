// Copyright mstar-kv authors.
//
// The UCX engine ("ucx"): reads of a host-memory KV cache across hosts
// through UCX, built when UCX is found (MSTAR_KV_ENGINE_UCX); a GPU cache
// crosses through pinned host buffers (ucx_staging below). This header
// holds its descriptor and its options; how it works, and why:
// docs/engines/ucx.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/layout.hpp"

namespace mstar::kv {

// The engine has no public class: make it through the factory, make_engine /
// KVTransferManager with TransferEngineInfo{entity, "HOST:PORT", "ucx",
// options} and a cache from make_kv_cache(layout, MemoryKind::kHost).
//
// Set-up: the constructor registers the whole cache with UCX once and opens a
// listener on my_session_id = "HOST:PORT" (empty, or a bare label without
// ':': 127.0.0.1 and a free port in 20000-29999); the descriptor carries
// that address. One progress thread per engine owns the UCP worker: callers
// never drive progress, read_batched_async posts and returns, and futures
// resolve on that thread.
//
// Reads: the first read from a peer connects and asks the owner for the
// region it serves now; a descriptor that differs from it (generation,
// region, remote key, layout) is rejected before anything is posted, and the
// owner checks every requested range against its region again. Page epochs
// (epochs.hpp) are checked by the owner before its first byte and after its
// last (gets: the reader asks the owner before and after); a stale read
// fails with kStaleDescriptor and keeps the connection. notify_done() sends
// the owner a done notice (serve_done_notices frees the sequence);
// watch_layers() streams from the owner's readiness notices.
//
// Errors and faults: bad arguments throw Error before any byte moves. A dead
// peer fails every read on it with kPeerFailure as soon as UCX reports it,
// and in any case within the engine's timeout (kTimeout). A read that is
// timed out, cancelled or shut down resolves only once none of its bytes can
// land any more (am: data of a stopped read is dropped on arrival and
// outstanding receives are completed by closing the endpoint by force, which
// evicts the peer: its other reads fail with kPeerFailure, the next read
// reconnects; get: the gets in flight complete, or after 250 ms or the
// owner's death the endpoint is closed by force and they are written off).
//
// Options (EngineOptions.extra):
//   ucx_mode        auto | get | am | am_shm   (default auto: get when an RMA
//                   lane is an RDMA transport, am otherwise; am_shm and get
//                   over shared memory are opt-in: UCX 1.13's shared-memory
//                   endpoints have no peer error handling, so a peer killed
//                   mid-transfer can stall them)
//   ucx_am_proto    auto | eager | rndv   how this engine, as an owner, sends
//                   am replies (default auto: rendezvous from 32 KiB; always
//                   eager for am_shm readers)
//   ucx_chunk_bytes bytes per get / am reply, in [4096, 2^30] (default 4 MiB)
//   ucx_progress    adaptive | busy | event   how the progress thread waits
//                   when UCX has nothing to do: adaptive (default) polls,
//                   yielding the core, while reads or replies are in flight
//                   and sleeps on the worker's event fd after 256 idle
//                   rounds; event sleeps at once; busy never sleeps
//   ucx_staging     auto | on | off   move the cache's bytes through host
//                   staging buffers (default auto: a device cache is staged,
//                   with the cuda_ipc copy kernel, a host cache is not; on:
//                   a host cache too, with memcpy; off: a device cache is
//                   refused). Without the option, MSTAR_KV_UCX_STAGING says.
//                   A staged cache is never registered or read by gets
//                   (ucx_mode=get is refused); docs/engines/ucx.md
//   ucx_emulated_gets on | off   whether this engine, as an owner without an
//                   RDMA transport (rc/dc), publishes its remote keys and so
//                   serves gets, which UCX 1.13 then emulates with active
//                   messages over tcp or shared memory (default off: a reader
//                   killed mid-get can abort such an owner or stall it for
//                   every reader). A reader with ucx_mode=get gets
//                   kUnavailable at connect from an owner that serves none.
//                   Without the option, MSTAR_KV_UCX_EMULATED_GETS says
//   ucx_peer_timeout_ms 0 | 200..3600000 (default 20000)   a reader fails
//                   the reads of an owner that sent nothing and answered no
//                   ping (sent after a quarter of it) for this long, with
//                   kPeerFailure: a killed owner still exiting keeps its
//                   sockets open and is seen only by its silence. 0: off
//   auth_token      a shared secret of at least 16 bytes (default none): a
//                   mutual HMAC-SHA-256 challenge-response when connecting
//                   (the secret never crosses the wire), then a per-connection
//                   ticket on every request. Refusals are kPermissionDenied
//                   before any byte moves: a reader without the token or with
//                   another, or a reader with a token whose owner has none.
//                   It authenticates, it does not encrypt: KV bytes, tickets
//                   and the descriptor's remote key cross in clear.
// Other keys starting with "ucx_" are refused (kInvalidArgument). UCX itself
// reads its environment (UCX_TLS, UCX_NET_DEVICES); MSTAR_KV_UCX_DEBUG=1
// prints each endpoint's lanes. An owner restarted on the same port while
// its old connections sit in TIME_WAIT needs UCX_TCP_CM_REUSEADDR=y
// (`mstar-kv serve` sets it). Wire format: src/engines/ucx/ucx_wire.hpp.
//
// Thread safety, errors and shutdown are those of every engine (engine.hpp):
// safe from any thread; shutdown() resolves every in-flight read with
// kShutdown, closes every endpoint and the listener, deregisters the memory;
// idempotent.

// The "ucx" engine's descriptor: the spec's MooncakeKVTransferInfo fields
// plus what UCX needs. Value type. Available when the ucx engine is built.
struct UcxKVTransferInfo {
  std::string entity_id;       // the owner's TransferEngineInfo::my_entity_id
  std::string session_id;      // "HOST:PORT" of the owner's ucp_listener
  std::uint64_t data_ptr = 0;  // base address of the owner's cache
  std::uint64_t size = 0;      // bytes registered from data_ptr
  KVLayout layout;
  std::uint64_t generation = 0;  // new for every engine instance
  // ucp_rkey_pack of the registration; for a cache of one region per
  // layer, each region's key: u32 count, then u32 length and bytes each.
  std::vector<std::uint8_t> rkey;
  // A cache of one region per layer: each layer's address (data_ptr is
  // layer 0's); empty for one region.
  std::vector<std::uint64_t> layer_regions;

  // Throws Error(kInvalidArgument) when info is not a "ucx" descriptor and
  // Error(kCorruptDescriptor) naming the field when its payload is malformed.
  static UcxKVTransferInfo decode(const KVTransferInfo& info);
  KVTransferInfo encode() const;
};

}  // namespace mstar::kv
