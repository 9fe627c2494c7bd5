// Copyright mstar-kv authors.
#include "mstar/kv/core/pool.hpp"

#include <algorithm>
#include <random>
#include <string>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

constexpr std::size_t kMaxRememberedExpired = 4096;

std::uint64_t unix_ms_now() {
  return static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                        std::chrono::system_clock::now().time_since_epoch())
                                        .count());
}

// Pages that hold `num_tokens` tokens of `page_size`. Not (n + ps - 1) / ps:
// that wraps for a num_tokens near 2^64 (a Python -1) and gave 0 pages.
std::uint64_t pages_for(std::uint64_t num_tokens, std::uint64_t page_size) {
  return num_tokens / page_size + (num_tokens % page_size != 0 ? 1 : 0);
}

}  // namespace

KVCachePool::KVCachePool(std::shared_ptr<KVCache> cache, KVTransferInfo descriptor,
                         std::uint64_t scatter_seed, std::chrono::milliseconds lease)
    : cache_(std::move(cache)),
      descriptor_(std::move(descriptor)),
      lease_(lease),
      next_epoch_(random_first_epoch()) {
  if (!cache_) throw Error(StatusCode::kInvalidArgument, "KVCachePool needs a cache");
  if (lease_.count() < 0) {
    throw Error(StatusCode::kInvalidArgument, "KVCachePool lease " +
                                                  std::to_string(lease_.count()) +
                                                  " ms must be >= 0 (0 = never expire)");
  }
  descriptor_.epoch = 0;
  descriptor_.page_epochs.clear();
  const std::uint32_t n = cache_->layout().num_pages;
  free_.resize(n);
  // back() is handed out first: store descending so pages go out ascending.
  for (std::uint32_t i = 0; i < n; ++i) free_[i] = n - 1 - i;
  if (scatter_seed != 0) {
    std::mt19937_64 rng(scatter_seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
  in_use_.assign(n, 0);
  holders_.assign(n, 0);
}

std::vector<std::uint32_t> KVCachePool::allocate_locked(std::size_t count) {
  if (count > free_.size()) {
    throw Error(StatusCode::kRetryLater, "KV cache pool exhausted: need " + std::to_string(count) +
                                             " pages, " + std::to_string(free_.size()) +
                                             " free of " +
                                             std::to_string(cache_->layout().num_pages));
  }
  std::vector<std::uint32_t> pages(free_.end() - static_cast<std::ptrdiff_t>(count), free_.end());
  std::reverse(pages.begin(), pages.end());
  free_.resize(free_.size() - count);
  for (std::uint32_t p : pages) in_use_[p] = kLoose;
  // No layer of a new owner is ready; the reset is ordered before the epoch.
  cache_->readiness().reset(pages);
  cache_->epochs().stamp(pages, next_epoch_++);
  stamped_any_ = true;
  return pages;
}

void KVCachePool::free_locked(std::span<const std::uint32_t> pages, std::uint8_t owner) {
  // Check everything first so that a bad call changes nothing. Pages being
  // freed are marked kFreeing, which also catches a page named twice in one
  // call. `owner` is the mark the pages must carry: kLoose for free_pages
  // (allocate_pages), kOwned for release (a sequence's pages), so that
  // free_pages of a page a live sequence holds is refused instead of handing
  // it to a second sequence.
  const std::uint32_t n = cache_->layout().num_pages;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const std::uint32_t p = pages[i];
    if (p >= n || in_use_[p] != owner) {
      for (std::size_t j = 0; j < i; ++j) in_use_[pages[j]] = owner;
      if (p >= n) {
        throw Error(
            StatusCode::kInvalidArgument,
            "free of page " + std::to_string(p) + " out of range [0, " + std::to_string(n) + ")");
      }
      if (in_use_[p] == kOwned) {
        std::string holder = "a live sequence";
        for (const auto& [id, seq] : sequences_) {
          if (std::find(seq.pages.begin(), seq.pages.end(), p) != seq.pages.end()) {
            holder = "sequence " + std::to_string(id);
            break;
          }
        }
        throw Error(StatusCode::kInvalidArgument, "free_pages of page " + std::to_string(p) +
                                                      ", which " + holder +
                                                      " holds (release the sequence instead)");
      }
      throw Error(StatusCode::kInvalidArgument, "double free of page " + std::to_string(p));
    }
    in_use_[p] = kFreeing;
  }
  // Free pages carry epoch 0: a reader still holding them now fails.
  cache_->epochs().stamp(pages, 0);
  for (auto it = pages.rbegin(); it != pages.rend(); ++it) {
    in_use_[*it] = kFree;
    holders_[*it] = 0;
    free_.push_back(*it);
  }
}

void KVCachePool::drop_locked(const Sequence& s) {
  // A sequence's pages are kOwned with a hold of its own each (adopt and
  // allocate never give a sequence a page twice), so nothing here can fail.
  std::vector<std::uint32_t> unheld;
  unheld.reserve(s.pages.size());
  for (const std::uint32_t p : s.pages) {
    if (--holders_[p] == 0) unheld.push_back(p);
  }
  // Only pages no sequence holds any more change epoch: the others' content
  // is still what their remaining holders published.
  free_locked(unheld, kOwned);
}

std::vector<std::uint32_t> KVCachePool::allocate(std::uint64_t seq_id, std::uint64_t num_tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(Clock::now());
  if (sequences_.count(seq_id) != 0) {
    throw Error(StatusCode::kInvalidArgument,
                "sequence " + std::to_string(seq_id) + " is already allocated");
  }
  const std::uint64_t ps = cache_->layout().page_size;
  const std::uint64_t num_pages = cache_->layout().num_pages;
  const std::uint64_t count = pages_for(num_tokens, ps);
  if (count > num_pages) {
    throw Error(StatusCode::kInvalidArgument,
                "sequence " + std::to_string(seq_id) + " of " + std::to_string(num_tokens) +
                    " tokens needs " + std::to_string(count) + " pages, more than the " +
                    std::to_string(num_pages) + " pages (" + std::to_string(num_pages * ps) +
                    " tokens) of the whole cache");
  }
  const std::uint64_t epoch = next_epoch_;  // allocate_locked stamps it
  auto pages = allocate_locked(static_cast<std::size_t>(count));
  for (std::uint32_t p : pages) {
    in_use_[p] = kOwned;
    holders_[p] = 1;
  }
  Sequence s;
  s.num_tokens = num_tokens;
  s.pages = pages;
  s.epoch = epoch;
  sequences_[seq_id] = std::move(s);
  expired_ids_.erase(seq_id);
  return pages;
}

void KVCachePool::adopt(std::uint64_t seq_id, std::uint64_t num_tokens,
                        std::span<const std::uint32_t> pages, bool allow_shared,
                        std::uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(Clock::now());
  if (sequences_.count(seq_id) != 0) {
    throw Error(StatusCode::kInvalidArgument,
                "sequence " + std::to_string(seq_id) + " is already allocated");
  }
  // An epoch is never stamped twice by one pool: a reader still holding a
  // freed page's old epoch must fail, whoever holds the page now.
  if (epoch != 0 && ((stamped_any_ && epoch < next_epoch_) || epoch == ~std::uint64_t{0})) {
    throw Error(StatusCode::kInvalidArgument,
                "adopt of sequence " + std::to_string(seq_id) + ": epoch " + std::to_string(epoch) +
                    " is below " + std::to_string(next_epoch_) +
                    ", above every epoch this pool stamped (an epoch is never reused)");
  }
  const std::uint64_t ps = cache_->layout().page_size;
  const std::uint64_t count = pages_for(num_tokens, ps);
  if (count != pages.size()) {
    throw Error(StatusCode::kInvalidArgument,
                "adopt of sequence " + std::to_string(seq_id) + ": " + std::to_string(num_tokens) +
                    " tokens need " + std::to_string(count) + " pages of " + std::to_string(ps) +
                    " tokens, " + std::to_string(pages.size()) + " given");
  }
  const std::uint32_t n = cache_->layout().num_pages;
  // Check everything first (kFreeing marks a free page seen in this call,
  // kSharing a held one), then undo the marks when one is refused, so that
  // a refused call changes nothing.
  std::size_t fresh_count = 0;
  for (std::size_t i = 0; i < pages.size(); ++i) {
    const std::uint32_t p = pages[i];
    const std::uint8_t mark = p < n ? in_use_[p] : kFree;
    const bool shares = mark == kOwned && allow_shared;
    if (p >= n || (mark != kFree && !shares)) {
      for (std::size_t j = 0; j < i; ++j) {
        in_use_[pages[j]] = in_use_[pages[j]] == kSharing ? kOwned : kFree;
      }
      const std::string what =
          "adopt of sequence " + std::to_string(seq_id) + ": page " + std::to_string(p);
      if (p >= n) {
        throw Error(StatusCode::kInvalidArgument,
                    what + " out of range [0, " + std::to_string(n) + ")");
      }
      throw Error(StatusCode::kInvalidArgument,
                  what + (mark == kFreeing || mark == kSharing ? " is named twice"
                          : mark == kOwned ? " is held by a live sequence (allow_shared shares it)"
                                           : " is held (allocate_pages)"));
    }
    in_use_[p] = shares ? kSharing : kFreeing;
    if (!shares) ++fresh_count;
  }
  // Off the free list, order kept (a loop, not erase_if: the thread-safety
  // analysis cannot see that a lambda runs under mu_).
  if (fresh_count > 0) {
    std::size_t kept = 0;
    for (const std::uint32_t p : free_) {
      if (in_use_[p] != kFreeing) free_[kept++] = p;
    }
    free_.resize(kept);
  }
  if (epoch == 0) epoch = next_epoch_;
  next_epoch_ = epoch + 1;
  stamped_any_ = true;
  Sequence s;
  s.num_tokens = num_tokens;
  s.pages.assign(pages.begin(), pages.end());
  s.epoch = epoch;
  std::vector<std::uint32_t> fresh;
  fresh.reserve(fresh_count);
  for (const std::uint32_t p : pages) {
    if (in_use_[p] == kSharing) {
      // Its epoch names the content an earlier holder published; it stays.
      s.shared.push_back({p, cache_->epochs().load(p)});
    } else {
      fresh.push_back(p);
    }
    in_use_[p] = kOwned;
    ++holders_[p];
  }
  std::sort(s.shared.begin(), s.shared.end(),
            [](const PageEpoch& a, const PageEpoch& b) { return a.page < b.page; });
  // No layer of a new owner is ready; the reset is ordered before the epoch.
  // Shared pages keep theirs: their layers were written and stay so.
  cache_->readiness().reset(fresh);
  cache_->epochs().stamp(fresh, epoch);
  sequences_[seq_id] = std::move(s);
  expired_ids_.erase(seq_id);
}

void KVCachePool::release(std::uint64_t seq_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    if (expired_ids_.erase(seq_id) != 0) return;  // its lease expired: freed already
    throw Error(StatusCode::kInvalidArgument, "release of unknown sequence " +
                                                  std::to_string(seq_id) +
                                                  " (never allocated or already released)");
  }
  drop_locked(it->second);
  sequences_.erase(it);
}

bool KVCachePool::done(std::uint64_t seq_id, std::uint64_t epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  ++done_notices_;
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end() || (epoch != 0 && it->second.epoch != epoch)) return false;
  drop_locked(it->second);
  sequences_.erase(it);
  return true;
}

std::size_t KVCachePool::expire_locked(Clock::time_point now) {
  if (now < next_expiry_) return 0;
  std::size_t n = 0;
  next_expiry_ = Clock::time_point::max();
  for (auto it = sequences_.begin(); it != sequences_.end();) {
    const Sequence& s = it->second;
    if (s.leased && s.expiry <= now) {
      drop_locked(s);
      if (expired_ids_.size() >= kMaxRememberedExpired) expired_ids_.clear();
      expired_ids_.insert(it->first);
      it = sequences_.erase(it);
      ++n;
    } else {
      if (s.leased) next_expiry_ = std::min(next_expiry_, s.expiry);
      ++it;
    }
  }
  expired_ += n;
  return n;
}

std::size_t KVCachePool::expire_leases() {
  std::lock_guard<std::mutex> lock(mu_);
  return expire_locked(Clock::now());
}

std::uint64_t KVCachePool::expired_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return expired_;
}

std::uint64_t KVCachePool::published_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return published_;
}

std::uint64_t KVCachePool::done_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_notices_;
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

std::uint32_t KVCachePool::holders(std::uint32_t page) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (page >= holders_.size()) {
    throw Error(StatusCode::kInvalidArgument, "holders of page " + std::to_string(page) +
                                                  " out of range [0, " +
                                                  std::to_string(holders_.size()) + ")");
  }
  return holders_[page];
}

std::vector<std::uint32_t> KVCachePool::allocate_pages(std::size_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  expire_locked(Clock::now());
  return allocate_locked(count);
}

void KVCachePool::free_pages(std::span<const std::uint32_t> pages) {
  std::lock_guard<std::mutex> lock(mu_);
  free_locked(pages, kLoose);
}

std::size_t KVCachePool::free_page_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

SequenceInfo KVCachePool::publish(std::uint64_t seq_id) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint32_t all = cache_->layout().num_layers;
  return publish_locked(seq_id, &all);
}

SequenceInfo KVCachePool::publish(std::uint64_t seq_id, std::uint32_t layers_ready) {
  std::lock_guard<std::mutex> lock(mu_);
  return publish_locked(seq_id, &layers_ready);
}

void KVCachePool::mark_locked(std::uint64_t seq_id, Sequence& s, std::uint32_t layers_done) {
  const std::uint32_t num_layers = cache_->layout().num_layers;
  if (layers_done > num_layers) {
    throw Error(StatusCode::kInvalidArgument,
                "mark_layers_ready of sequence " + std::to_string(seq_id) + ": " +
                    std::to_string(layers_done) + " layers ready is beyond the layout's " +
                    std::to_string(num_layers) + " layers");
  }
  if (layers_done < s.layers_ready) {
    throw Error(StatusCode::kInvalidArgument,
                "mark_layers_ready of sequence " + std::to_string(seq_id) + ": " +
                    std::to_string(layers_done) + " layers ready would go backwards from " +
                    std::to_string(s.layers_ready) + " already marked");
  }
  if (layers_done == s.layers_ready) return;
  s.layers_ready = layers_done;
  // Raise only: a page shared with a holder that marked further keeps its
  // count (a reader of that holder must never see a layer go unready).
  std::vector<std::uint32_t> lower;
  lower.reserve(s.pages.size());
  for (const std::uint32_t p : s.pages) {
    if (cache_->readiness().load(p) < layers_done) lower.push_back(p);
  }
  cache_->readiness().stamp(lower, layers_done);
}

void KVCachePool::mark_layers_ready(std::uint64_t seq_id, std::uint32_t layers_done) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw Error(StatusCode::kNotFound,
                "mark_layers_ready of unknown sequence " + std::to_string(seq_id) +
                    (expired_ids_.count(seq_id) != 0 ? " (its lease expired)" : ""));
  }
  mark_locked(seq_id, it->second, layers_done);
}

std::uint32_t KVCachePool::layers_ready(std::uint64_t seq_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw Error(StatusCode::kNotFound, "unknown sequence " + std::to_string(seq_id));
  }
  return it->second.layers_ready;
}

SequenceInfo KVCachePool::publish_locked(std::uint64_t seq_id, const std::uint32_t* layers_ready) {
  const auto now = Clock::now();
  expire_locked(now);
  auto it = sequences_.find(seq_id);
  if (it == sequences_.end()) {
    throw Error(StatusCode::kNotFound,
                "publish of unknown sequence " + std::to_string(seq_id) +
                    (expired_ids_.count(seq_id) != 0 ? " (its lease expired)" : ""));
  }
  Sequence& s = it->second;
  if (layers_ready != nullptr) mark_locked(seq_id, s, *layers_ready);
  if (!s.leased && lease_.count() > 0) {
    s.leased = true;
    s.expiry = now + lease_;
    s.expiry_unix_ms = unix_ms_now() + static_cast<std::uint64_t>(lease_.count());
    next_expiry_ = std::min(next_expiry_, s.expiry);
  }
  SequenceInfo info{seq_id,      s.num_tokens,     s.pages,
                    descriptor_, s.expiry_unix_ms, cache_->layout().page_size};
  ++published_;
  if (!info.kv_transfer_info.empty()) {
    info.kv_transfer_info.epoch = s.epoch;
    info.kv_transfer_info.page_epochs = s.shared;
  }
  return info;
}

}  // namespace mstar::kv
