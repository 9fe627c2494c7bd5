// Copyright mstar-kv authors.
//
// Layer readiness: how far the owner has written a sequence, layer by layer,
// so that a reader can pull layer L while the owner still computes L + 1
// (layer-wise streaming; the reader's half is streaming.hpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

// Every page of a cache has a 32-bit readiness word next to its epoch word
// (epochs.hpp): "layers [0, n) of this page hold their final bytes". The
// KVCachePool writes it: allocate() resets it to 0 on the sequence's pages,
// publish(seq) of a finished sequence stamps num_layers, and
// KVCachePool::mark_layers_ready(seq, n) stamps n on every page of the
// sequence after the model wrote layer n - 1 (a few relaxed-ordered release
// stores under the pool's mutex: no syscall). Where the words live is the
// memory's business, like the epochs: after the epoch table in the shm file
// (readers map them read-only), in a small memfd beside a device cache
// (cuda_ipc: readers map it read-only too), private host memory otherwise
// (the owner's engine reads them there and tells readers: ucx; the engines
// without a readiness channel refuse streaming).
//
// A readiness word is meaningful only together with its page's epoch: the
// reader checks the epochs before and after it loads the words (the same
// seqlock as the copies), so a word left by an earlier owner of the page, or
// stamped by a later one, is never taken for this sequence's.

// A view of num_pages 4-byte readiness words in host memory (owned by the
// KVCache or the memory behind it). Thread safety: every method is safe from
// any thread and from other processes mapping the same words.
class PageReadiness {
 public:
  PageReadiness() = default;
  PageReadiness(std::uint32_t* words, std::uint32_t num_pages) noexcept
      : words_(words), num_pages_(num_pages) {}

  std::uint32_t num_pages() const noexcept { return num_pages_; }
  std::uint32_t* words() const noexcept { return words_; }

  // Owner side: `layers` on every page with release stores, so that a reader
  // whose acquire load sees it also sees every byte the owner wrote to those
  // layers before this call. Pages must be in range (the pool checked them).
  void stamp(std::span<const std::uint32_t> pages, std::uint32_t layers) const noexcept;
  // Owner side, before a page gets a new epoch: 0 on every page, then a
  // release fence, so that a reader that sees the new epoch never sees the
  // previous owner's readiness.
  void reset(std::span<const std::uint32_t> pages) const noexcept;
  std::uint32_t load(std::uint32_t page) const noexcept;

 private:
  std::uint32_t* words_ = nullptr;
  std::uint32_t num_pages_ = 0;
};

// One page's readiness word as every reader judges it: kCorruptDescriptor
// naming the page and both values when `word` is above `num_layers` or
// below `floor` (readiness never goes backwards); else OK.
Status check_readiness_word(std::uint32_t page, std::uint32_t word, std::uint32_t num_layers,
                            std::uint32_t floor);

// Reader side: how many layers are ready on every page of `pages`, checked.
// `ready` and `epochs` are num_pages words (read-only mappings of the
// owner's tables); every page must carry `expect_epoch` before and after the
// readiness words are loaded (else kStaleDescriptor, as check_page_epochs);
// a word above `num_layers`, or below `floor` (what an earlier call
// returned: readiness never goes backwards), is kCorruptDescriptor naming
// the page and both values. On success sets *layers_ready to the minimum
// over the pages (>= floor).
Status check_layer_readiness(const std::uint32_t* ready, const std::uint64_t* epochs,
                             std::uint32_t num_pages, std::span<const std::uint32_t> pages,
                             std::uint64_t expect_epoch, std::uint32_t num_layers,
                             std::uint32_t floor, std::uint32_t* layers_ready);

// The engine's side of a stream (KVTransferEngine::watch_layers): the
// owner's readiness for the remote pages of one read, over the engine's own
// channel. Owned by one stream; not thread-safe (the stream driver polls it
// from its one thread).
class LayerWatch {
 public:
  virtual ~LayerWatch() = default;
  // Non-blocking. OK with *layers_ready set to the layers ready on every
  // watched page (never less than an earlier call returned); else the
  // stream's error: kStaleDescriptor (pages freed or reused, owner
  // restarted), kCorruptDescriptor (a value beyond the layer count or going
  // backwards), kNotFound / kPeerFailure (the owner is gone).
  virtual Status poll(std::uint32_t* layers_ready) = 0;
  // For a watch that learns of readiness asynchronously (a request to the
  // owner in flight, answered later): returns how long the stream driver
  // may go without polling it, and keeps `wake` to call (from any thread,
  // without holding a lock the driver's calls take) whenever a poll() may
  // return something new; the driver then polls when woken or after that
  // interval, instead of every StreamOptions::poll_interval. The default, 0,
  // is for a watch whose poll() reads the owner's words directly (shm): the
  // driver polls it every poll_interval and never keeps `wake`. The driver
  // calls this once, before the first poll().
  virtual std::chrono::microseconds wake_on_news(std::function<void()> wake) {
    (void)wake;
    return std::chrono::microseconds{0};
  }
};

}  // namespace mstar::kv
