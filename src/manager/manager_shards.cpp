// Copyright mstar-kv authors.
//
// KVTransferManager's shard form: one pull assembled from several peers
// that each hold some of the local cache's heads (tensor-parallel merges).
#include <string>
#include <vector>

#include "manager/issue_reads.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

std::optional<TransferFuture> KVTransferManager::start_async_retrieve(
    std::uint64_t start_len, std::uint64_t end_len,
    std::span<const std::uint32_t> local_page_indices, std::span<const RemoteShard> shards) {
  check_open("start_async_retrieve");
  if (shards.empty()) {
    throw Error(StatusCode::kInvalidArgument, "start_async_retrieve: no remote shard given");
  }
  const KVLayout& local = kv_cache_->layout();
  return tracked([&]() -> std::optional<TransferFuture> {
    // Which shard supplies which local heads: the first that holds each.
    struct Part {
      std::size_t shard;
      std::uint32_t lo, hi;
      std::vector<KVReadInfo> reads;
    };
    std::vector<RemoteHandle> remotes;
    std::vector<KVLayout> layouts;
    for (const RemoteShard& shard : shards) {
      // Without its page_epochs, if any: read_shared reads those pages.
      const KVTransferInfo& info = shard.kv_transfer_info;
      RemoteHandle r =
          engine_->open_remote(info.page_epochs.empty() ? info : info.with_epoch(info.epoch));
      if (!r->layout()) {
        throw Error(StatusCode::kNotSupported,
                    "the " + r->info().engine +
                        " engine cannot describe its descriptors' layout: reads from several "
                        "shards need it");
      }
      layouts.push_back(*r->layout());
      remotes.push_back(std::move(r));
    }
    std::vector<Part> parts;
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
    return issue_joined([&](std::vector<TransferFuture>& issued) {
      for (const Part& p : parts) {
        auto f = read_shared(shards[p.shard].kv_transfer_info, remotes[p.shard], p.reads);
        if (f) issued.push_back(std::move(*f));
      }
    });
  });
}

}  // namespace mstar::kv
