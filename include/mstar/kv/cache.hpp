// Copyright mstar-kv authors.
//
// KVCache: a KVLayout plus the memory that holds it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

#include "mstar/kv/epochs.hpp"
#include "mstar/kv/layout.hpp"
#include "mstar/kv/readiness.hpp"

namespace mstar::kv {

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
};

// Page-aligned, zero-filled private host memory.
std::unique_ptr<KVMemory> allocate_host_memory(std::size_t size);

// A layout bound to memory of at least layout.total_bytes(). Neither
// copyable nor movable (engines, pools and registrations keep its address
// and its memory's): share it with std::shared_ptr. Views are bounds-checked and throw
// Error(kInvalidArgument) naming the index and its range. Thread safety: the
// object is immutable after construction; the bytes are not synchronised.
class KVCache {
 public:
  // Validates the layout and that memory is large enough.
  KVCache(const KVLayout& layout, std::unique_ptr<KVMemory> memory);
  // Owned private host memory, zero-filled.
  static std::shared_ptr<KVCache> create_host(const KVLayout& layout);

  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;
  KVCache(KVCache&&) = delete;
  KVCache& operator=(KVCache&&) = delete;

  const KVLayout& layout() const noexcept { return layout_; }
  const KVMemory& memory() const noexcept { return *memory_; }
  MemoryKind memory_kind() const noexcept { return memory_->kind(); }
  std::byte* base() const noexcept { return memory_->data(); }
  std::size_t size_bytes() const noexcept { return layout_.total_bytes(); }

  // The bytes of one (layer, k|v, page). For kDevice memory the span holds a
  // device pointer: do not dereference it on the host.
  std::span<std::byte> block(std::uint32_t layer, KV kv,
                             std::uint32_t page) const;

  // The owner epoch of every page (epochs.hpp): written by the KVCachePool
  // over this cache, read by engines serving it. All zero (free) at first.
  const PageEpochs& epochs() const noexcept { return epochs_; }
  // The layer readiness of every page (readiness.hpp): written by the
  // KVCachePool, read by engines serving it. All zero at first.
  const PageReadiness& readiness() const noexcept { return readiness_; }

 private:
  KVLayout layout_;
  std::unique_ptr<KVMemory> memory_;
  std::unique_ptr<KVMemory> epoch_memory_;  // when memory_ keeps no epochs
  PageEpochs epochs_;
  std::unique_ptr<KVMemory> ready_memory_;  // when memory_ keeps no readiness
  PageReadiness readiness_;
};

}  // namespace mstar::kv
