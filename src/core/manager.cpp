// Copyright mstar-kv authors.
#include "mstar/kv/manager.hpp"

#include "mstar/kv/planner.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

KVTransferManager::KVTransferManager(std::shared_ptr<KVCache> kv_cache,
                                     std::unique_ptr<KVTransferEngine> engine,
                                     std::chrono::milliseconds engine_timeout)
    : kv_cache_(std::move(kv_cache)), engine_(std::move(engine)) {
  if (!kv_cache_ || !engine_) {
    throw Error(StatusCode::kInvalidArgument,
                "KVTransferManager needs a KV cache and an engine");
  }
  if (engine_timeout.count() <= 0) {
    throw Error(StatusCode::kInvalidArgument,
                "KVTransferManager engine_timeout " + std::to_string(engine_timeout.count()) +
                    " ms must be > 0");
  }
  engine_timeout_ = engine_timeout;
  const std::string name = engine_->get_kv_transfer_info().engine;
  stats_ = std::make_shared<TransferStatsRecorder>(name.empty() ? "local" : name);
}

KVTransferManager::~KVTransferManager() { cleanup(); }

KVTransferInfo KVTransferManager::get_kv_transfer_info() const {
  return engine_->get_kv_transfer_info();
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices,
    const KVTransferInfo& kv_transfer_info) {
  auto issue = [&]() -> std::optional<TransferFuture> {
    return engine_->read_batched_async(
        kv_transfer_info, plan_retrieve(*engine_, kv_cache_->layout(), start_len, end_len,
                                        local_page_indices, remote_page_indices,
                                        kv_transfer_info));
  };
  if (!stats_enabled_.load(std::memory_order_relaxed)) return issue();
  return TransferStatsRecorder::track(stats_, issue);
}

std::vector<KVReadInfo> plan_retrieve(const KVTransferEngine& engine, const KVLayout& local,
                                      std::uint64_t start_len, std::uint64_t end_len,
                                      std::span<const std::uint32_t> local_page_indices,
                                      std::span<const std::uint32_t> remote_page_indices,
                                      const KVTransferInfo& remote) {
  // The caller's own table first (errors name its entries), then the
  // descriptor: its layout, when the engine can tell, lets the remote table
  // be checked entry by entry and caches of different geometry meet (page
  // sizes, head shards). An empty range is validated the same way.
  check_local_pages(local, start_len, end_len, local_page_indices);
  const std::optional<KVLayout> rl = engine.remote_layout(remote);
  if (!rl) return plan_reads(local, start_len, end_len, local_page_indices, remote_page_indices);
  check_remote_pages(local, *rl, start_len, end_len, remote_page_indices);
  return plan_reads(local, *rl, start_len, end_len, local_page_indices, remote_page_indices);
}

std::optional<TransferFuture> retrieve_shards(KVTransferEngine& engine, const KVLayout& local,
                                              std::uint64_t start_len, std::uint64_t end_len,
                                              std::span<const std::uint32_t> local_page_indices,
                                              std::span<const RemoteShard> shards) {
  if (shards.empty()) {
    throw Error(StatusCode::kInvalidArgument, "start_async_retrieve: no remote shard given");
  }
  // Which shard supplies which local heads: the first that holds each.
  struct Part {
    std::size_t shard;
    std::uint32_t lo, hi;
    std::vector<KVReadInfo> reads;
  };
  std::vector<Part> parts;
  std::vector<KVLayout> layouts;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    std::optional<KVLayout> l = engine.remote_layout(shards[i].kv_transfer_info);
    if (!l) {
      throw Error(StatusCode::kUnavailable,
                  "the " + shards[i].kv_transfer_info.engine +
                      " engine cannot describe its descriptors' layout: reads from several "
                      "shards need it");
    }
    layouts.push_back(*l);
  }
  for (std::uint32_t h = local.first_kv_head; h < local.end_kv_head();) {
    std::size_t found = shards.size();
    for (std::size_t i = 0; i < shards.size(); ++i) {
      if (layouts[i].first_kv_head <= h && h < layouts[i].end_kv_head()) {
        found = i;
        break;
      }
    }
    if (found == shards.size()) {
      std::uint32_t end = h + 1;
      while (end < local.end_kv_head()) {
        bool held = false;
        for (const KVLayout& l : layouts) held |= l.first_kv_head <= end && end < l.end_kv_head();
        if (held) break;
        ++end;
      }
      throw Error(StatusCode::kIncompatibleLayout,
                  "local KV heads [" + std::to_string(h) + ", " + std::to_string(end) + ") of " +
                      std::to_string(local.model_kv_heads()) + " are held by none of the " +
                      std::to_string(shards.size()) + " shards given");
    }
    const std::uint32_t hi = std::min(local.end_kv_head(), layouts[found].end_kv_head());
    if (!parts.empty() && parts.back().shard == found && parts.back().hi == h) {
      parts.back().hi = hi;
    } else {
      parts.push_back({found, h, hi, {}});
    }
    h = hi;
  }
  // Plan every part before issuing any.
  for (Part& p : parts) {
    p.reads = plan_reads(local, layouts[p.shard], start_len, end_len, local_page_indices,
                         shards[p.shard].page_indices, p.lo, p.hi);
  }
  if (start_len == end_len) return std::nullopt;
  std::vector<TransferFuture> issued;
    try {
      for (const Part& p : parts) {
        auto f = engine.read_batched_async(shards[p.shard].kv_transfer_info, p.reads);
        if (f) issued.push_back(std::move(*f));
      }
    } catch (...) {
      for (const TransferFuture& f : issued) f.cancel();
      for (const TransferFuture& f : issued) f.wait();
      throw;
    }
  if (issued.empty()) return std::nullopt;
  return join_futures(std::move(issued));
}

std::optional<TransferFuture> KVTransferManager::start_async_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices, std::span<const RemoteShard> shards) {
  auto issue = [&]() -> std::optional<TransferFuture> {
    return retrieve_shards(*engine_, kv_cache_->layout(), start_len, end_len, local_page_indices,
                           shards);
  };
  if (!stats_enabled_.load(std::memory_order_relaxed)) return issue();
  return TransferStatsRecorder::track(stats_, issue);
}

std::uint64_t KVTransferManager::sync_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices,
    std::span<const std::uint32_t> remote_page_indices,
    const KVTransferInfo& kv_transfer_info) {
  auto future = start_async_retrieve(start_len, end_len, local_page_indices,
                                     remote_page_indices, kv_transfer_info);
  return future ? future->get() : 0;
}

void KVTransferManager::cleanup() {
  stop_streams();  // streaming.cpp: streams resolve once nothing is in flight
  if (engine_) engine_->shutdown();
}

}  // namespace mstar::kv
