// Copyright mstar-kv authors.
#include "mstar/kv/core/readiness.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "core/mapped_watch.hpp"
#include "core/shared_word.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/util/status.hpp"

#include <chrono>
#include <utility>

namespace mstar::kv {

namespace {

// As load_word in epochs.cpp: the words may be a PROT_READ mapping of the
// owner's table; an atomic load of an aligned word never writes.
std::uint32_t load_ready(const std::uint32_t* w) noexcept { return internal::load_acquire(w); }

}  // namespace

void PageReadiness::stamp(std::span<const std::uint32_t> pages,
                          std::uint32_t layers) const noexcept {
  if (words_ == nullptr) return;
  for (std::uint32_t p : pages) {
    if (p < num_pages_) {
      internal::store_release(words_ + p, layers);
    }
  }
}

void PageReadiness::reset(std::span<const std::uint32_t> pages) const noexcept {
  if (words_ == nullptr) return;
  for (std::uint32_t p : pages) {
    if (p < num_pages_) {
      internal::store_relaxed(words_ + p, std::uint32_t{0});
    }
  }
  // Orders the zeroes before the epoch stamps that follow (PageEpochs::stamp
  // stores relaxed): a reader's acquire load of the new epoch sees them.
  std::atomic_thread_fence(std::memory_order_release);
}

std::uint32_t PageReadiness::load(std::uint32_t page) const noexcept {
  if (words_ == nullptr || page >= num_pages_) return 0;
  return load_ready(words_ + page);
}

// Here, not in streaming.cpp: the engines' vtable needs it, and an engine
// need not link the stream driver.
Status check_readiness_word(std::uint32_t page, std::uint32_t word, std::uint32_t num_layers,
                            std::uint32_t floor) {
  if (word > num_layers) {
    return {StatusCode::kCorruptDescriptor,
            "remote page " + std::to_string(page) + " says " + std::to_string(word) +
                " layers are ready, beyond the layout's " + std::to_string(num_layers) + " layers"};
  }
  if (word < floor) {
    return {StatusCode::kCorruptDescriptor,
            "remote page " + std::to_string(page) +
                " readiness went backwards: " + std::to_string(word) + " layers ready, " +
                std::to_string(floor) + " were ready before"};
  }
  return Status::ok();
}

Status check_layer_readiness(const std::uint32_t* ready, const std::uint64_t* epochs,
                             std::uint32_t num_pages, std::span<const std::uint32_t> pages,
                             std::uint64_t expect_epoch, std::uint32_t num_layers,
                             std::uint32_t floor, std::uint32_t* layers_ready) {
  // Epochs first: seeing the sequence's epoch (acquire) means the pool's
  // reset of these words is visible, so no earlier owner's value is read.
  Status s = check_page_epochs(epochs, num_pages, pages, expect_epoch,
                               "before its readiness was read", false);
  if (!s.is_ok()) return s;
  if (ready == nullptr) {
    return {StatusCode::kCorruptDescriptor, "the owner's cache has no readiness table"};
  }
  std::uint32_t lowest = std::numeric_limits<std::uint32_t>::max();
  Status odd = Status::ok();  // judged only once the epochs after are checked
  for (std::uint32_t p : pages) {
    const std::uint32_t r = load_ready(ready + p);  // p < num_pages: checked above
    if (odd.is_ok()) odd = check_readiness_word(p, r, num_layers, floor);
    lowest = std::min(lowest, r);
  }
  // Epochs again (the seqlock's reader half): a value stamped by a later
  // owner of a page is only visible after that owner's new epoch, and a word
  // read while a page changed owner (its readiness reset under the old
  // epoch) is stale, not corrupt.
  s = check_page_epochs(epochs, num_pages, pages, expect_epoch, "while its readiness was read",
                        true);
  if (!s.is_ok()) return s;
  if (!odd.is_ok()) return odd;
  *layers_ready = pages.empty() ? num_layers : lowest;
  return Status::ok();
}

}  // namespace mstar::kv

namespace mstar::kv {

namespace {

class MappedLayerWatch final : public LayerWatch {
 public:
  MappedLayerWatch(const std::uint32_t* ready, const std::uint64_t* epochs, std::uint32_t num_pages,
                   std::uint32_t num_layers, std::vector<std::uint32_t> pages, std::uint64_t epoch,
                   std::function<Status()> check_owner, std::shared_ptr<const void> keep)
      : ready_(ready),
        epochs_(epochs),
        num_pages_(num_pages),
        num_layers_(num_layers),
        pages_(std::move(pages)),
        epoch_(epoch),
        check_owner_(std::move(check_owner)),
        keep_(std::move(keep)) {}

  Status poll(std::uint32_t* layers_ready) override {
    std::uint32_t r = 0;
    Status s =
        check_layer_readiness(ready_, epochs_, num_pages_, pages_, epoch_, num_layers_, floor_, &r);
    if (!s.is_ok()) return s;
    floor_ = r;
    // Layers still missing: an owner that died will never mark them.
    if (r < num_layers_ && check_owner_) {
      const auto now = std::chrono::steady_clock::now();
      if (now >= next_owner_check_) {
        next_owner_check_ = now + std::chrono::milliseconds(1);
        Status alive = check_owner_();
        if (!alive.is_ok()) {
          return {alive.code(), alive.message() + " with " + std::to_string(r) + " of " +
                                    std::to_string(num_layers_) + " layers marked ready"};
        }
      }
    }
    *layers_ready = r;
    return Status::ok();
  }

 private:
  const std::uint32_t* ready_;
  const std::uint64_t* epochs_;
  std::uint32_t num_pages_;
  std::uint32_t num_layers_;
  std::vector<std::uint32_t> pages_;
  std::uint64_t epoch_;
  std::function<Status()> check_owner_;
  std::shared_ptr<const void> keep_;
  std::uint32_t floor_ = 0;
  std::chrono::steady_clock::time_point next_owner_check_{};
};

}  // namespace

std::unique_ptr<LayerWatch> make_mapped_layer_watch(
    const std::uint32_t* ready, const std::uint64_t* epochs, std::uint32_t num_pages,
    std::uint32_t num_layers, std::vector<std::uint32_t> pages, std::uint64_t epoch,
    std::function<Status()> check_owner, std::shared_ptr<const void> keep) {
  return std::make_unique<MappedLayerWatch>(ready, epochs, num_pages, num_layers, std::move(pages),
                                            epoch, std::move(check_owner), std::move(keep));
}

}  // namespace mstar::kv
