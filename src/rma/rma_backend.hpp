// Copyright mstar-kv authors.
//
// The one-sided RMA backend interface (the spec's TensorTransferEngine role).
//
// RmaKVTransferEngine (rma_engine.hpp) does everything above the transport
// once, for every remote engine: descriptor encoding and validation, read
// planning and coalescing, futures, the per-read timeout, cancellation, the
// peer cache and shutdown. A backend (UCX, Mooncake) only has to
//
//   1. register the local cache's memory and describe it to peers
//      (RmaBackend::local_region, with its own bytes in backend_blob),
//   2. connect to a peer from that peer's description (RmaBackend::connect),
//      and say whether a description is what the peer really serves
//      (RmaPeer::verify, usually via verify_region() below),
//   3. read batches of byte ranges from the peer into local memory and report
//      each batch's outcome exactly once (RmaPeer::post_reads), stopping early
//      when asked (RmaOperation::abort).
//
// The contract that makes futures trustworthy lives in (3): a batch's
// completion callback runs exactly once, and only when no byte of that batch
// can land in local memory any more. The engine resolves the future from that
// callback and nowhere else, so "no byte after resolution" holds as long as
// the backend keeps this promise.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::rma {

// What an owner publishes about its registered cache: the spec's
// MooncakeKVTransferInfo fields (entity_id, session_id, data_ptr, layout) plus
// the size of the registered region, a generation that changes every time the
// region is (re)registered, and the backend's own bytes (a UCX remote key, a
// Mooncake segment name, ...). Value type.
struct RmaRegionInfo {
  std::string entity_id;       // who the owner is (TransferEngineInfo::my_entity_id)
  std::string session_id;      // how to reach it (backend-defined, e.g. "HOST:PORT")
  std::uint64_t data_ptr = 0;  // base address of the cache in the owner
  std::uint64_t size = 0;      // bytes registered from data_ptr
  KVLayout layout;
  std::uint64_t generation = 0;  // nonzero; new for every registration
  std::vector<std::uint8_t> backend_blob;
  // A cache of one region per layer (regions.hpp): each layer's address
  // (layout.layer_bytes() each; data_ptr is layer 0's, size the layout's
  // total). Empty for a cache of one region at data_ptr.
  std::vector<std::uint64_t> layer_regions;

  // Limits on decoded fields (the payload must fit a KVTransferInfo).
  static constexpr std::size_t kMaxIdBytes = 256;
  static constexpr std::size_t kMaxBlobBytes = 32u << 10;

  // Payload bytes for KVTransferInfo::payload (versioned; no frame: the
  // KVTransferInfo around it carries the checksum).
  std::vector<std::uint8_t> encode() const;
  // Untrusted bytes: throws Error(kCorruptDescriptor) naming the field on
  // truncated, oversized or inconsistent input (zero generation, a layout that
  // does not fit `size`, data_ptr + size overflowing; layer regions: a count
  // other than the layout's layers of a layer-contiguous layout, a size
  // other than the layout's, data_ptr other than layer 0's, null,
  // overlapping or overflowing regions), never over-reads.
  static RmaRegionInfo decode(std::span<const std::uint8_t> payload);

  // Layout offsets -> the owner's addresses (data_ptr + offset, or through
  // the layer regions).
  RegionMap region_map() const;

  bool operator==(const RmaRegionInfo&) const = default;
};

// An engine's typed descriptor (UcxKVTransferInfo, MooncakeKVTransferInfo:
// entity_id, session_id, data_ptr, size, layout, generation) to and from the
// region fields; the backend's own part travels in backend_blob.
template <typename Typed>
RmaRegionInfo region_of(const Typed& d, std::vector<std::uint8_t> backend_blob) {
  RmaRegionInfo r{d.entity_id,
                  d.session_id,
                  d.data_ptr,
                  d.size,
                  d.layout,
                  d.generation,
                  std::move(backend_blob),
                  {}};
  if constexpr (requires { d.layer_regions; }) r.layer_regions = d.layer_regions;
  return r;
}
// Decodes `info` as `engine`'s descriptor into `out`'s region fields and
// returns the backend blob. Throws Error(kInvalidArgument) for another
// engine's descriptor ("... is not a <display> descriptor"),
// Error(kCorruptDescriptor) as RmaRegionInfo::decode.
template <typename Typed>
std::vector<std::uint8_t> decode_region(const KVTransferInfo& info, const std::string& engine,
                                        const std::string& display, Typed& out) {
  if (info.engine != engine) {
    throw Error(StatusCode::kInvalidArgument,
                "descriptor of engine '" + info.engine + "' is not a " + display + " descriptor");
  }
  RmaRegionInfo r = RmaRegionInfo::decode(info.payload);
  out.entity_id = std::move(r.entity_id);
  out.session_id = std::move(r.session_id);
  out.data_ptr = r.data_ptr;
  out.size = r.size;
  out.layout = r.layout;
  out.generation = r.generation;
  if constexpr (requires { out.layer_regions; }) {
    out.layer_regions = std::move(r.layer_regions);
  } else if (!r.layer_regions.empty()) {
    throw Error(StatusCode::kNotSupported, "the " + display + " descriptor names a cache of " +
                                               std::to_string(r.layer_regions.size()) +
                                               " per-layer regions, which this engine cannot read");
  }
  return std::move(r.backend_blob);
}

// Compares what a descriptor claims (`claimed`) with what the peer serves now
// (`served`, learned from the peer itself) and throws, before any read is
// posted:
//   kStaleDescriptor    generation differs (owner restarted / re-registered)
//   kPermissionDenied   data_ptr / size differ (address outside the region)
//                       or backend_blob differs (forged remote key)
//   kIncompatibleLayout layout differs
//   kInvalidArgument    entity_id differs
// Every message names both values. Backends call this from RmaPeer::verify
// when their connection tells them the served region.
void verify_region(const RmaRegionInfo& served, const RmaRegionInfo& claimed);

// One contiguous read: `length` bytes at the peer's data_ptr + remote_offset
// land at the local cache base + local_offset. Spans come from the planner
// (already coalesced and bounds-checked against both layouts and regions);
// backends may split them further (split_spans) but must not merge across
// batches.
using RmaRead = CopySpan;

// Called exactly once per batch with its outcome: ok, or why it stopped
// (kPeerFailure when the peer died or became unreachable, kInternal for an
// unexpected transport error; after abort() the status is ignored and the
// engine reports its own reason). May run on a backend thread or, when the
// batch finishes synchronously, inside post_reads(). Must not block.
using RmaCompletion = std::function<void(Status)>;

// The page epochs a batch must see (epochs.hpp): every page in `pages` of
// the owner's cache must carry `epoch` before any byte of the batch is read
// and still after the last one, else the batch fails with kStaleDescriptor.
// epoch 0: no check.
struct RmaEpochCheck {
  std::uint64_t epoch = 0;
  std::vector<std::uint32_t> pages;
};

// A posted batch. Thread safety: abort() is safe from any thread, any time,
// any number of times, also after completion (then it does nothing).
class RmaOperation {
 public:
  virtual ~RmaOperation() = default;
  // Asks the backend to stop the batch. Non-blocking. The completion still
  // runs exactly once, within a bounded time the backend documents, and only
  // once nothing more of the batch can land locally (cancel the outstanding
  // requests and wait for their callbacks, close the endpoint, ...).
  virtual void abort() noexcept = 0;
};

// A connection to one peer (one remote region owner). Shared by every read to
// that peer; the engine caches it by session_id and drops it once failed().
// Thread safety: every method is safe from any thread.
class RmaPeer {
 public:
  virtual ~RmaPeer() = default;

  // Throws Error (see verify_region) unless `claimed` is exactly what this
  // peer serves now. Called before every batch; must not block long.
  virtual void verify(const RmaRegionInfo& claimed) const = 0;

  // True once the connection broke (peer died, endpoint error). A failed peer
  // never becomes healthy again; the engine connects afresh.
  virtual bool failed() const noexcept = 0;

  // Posts the reads and returns at once (never waits for the transfer).
  // `done` runs exactly once (see RmaCompletion). Reads may be empty only
  // never: the engine does not post empty batches. Throws Error only for a
  // synchronous failure before anything was posted (then `done` never runs).
  virtual std::shared_ptr<RmaOperation> post_reads(std::vector<RmaRead> reads, RmaCompletion done,
                                                   RmaEpochCheck check) = 0;

  // The same for strided spans (planner.hpp), posted only to peers of a
  // backend whose strided_reads() is true: "N rows of L bytes, strides A and
  // B" stays one span on the way to the peer. The default posts the spans'
  // rows (strided_rows) with post_reads.
  virtual std::shared_ptr<RmaOperation> post_strided_reads(std::vector<StridedSpan> spans,
                                                           RmaCompletion done,
                                                           RmaEpochCheck check) {
    return post_reads(strided_rows(spans), std::move(done), std::move(check));
  }

  // Queues a done notice for sequence seq_id published with `epoch` to the
  // owner (leases, pool.hpp); never waits for it. Backends without a channel
  // to the owner throw Error(kNotSupported) (the default).
  virtual void send_done(std::uint64_t seq_id, std::uint64_t epoch) {
    (void)epoch;
    throw Error(StatusCode::kNotSupported,
                "this engine has no channel to the owner for the done notice of sequence " +
                    std::to_string(seq_id));
  }

  // Layer-wise streaming (readiness.hpp): a watch on the owner's layer
  // readiness of `pages` (owner page indices, in range), which must carry
  // `epoch` (nonzero) for as long as the watch lives, over this backend's
  // channel to the owner. The engine validated the read before. Backends
  // without a readiness channel throw Error(kNotSupported) (the default).
  virtual std::unique_ptr<LayerWatch> watch_layers(std::vector<std::uint32_t> pages,
                                                   std::uint64_t epoch, std::uint32_t num_layers) {
    (void)pages;
    (void)epoch;
    (void)num_layers;
    throw Error(StatusCode::kNotSupported, "no readiness channel to the owner");
  }
};

// One backend instance per engine, bound to one local cache. Thread safety:
// every method is safe from any thread.
class RmaBackend {
 public:
  virtual ~RmaBackend() = default;

  // The KVTransferInfo::engine name of descriptors this backend reads and
  // writes ("ucx", "mooncake").
  virtual std::string_view engine_name() const noexcept = 0;

  // This process's region, ready to publish (all fields set).
  virtual RmaRegionInfo local_region() const = 0;

  // Connects to the owner of `remote` (already decoded, not yet verified),
  // bounded by `timeout`. Throws Error: kPeerFailure / kTimeout when the peer
  // cannot be reached in time, kInvalidArgument for an unusable session_id.
  // The engine then calls verify() on the result.
  virtual std::shared_ptr<RmaPeer> connect(const RmaRegionInfo& remote,
                                           std::chrono::milliseconds timeout) = 0;

  // True when the backend's peers move strided spans natively
  // (RmaPeer::post_strided_reads): the engine then plans with
  // plan_strided_copies, else with plan_copies. Default: false.
  virtual bool strided_reads() const noexcept { return false; }

  // Stops the backend: every batch still outstanding completes (its callback
  // has run when this returns), connections close, memory is deregistered.
  // Idempotent. The engine calls it after aborting its own reads, holding
  // none of their RmaOperation handles any more; it must still not wait for
  // a handle or a LayerWatch to be let go (a caller may hold a watch, an
  // operation whose completion runs during this call is held until then):
  // release what they use here, and let them free only their memory later.
  virtual void shutdown() noexcept = 0;

  // Owner side: runs `handler(seq_id, epoch)` for every done notice a reader
  // sends (RmaPeer::send_done). Default: notices are not served.
  virtual void set_done_handler(std::function<void(std::uint64_t, std::uint64_t)> handler) {
    (void)handler;
  }

  // Owner side: what this backend served (stats.hpp); zeros where it does
  // not see what it serves (the default).
  virtual ServedStats served_stats() const { return {}; }
};

}  // namespace mstar::kv::rma
