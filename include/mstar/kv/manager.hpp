// Copyright mstar-kv authors.
//
// KVTransferManager: the one manager of C++ and Python (the Python package
// binds this class): owns an engine, plans each pull against the remote
// cache's geometry, runs it, streams it, counts it, and cleans up.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"
#include "mstar/kv/core/requests.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/streaming.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv {

class KVCachePool;
class LayerStreamer;
class RequestRegistry;

// One peer of a read assembled from several: a tensor-parallel merge, e.g. a
// TP=1 decode cache pulling heads 0-3 from prefill rank 0 and 4-7 from rank
// 1.
struct RemoteShard {
  std::vector<std::uint32_t> page_indices;  // in that peer's page size
  KVTransferInfo kv_transfer_info;
};

// Ownership: the manager shares its engine (std::shared_ptr) and its cache;
// futures and streams it returns may outlive it (they resolve, with
// kShutdown at the latest once cleanup() ran).
// Thread safety: every method is safe from any thread; concurrent retrieves
// into disjoint local pages are supported.
// Errors: a bad argument throws Error before any byte moves; a transfer's
// error travels in its future. Every call after cleanup() throws
// Error(kShutdown) naming the call.
// Shutdown: cleanup() stops the streams (they resolve once nothing of theirs
// is in flight), then shuts the engine down (in-flight futures resolve with
// kShutdown). Idempotent; run by the destructor.
class KVTransferManager {
 public:
  using RemoteShard = kv::RemoteShard;
  // With the engine make_engine() creates from the info (factory.hpp); no
  // info (or "local") is the local-only engine.
  // `scope`: the resource this manager serves and whether it publishes at
  // all (requests.hpp); its resource_key must be at most
  // RequestKVTransferInfo::kMaxNameBytes (else Error(kInvalidArgument)).
  KVTransferManager(std::optional<TransferEngineInfo> transfer_engine_info,
                    std::shared_ptr<KVCache> kv_cache, ResourceScope scope = {});
  // Around an engine built elsewhere (a fault injector, a Python engine).
  // `engine_timeout` is that engine's read timeout (EngineOptions::timeout),
  // which the manager cannot ask it for: streams default their
  // ready_timeout to it (streaming.hpp).
  KVTransferManager(std::shared_ptr<KVCache> kv_cache, std::shared_ptr<KVTransferEngine> engine,
                    std::chrono::milliseconds engine_timeout = std::chrono::milliseconds{30000},
                    ResourceScope scope = {});
  ~KVTransferManager();

  KVTransferManager(const KVTransferManager&) = delete;
  KVTransferManager& operator=(const KVTransferManager&) = delete;

  // Descriptor another process needs to read this cache remotely.
  // KVCachePool::publish stamps it onto every SequenceInfo. The local-only
  // (empty) one when the scope does not need remote transfer.
  KVTransferInfo get_kv_transfer_info() const;

  // Request-scoped descriptors (requests.hpp; implemented in
  // manager_requests.cpp). Publishes request p.request_id's cache p.label
  // and stamps its pages' epochs; returns its descriptor (equal for equal
  // publications), or std::nullopt where nothing is published (the scope
  // does not need remote transfer, or the engine is local-only). Throws
  // Error(kInvalidArgument) naming the value for a bad publication (pages
  // out of range or named twice, seq_len beyond the pages, names too long)
  // and Error(kNotSupported) for a Python engine whose descriptors are not
  // a KVTransferInfo.
  std::optional<RequestKVTransferInfo> get_kv_transfer_info(const RequestPublication& p);
  // True when this manager published `info` for (request_id, label), under
  // its resource key, and has not removed that request since.
  bool owns_transfer_info(const RequestKVTransferInfo& info, std::string_view request_id,
                          std::string_view label) const;
  // Releases everything request_id holds: every label's publication (their
  // pages no other publication holds are stamped 0, so that reads of its
  // descriptors fail with kStaleDescriptor). No-op for an unknown request.
  void remove_request(std::string_view request_id);
  // The resource this manager serves.
  const ResourceScope& scope() const noexcept { return scope_; }

  // Decodes and validates a remote descriptor once (the engine's
  // open_remote: engine name, format, layout compatibility), without
  // contacting its owner. Every form below that takes a KVTransferInfo
  // opens it first; callers pulling several ranges of one descriptor may
  // open it once and pass the RemoteCache (which must come from this
  // manager's open_remote). A descriptor with page_epochs (a sequence that
  // shares pages, descriptor.hpp) is one handle per epoch, not one: it
  // throws Error(kInvalidArgument); pass the KVTransferInfo itself to the
  // forms below, which read each page with its own epoch.
  RemoteHandle open_remote(const KVTransferInfo& kv_transfer_info) const;

  // Opens what reads from the owner of `kv_transfer_info` need ahead of
  // the first one (KVTransferEngine::connect: the ucx connection, the shm
  // mapping), so that the first pull from a new peer costs what a later one
  // does. Any descriptor of that owner's cache will do (its epoch is not
  // looked at). Blocks for at most the engine's timeout; throws the Error
  // the first read would have thrown there. Moves no byte, is not counted
  // in stats() as a read.
  void connect(const KVTransferInfo& kv_transfer_info);

  // Pulls tokens [start_len, end_len) of a remote sequence (skip a cached
  // prefix by raising start_len). Validates everything first and throws
  // Error before any byte moves: the caller's local page table (errors
  // naming its entries), the descriptor, then the remote page table against
  // the remote layout (check_remote_pages). An empty range (start_len ==
  // end_len) is validated the same way, then returns std::nullopt.
  // The remote cache may differ in geometry (layout.hpp, planner.hpp): page
  // size (remote_page_indices in its own page size), head shard (it must
  // hold every head of the local cache; else use the shard form below),
  // in-page and cache order. A descriptor with page_epochs is read one
  // engine read per epoch (each page with its own), joined into one future;
  // engines see descriptors without them.
  std::optional<TransferFuture> start_async_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const KVTransferInfo& kv_transfer_info);
  std::optional<TransferFuture> start_async_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const RemoteCache& remote);

  // The same from a request-scoped descriptor (manager_requests.cpp): its
  // resource key must be this manager's, tokens [start_len, end_len) within
  // its seq_len, and remote_page_indices its page_indices where the range
  // reads them (the caller's table, as upstream passes it); each page is
  // read with the epoch the descriptor names for it (one engine read per
  // distinct epoch, joined). Throws Error(kInvalidArgument) naming the
  // mismatch before any byte moves; a page released or re-stamped since
  // fails the future with kStaleDescriptor.
  // (Named apart from start_async_retrieve so that a `{}` descriptor stays
  // the local-only KVTransferInfo.)
  std::optional<TransferFuture> start_async_retrieve_request(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const RequestKVTransferInfo& info);
  // Reads of a request-scoped descriptor planned by the caller (upstream's
  // engine-level read_batched_async): every read's remote page must be one
  // of the descriptor's and its tokens within its seq_len. std::nullopt for
  // no reads (the descriptor validated all the same).
  std::optional<TransferFuture> read_request_async(const RequestKVTransferInfo& info,
                                                   std::span<const KVReadInfo> read_info);

  // The two forms above with the descriptor opened by `open` (for engines
  // whose descriptors are not a KVTransferInfo, e.g. Python engines):
  // `open` runs after the local table was checked, inside the pull, so that
  // a refused descriptor fails and is counted as any refused read.
  using RemoteOpener = std::function<RemoteHandle()>;
  std::optional<TransferFuture> start_async_retrieve_from(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const RemoteOpener& open);

  // Pulls tokens [start_len, end_len) of every local head from the shards
  // that hold them: each local head from the first shard (in the order
  // given) that holds it, one read per shard that contributes, and one
  // future for the whole (join_futures: the sum of the bytes, or the first
  // failure once every part resolved; cancel() cancels every part). Throws
  // Error(kIncompatibleLayout) naming the heads no shard holds, and what the
  // form above throws, before any byte moves: every shard is planned first;
  // if an engine then refuses its shard's read, the parts already issued are
  // cancelled and waited for before the error is thrown.
  std::optional<TransferFuture> start_async_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices, std::span<const RemoteShard> shards);

  // start_async_retrieve, then waits; returns the bytes read (0 for an
  // empty range) or throws Error.
  std::uint64_t sync_retrieve(std::uint64_t start_len, std::uint64_t end_len,
                              std::span<const std::uint32_t> local_page_indices,
                              std::span<const std::uint32_t> remote_page_indices,
                              const KVTransferInfo& kv_transfer_info);

  // Layer-wise streaming (streaming.hpp): the same pull as
  // start_async_retrieve, issued layer by layer as the owner marks layers
  // ready (KVCachePool::mark_layers_ready). Validates everything first and
  // throws Error before any byte moves: the errors of start_async_retrieve,
  // Error(kNotSupported) naming the engine when it has no readiness channel
  // (local), Error(kInvalidArgument) for a descriptor without a page epoch
  // (not published by a KVCachePool) or options out of range; a
  // descriptor with page_epochs is watched and read one handle per epoch
  // (the RemoteCache form refuses one, as open_remote does). std::nullopt
  // when start_len == end_len. The stream's errors (kTimeout for a layer
  // never marked, kStaleDescriptor, kCorruptDescriptor, the owner's death, a
  // layer's read failing) travel in its future and wait_for_layer.
  std::optional<LayerStream> start_streaming_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const KVTransferInfo& kv_transfer_info,
      StreamOptions options = {});
  std::optional<LayerStream> start_streaming_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const RemoteCache& remote,
      StreamOptions options = {});
  std::optional<LayerStream> start_streaming_retrieve_from(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices, const RemoteOpener& open,
      StreamOptions options = {});

  void cleanup();
  // Closes the manager as cleanup() does but lets go of the engine without
  // shutting it down: for a manager around an engine its caller keeps using
  // (the Python package's managers over caller-built engines). engine() must
  // not be called afterwards.
  void detach() noexcept;
  bool closed() const noexcept { return closed_.load(std::memory_order_acquire); }

  // Done notices (leases, pool.hpp). Reader side: tells the owner of `seq`
  // that this reader is done with it, over the engine's own channel (UCX:
  // an active message), so that the owner frees it before its lease
  // expires. Throws Error(kNotSupported) for engines without such a channel
  // (shm, cuda_ipc, mooncake): use the side channel (e.g. `mstar-kv serve`'s
  // POST /v1/sequences/{id}/done). Not acknowledged: returns once the notice
  // is queued (connecting to the owner first if needed, bounded by the
  // engine's timeout).
  void notify_done(const SequenceInfo& seq);
  // Owner side: done notices that arrive at this manager's engine free the
  // named sequence in `pool` if it still holds the epoch the notice names
  // (KVCachePool::done). The manager keeps only a weak reference; null
  // stops serving them.
  void serve_done_notices(std::shared_ptr<KVCachePool> pool);

  // Statistics of every read this manager started (stats.hpp): per peer and
  // in total, counts by outcome, bytes, copies and per-phase latency. Always
  // on (a lock and a few additions per read). Reads resolved after cleanup()
  // are still counted. And the owner side (TransferStats::served): what its
  // engine served to readers of this cache (KVTransferEngine::served_stats)
  // and the descriptors and done notices of the pool given to
  // serve_done_notices.
  TransferStats stats() const;
  // Stops (or resumes) recording; for measuring what recording costs.
  void set_stats_enabled(bool enabled) noexcept {
    stats_enabled_.store(enabled, std::memory_order_relaxed);
  }

  KVTransferEngine& engine() noexcept { return *engine_; }
  const std::shared_ptr<KVTransferEngine>& engine_ptr() const noexcept { return engine_; }
  const KVCache& kv_cache() const noexcept { return *kv_cache_; }
  const std::shared_ptr<KVCache>& kv_cache_ptr() const noexcept { return kv_cache_; }

 private:
  void check_open(const char* what) const;
  // Runs `issue` counted in the stats (when enabled).
  std::optional<TransferFuture> tracked(
      const std::function<std::optional<TransferFuture>()>& issue);
  LayerStreamer& streamer();
  void stop_streams() noexcept;

  // Checks the scope and makes the request registry (constructors).
  void init_requests(ResourceScope scope);
  // start_async_retrieve_from; `shared`, when given, is the descriptor
  // `open` opened without its page_epochs (read_shared).
  std::optional<TransferFuture> retrieve_opened(std::uint64_t start_len, std::uint64_t end_len,
                                                std::span<const std::uint32_t> local_page_indices,
                                                std::span<const std::uint32_t> remote_page_indices,
                                                const RemoteOpener& open,
                                                const KVTransferInfo* shared);
  // start_streaming_retrieve_from, with `shared` as for retrieve_opened.
  std::optional<LayerStream> stream_opened(std::uint64_t start_len, std::uint64_t end_len,
                                           std::span<const std::uint32_t> local_page_indices,
                                           std::span<const std::uint32_t> remote_page_indices,
                                           const RemoteOpener& open, const KVTransferInfo* shared,
                                           StreamOptions options);
  // `reads` of `base` (opened from `info` without its page_epochs), each
  // remote page with the epoch `info` names for it: one engine read per
  // epoch, joined.
  std::optional<TransferFuture> read_shared(const KVTransferInfo& info, RemoteHandle base,
                                            std::span<const KVReadInfo> reads);
  // The descriptor's reads grouped by page epoch, one engine read each.
  std::optional<TransferFuture> read_scoped(const RequestKVTransferInfo& info,
                                            std::vector<RemoteHandle>& opened,
                                            std::span<const KVReadInfo> reads);
  // The engine's descriptor of the cache, asked once (a Python engine's
  // needs the GIL).
  KVTransferInfo cache_info();

  std::shared_ptr<KVCache> kv_cache_;
  std::shared_ptr<KVTransferEngine> engine_;
  ResourceScope scope_;
  std::string owner_;  // 32 hex digits, random: names this manager's publications
  std::unique_ptr<RequestRegistry> requests_;
  std::mutex cache_info_mu_;
  std::optional<KVTransferInfo> cache_info_ MSTAR_KV_GUARDED_BY(cache_info_mu_);
  // Shared with the callbacks of futures that may outlive the manager.
  std::shared_ptr<TransferStatsRecorder> stats_;
  std::atomic<bool> stats_enabled_{true};
  mutable std::mutex served_pool_mu_;
  std::weak_ptr<KVCachePool> served_pool_ MSTAR_KV_GUARDED_BY(served_pool_mu_);
  std::atomic<bool> closed_{false};
  std::chrono::milliseconds engine_timeout_{30000};
  std::mutex streams_mu_;
  // The stream driver (streaming.cpp), made by the first stream.
  std::unique_ptr<LayerStreamer> streams_ MSTAR_KV_GUARDED_BY(streams_mu_);
  bool streams_closed_ MSTAR_KV_GUARDED_BY(streams_mu_) = false;
};

// The reads KVTransferManager::start_async_retrieve issues for tokens
// [start_len, end_len): the local table checked first (errors name its
// entries), then, where the remote layout is known, the remote table
// (check_remote_pages) and a plan between the two geometries; else as for
// one geometry. For tools and engines that plan without a manager.
std::vector<KVReadInfo> plan_retrieve(const KVLayout& local, const RemoteCache& remote,
                                      std::uint64_t start_len, std::uint64_t end_len,
                                      std::span<const std::uint32_t> local_page_indices,
                                      std::span<const std::uint32_t> remote_page_indices);

}  // namespace mstar::kv
