// Copyright mstar-kv authors.
//
// KVCachePool: page allocation per sequence over one KVCache, and publish().
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/descriptor.hpp"

namespace mstar::kv {

// Thread safety: every method is safe from any thread (one internal mutex).
// Errors: exhaustion throws Error(kRetryLater); unknown sequences, double
// allocation of a sequence and double frees throw Error(kInvalidArgument).
class KVCachePool {
 public:
  // `descriptor` (usually KVTransferManager::get_kv_transfer_info()) is
  // stamped onto every published SequenceInfo. With scatter_seed != 0 the
  // free list is shuffled deterministically, so sequences get scattered
  // pages as they do in a long-running engine; with 0 pages are handed out
  // in ascending order.
  KVCachePool(std::shared_ptr<KVCache> cache, KVTransferInfo descriptor,
              std::uint64_t scatter_seed = 0);

  const KVCache& cache() const noexcept { return *cache_; }
  std::shared_ptr<KVCache> shared_cache() const noexcept { return cache_; }

  // Pages for a new sequence of num_tokens tokens: ceil(num_tokens/page_size).
  std::vector<std::uint32_t> allocate(std::uint64_t seq_id,
                                      std::uint64_t num_tokens);
  // Frees every page of the sequence.
  void release(std::uint64_t seq_id);
  bool contains(std::uint64_t seq_id) const;
  std::vector<std::uint32_t> pages(std::uint64_t seq_id) const;

  // Low level: pages not tied to a sequence id.
  std::vector<std::uint32_t> allocate_pages(std::size_t count);
  void free_pages(std::span<const std::uint32_t> pages);

  std::size_t free_page_count() const;

  // The SequenceInfo another process needs to pull this sequence.
  SequenceInfo publish(std::uint64_t seq_id) const;

 private:
  struct Sequence {
    std::uint64_t num_tokens = 0;
    std::vector<std::uint32_t> pages;
  };
  std::vector<std::uint32_t> allocate_locked(std::size_t count);
  void free_locked(std::span<const std::uint32_t> pages);

  std::shared_ptr<KVCache> cache_;
  KVTransferInfo descriptor_;
  mutable std::mutex mu_;
  std::vector<std::uint32_t> free_;     // guarded by mu_; back() is next
  std::vector<std::uint8_t> in_use_;    // guarded by mu_; one flag per page
  std::unordered_map<std::uint64_t, Sequence> sequences_;  // guarded by mu_
};

}  // namespace mstar::kv
