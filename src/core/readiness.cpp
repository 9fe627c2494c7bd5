// Copyright mstar-kv authors.
#include "mstar/kv/readiness.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "mstar/kv/engine.hpp"
#include "mstar/kv/epochs.hpp"
#include "mstar/kv/status.hpp"
#include "core/shared_word.hpp"

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
std::unique_ptr<LayerWatch> KVTransferEngine::watch_layers(
    const KVTransferInfo& remote_kv_info, std::span<const KVReadInfo> read_info) {
  (void)read_info;
  const std::string name = remote_kv_info.engine.empty() ? "local" : remote_kv_info.engine;
  throw Error(StatusCode::kUnavailable,
              "layer-wise streaming over the '" + name +
                  "' engine: it has no readiness channel from the owner yet (only shm has); "
                  "pull with start_async_retrieve after the owner finished");
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
  for (std::uint32_t p : pages) {
    const std::uint32_t r = load_ready(ready + p);  // p < num_pages: checked above
    if (r > num_layers) {
      return {StatusCode::kCorruptDescriptor,
              "remote page " + std::to_string(p) + " says " + std::to_string(r) +
                  " layers are ready, beyond the layout's " + std::to_string(num_layers) +
                  " layers"};
    }
    if (r < floor) {
      return {StatusCode::kCorruptDescriptor,
              "remote page " + std::to_string(p) + " readiness went backwards: " +
                  std::to_string(r) + " layers ready, " + std::to_string(floor) +
                  " were ready before"};
    }
    lowest = std::min(lowest, r);
  }
  // Epochs again (the seqlock's reader half): a value stamped by a later
  // owner of a page is only visible after that owner's new epoch.
  s = check_page_epochs(epochs, num_pages, pages, expect_epoch,
                        "while its readiness was read", true);
  if (!s.is_ok()) return s;
  *layers_ready = pages.empty() ? num_layers : lowest;
  return Status::ok();
}

}  // namespace mstar::kv
