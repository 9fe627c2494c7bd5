// Copyright mstar-kv authors.
//
// KVTransferManager: picks the engine, runs plan -> engine, cleans up.
#pragma once

#include <atomic>
#include <chrono>
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
#include "mstar/kv/engine_options.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/log.hpp"
#include "mstar/kv/stats.hpp"
#include "mstar/kv/streaming.hpp"
#include "mstar/kv/thread_annotations.hpp"
#include <mutex>

namespace mstar::kv {

class KVCachePool;

// Thread safety: every method is safe from any thread; concurrent retrieves
// into disjoint local pages are supported. cleanup() shuts the engine down
// (in-flight futures resolve with kShutdown); it is idempotent and run by the
// destructor.
// One peer of a read assembled from several: a tensor-parallel merge,
// e.g. a TP=1 decode cache pulling heads 0-3 from prefill rank 0 and 4-7
// from rank 1.
struct RemoteShard {
  std::vector<std::uint32_t> page_indices;  // in that peer's page size
  KVTransferInfo kv_transfer_info;
};

// What KVTransferManager::start_async_retrieve does, for callers that hold
// an engine rather than a manager (the Python package): plans the reads of
// tokens [start_len, end_len) against the remote layout when the engine can
// describe it (KVTransferEngine::remote_layout), else as for one geometry.
std::vector<KVReadInfo> plan_retrieve(const KVTransferEngine& engine, const KVLayout& local,
                                      std::uint64_t start_len, std::uint64_t end_len,
                                      std::span<const std::uint32_t> local_page_indices,
                                      std::span<const std::uint32_t> remote_page_indices,
                                      const KVTransferInfo& remote);
// The shard form (see KVTransferManager): plans every shard, then issues.
std::optional<TransferFuture> retrieve_shards(KVTransferEngine& engine, const KVLayout& local,
                                              std::uint64_t start_len, std::uint64_t end_len,
                                              std::span<const std::uint32_t> local_page_indices,
                                              std::span<const RemoteShard> shards);

class KVTransferManager {
 public:
  // With the engine make_engine() creates from the info (factory.hpp; this
  // constructor is defined beside the factory, in the mstar::kv library,
  // not in the core).
  KVTransferManager(std::optional<TransferEngineInfo> transfer_engine_info,
                    std::shared_ptr<KVCache> kv_cache);
  // Around an engine built elsewhere (e.g. wrapped by a fault injector);
  // needs nothing beyond the core. `engine_timeout` is that engine's read
  // timeout (EngineOptions::timeout), which the manager cannot ask it for:
  // streams default their ready_timeout to it (streaming.hpp).
  KVTransferManager(std::shared_ptr<KVCache> kv_cache,
                    std::unique_ptr<KVTransferEngine> engine,
                    std::chrono::milliseconds engine_timeout = std::chrono::milliseconds{30000});
  ~KVTransferManager();

  KVTransferManager(const KVTransferManager&) = delete;
  KVTransferManager& operator=(const KVTransferManager&) = delete;

  // Descriptor another process needs to read this cache remotely.
  // KVCachePool::publish stamps it onto every SequenceInfo.
  KVTransferInfo get_kv_transfer_info() const;

  // Pulls tokens [start_len, end_len) of a remote sequence (skip a cached
  // prefix by raising start_len). Validates everything first and throws
  // Error before any byte moves: the range and the page tables (plan_reads;
  // the remote table against the descriptor's layout, check_remote_pages,
  // where the engine can tell it), errors naming the table entry and page,
  // then the descriptor (the engine: engine name, format, layout
  // compatibility). An empty range (start_len == end_len) is validated the
  // same way, the descriptor included, then returns std::nullopt.
  // The remote cache may differ in geometry (layout.hpp, planner.hpp): page
  // size (remote_page_indices in its own page size), head shard (it must
  // hold every head of the local cache; else use the shard form below),
  // in-page and cache order.
  std::optional<TransferFuture> start_async_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices,
      const KVTransferInfo& kv_transfer_info);

  using RemoteShard = kv::RemoteShard;
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

  // Same, then waits; returns the bytes read or throws Error.
  std::uint64_t sync_retrieve(std::uint64_t start_len, std::uint64_t end_len,
                              std::span<const std::uint32_t> local_page_indices,
                              std::span<const std::uint32_t> remote_page_indices,
                              const KVTransferInfo& kv_transfer_info);

  // Layer-wise streaming (streaming.hpp): the same pull as
  // start_async_retrieve, issued layer by layer as the owner marks layers
  // ready (KVCachePool::mark_layers_ready). Validates everything first and
  // throws Error before any byte moves: the errors of start_async_retrieve,
  // Error(kUnavailable) naming the engine when it has no readiness channel
  // (local), Error(kInvalidArgument) for a descriptor
  // without a page epoch (not published by a KVCachePool) or options out of
  // range. std::nullopt when start_len == end_len. The stream's errors
  // (kTimeout for a layer never marked, kStaleDescriptor,
  // kCorruptDescriptor, the owner's death, a layer's read failing) travel
  // in its future and wait_for_layer.
  std::optional<LayerStream> start_streaming_retrieve(
      std::uint64_t start_len, std::uint64_t end_len,
      std::span<const std::uint32_t> local_page_indices,
      std::span<const std::uint32_t> remote_page_indices,
      const KVTransferInfo& kv_transfer_info, StreamOptions options = {});

  void cleanup();

  // Done notices (leases, pool.hpp). Reader side: tells the owner of `seq`
  // that this reader is done with it, over the engine's own channel (UCX:
  // an active message), so that the owner frees it before its lease
  // expires. Throws Error(kUnavailable) for engines without such a channel
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
  // are still counted.
  TransferStats stats() const { return stats_->snapshot(); }
  // Stops (or resumes) recording; for measuring what recording costs.
  void set_stats_enabled(bool enabled) noexcept {
    stats_enabled_.store(enabled, std::memory_order_relaxed);
  }

  KVTransferEngine& engine() noexcept { return *engine_; }
  const KVCache& kv_cache() const noexcept { return *kv_cache_; }

 private:
  std::shared_ptr<KVCache> kv_cache_;
  std::unique_ptr<KVTransferEngine> engine_;
  // Shared with the callbacks of futures that may outlive the manager.
  std::shared_ptr<TransferStatsRecorder> stats_;
  std::atomic<bool> stats_enabled_{true};
  // The stream driver (streaming.cpp), made by the first stream.
  std::chrono::milliseconds engine_timeout_{30000};
  std::mutex streams_mu_;
  std::unique_ptr<LayerStreamer> streams_ MSTAR_KV_GUARDED_BY(streams_mu_);
  bool streams_closed_ MSTAR_KV_GUARDED_BY(streams_mu_) = false;
  void stop_streams() noexcept;
};

}  // namespace mstar::kv
