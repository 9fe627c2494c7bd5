// Copyright mstar-kv authors.
#include "mstar/kv/pool.hpp"

#include <algorithm>
#include <random>
#include <string>

#include "mstar/kv/status.hpp"

namespace mstar::kv {

KVCachePool::KVCachePool(std::shared_ptr<KVCache> cache,
                         KVTransferInfo descriptor, std::uint64_t scatter_seed)
    : cache_(std::move(cache)), descriptor_(std::move(descriptor)) {
  if (!cache_) throw Error(StatusCode::kInvalidArgument, "KVCachePool needs a cache");
  const std::uint32_t n = cache_->layout().num_pages;
  free_.resize(n);
  // back() is handed out first: store descending so pages go out ascending.
  for (std::uint32_t i = 0; i < n; ++i) free_[i] = n - 1 - i;
  if (scatter_seed != 0) {
    std::mt19937_64 rng(scatter_seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
  in_use_.assign(n, 0);
}

std::vector<std::uint32_t> KVCachePool::allocate_locked(std::size_t count) {
  if (count > free_.size()) {
    throw Error(StatusCode::kRetryLater,
                "KV cache pool exhausted: need " + std::to_string(count) +
                    " pages, " + std::to_string(free_.size()) + " free of " +
                    std::to_string(cache_->layout().num_pages));
  }
  std::vector<std::uint32_t> pages(free_.end() - static_cast<std::ptrdiff_t>(count),
                                   free_.end());
  std::reverse(pages.begin(), pages.end());
  free_.resize(free_.size() - count);
  for (std::uint32_t p : pages) in_use_[p] = 1;
  return pages;
}

void KVCachePool::free_locked(std::span<const std::uint32_t> pages) {
  // Check everything first so that a bad call changes nothing. Pages being
  // freed are marked 2, which also catches a page named twice in one call.
  const std::uint32_t n = cache_->layout().num_pages;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const std::uint32_t p = pages[i];
    if (p >= n || in_use_[p] != 1) {
      for (std::size_t j = 0; j < i; ++j) in_use_[pages[j]] = 1;
      if (p >= n) {
        throw Error(StatusCode::kInvalidArgument,
                    "free of page " + std::to_string(p) + " out of range [0, " +
                        std::to_string(n) + ")");
      }
      throw Error(StatusCode::kInvalidArgument,
                  "double free of page " + std::to_string(p));
    }
    in_use_[p] = 2;
  }
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    in_use_[*it] = 0;
    free_.push_back(*it);
  }
}

std::vector<std::uint32_t> KVCachePool::allocate(std::uint64_t seq_id,
                                                 std::uint64_t num_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (sequences_.count(seq_id) != 0) {
    throw Error(StatusCode::kInvalidArgument,
                "sequence " + std::to_string(seq_id) + " is already allocated");
  }
  const std::uint64_t ps = cache_->layout().page_size;
  const std::uint64_t count = (num_tokens + ps - 1) / ps;
  auto pages = allocate_locked(static_cast<std::size_t>(count));
  sequences_[seq_id] = Sequence{num_tokens, pages};
  return pages;
}

void KVCachePool::release(std::uint64_t seq_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw Error(StatusCode::kInvalidArgument,
                "release of unknown sequence " + std::to_string(seq_id) +
                    " (never allocated or already released)");
  }
  free_locked(it->second.pages);
  sequences_.erase(it);
}

bool KVCachePool::contains(std::uint64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return sequences_.count(seq_id) != 0;
}

std::vector<std::uint32_t> KVCachePool::pages(std::uint64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw Error(StatusCode::kNotFound, "unknown sequence " + std::to_string(seq_id));
  }
  return it->second.pages;
}

std::vector<std::uint32_t> KVCachePool::allocate_pages(std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  return allocate_locked(count);
}

void KVCachePool::free_pages(std::span<const std::uint32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  free_locked(pages);
}

std::size_t KVCachePool::free_page_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

SequenceInfo KVCachePool::publish(std::uint64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw Error(StatusCode::kNotFound,
                "publish of unknown sequence " + std::to_string(seq_id));
  }
  return SequenceInfo{seq_id, it->second.num_tokens, it->second.pages, descriptor_};
}

}  // namespace mstar::kv
