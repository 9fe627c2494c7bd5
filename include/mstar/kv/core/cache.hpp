// Copyright mstar-kv authors.
//
// KVCache: a KVLayout plus the memory that holds it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "mstar/kv/core/epochs.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/core/regions.hpp"

namespace mstar::kv {

namespace staging {
class Copier;  // src/core/staging.hpp (engines only)
}

enum class MemoryKind : std::uint8_t {
  kHost = 0,        // private process memory
  kSharedHost = 1,  // host memory another process of the same user can map
  kDevice = 2,      // GPU memory (not dereferenceable on the host)
};

// The memory behind a cache. Implementations own their memory and release it
// in the destructor; engines that need more (a file descriptor, an IPC
// handle) downcast to the concrete class they created.
class KVMemory {
 public:
  virtual ~KVMemory() = default;
  virtual std::byte* data() const noexcept = 0;
  virtual std::size_t size() const noexcept = 0;
  virtual MemoryKind kind() const noexcept = 0;
  // Where this memory keeps the cache's page epochs (epochs.hpp), so that
  // readers of its engine can check them: at least `num_pages` 8-byte words
  // of host memory, or nullptr when it keeps none (the cache then allocates
  // them in private, page-aligned host memory).
  virtual std::uint64_t* epoch_words(std::uint32_t num_pages) const noexcept {
    (void)num_pages;
    return nullptr;
  }
  // Where this memory keeps the pages' layer readiness (readiness.hpp), so
  // that readers of its engine can see it: at least `num_pages` 4-byte
  // words, or nullptr (the cache then keeps them in private host memory).
  virtual std::uint32_t* ready_words(std::uint32_t num_pages) const noexcept {
    (void)num_pages;
    return nullptr;
  }
  // Where the epochs must also be written for readers that cannot see host
  // memory (device memory: cuda_ipc), made for `num_pages` pages when the
  // cache binds this memory, before epoch_words and ready_words are asked
  // (a memory may make its host tables here); nullptr when none is needed.
  // May throw.
  virtual const EpochMirror* epoch_mirror(std::uint32_t num_pages) {
    (void)num_pages;
    return nullptr;
  }
  // How bytes move between this memory and host buffers, for an engine
  // whose transport cannot touch it (staging: device memory over ucx): the
  // memory's copier, or nullptr when the host can read it (memcpy does) or
  // no copier is built (device memory without the copy kernel). May throw.
  virtual std::shared_ptr<staging::Copier> staging_copier() const { return nullptr; }
};

// Page-aligned, zero-filled private host memory.
std::unique_ptr<KVMemory> allocate_host_memory(std::size_t size);

// A layout bound to memory: one region of at least layout.total_bytes(),
// or one region per layer (regions.hpp) of at least layout.layer_bytes()
// each, for a layer-contiguous layout (layer-major, layer-page): vLLM's
// per-layer tensors. Offsets everywhere (planner, descriptors) are the
// layout's; at() and regions() turn them into addresses. Neither copyable
// nor movable (engines, pools and registrations keep its address and its
// memory's): share it with std::shared_ptr. Views are bounds-checked and
// throw Error(kInvalidArgument) naming the index and its range. Thread
// safety: the object is immutable after construction; the bytes are not
// synchronised.
class KVCache {
 public:
  // Validates the layout and that memory is large enough.
  KVCache(const KVLayout& layout, std::unique_ptr<KVMemory> memory);
  // One region per layer: layer_memories[l] holds layer l's bytes (its
  // first layout.layer_bytes()). Throws Error(kInvalidArgument) naming what
  // is wrong: a page-major layout (its layers are not contiguous), a count
  // other than num_layers, a null or too small memory (naming the layer,
  // its size and the layer's bytes), memories of different kinds, or two
  // layers whose bytes overlap. The page epochs and readiness words live in
  // private host memory (a split cache's memories keep none).
  KVCache(const KVLayout& layout, std::vector<std::unique_ptr<KVMemory>> layer_memories);
  // Owned private host memory, zero-filled.
  static std::shared_ptr<KVCache> create_host(const KVLayout& layout);
  // Owned private host memory, zero-filled, one allocation per layer (for
  // tests and benchmarks of split caches).
  static std::shared_ptr<KVCache> create_host_layers(const KVLayout& layout);

  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;
  KVCache(KVCache&&) = delete;
  KVCache& operator=(KVCache&&) = delete;

  const KVLayout& layout() const noexcept { return layout_; }
  // The memory of region 0 (the whole cache unless split()).
  const KVMemory& memory() const noexcept { return *memories_.front(); }
  // The memory of region i (< num_regions()).
  const KVMemory& region_memory(std::size_t i) const noexcept { return *memories_[i]; }
  std::size_t num_regions() const noexcept { return memories_.size(); }
  // True for a cache of one region per layer.
  bool split() const noexcept { return regions_.split(); }
  MemoryKind memory_kind() const noexcept { return memories_.front()->kind(); }
  // Where the bytes are (regions.hpp).
  const RegionMap& regions() const noexcept { return regions_; }
  // The address of the byte at layout offset `offset` (< size_bytes(); a
  // span the planner emits maps whole from its first byte).
  std::byte* at(std::uint64_t offset) const noexcept { return regions_.pointer(offset); }
  // The one region's base; nullptr for a split cache (use at()).
  std::byte* base() const noexcept { return split() ? nullptr : memories_.front()->data(); }
  std::size_t size_bytes() const noexcept { return layout_.total_bytes(); }

  // The bytes [offset, offset + length) as runs that each lie in one region,
  // in order: fn(std::byte* run, std::uint64_t run_offset, std::uint64_t
  // run_length). One run for a cache of one region. Unchecked: the range
  // must be inside the layout.
  template <typename Fn>
  void for_each_run(std::uint64_t offset, std::uint64_t length, Fn&& fn) const {
    while (length != 0) {
      const std::uint64_t n = regions_.run_bytes(offset, length);
      fn(at(offset), offset, n);
      offset += n;
      length -= n;
    }
  }

  // The bytes of one (layer, k|v, page). For kDevice memory the span holds a
  // device pointer: do not dereference it on the host.
  std::span<std::byte> block(std::uint32_t layer, KV kv, std::uint32_t page) const;

  // The owner epoch of every page (epochs.hpp): written by the KVCachePool
  // over this cache, read by engines serving it. All zero (free) at first.
  const PageEpochs& epochs() const noexcept { return epochs_; }
  // The layer readiness of every page (readiness.hpp): written by the
  // KVCachePool, read by engines serving it. All zero at first.
  const PageReadiness& readiness() const noexcept { return readiness_; }

 private:
  void bind_tables(KVMemory* tables_from);

  KVLayout layout_;
  std::vector<std::unique_ptr<KVMemory>> memories_;  // one, or one per layer
  RegionMap regions_;
  std::unique_ptr<KVMemory> epoch_memory_;  // when memory_ keeps no epochs
  PageEpochs epochs_;
  std::unique_ptr<KVMemory> ready_memory_;  // when memory_ keeps no readiness
  PageReadiness readiness_;
};

}  // namespace mstar::kv
