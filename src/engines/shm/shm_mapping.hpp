// Copyright mstar-kv authors.
//
// ShmMapping, internal to the shm engine: a reader's read-only mapping of an
// owner's shared cache file (its header page, the cache, the page epoch
// table and the layer readiness words; shm_memory.hpp is the owner's side).
#pragma once

#include <cstddef>
#include <cstdint>

#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

// A read-only mapping of another process's shared cache. RAII, move-only:
// the destructor unmaps. The engine caches one per (pid, nonce); tools see
// the bytes through map_shm_cache (shm.hpp).
// Thread safety: const methods are safe from any thread.
class ShmMapping {
 public:
  // Validates and maps. Throws Error:
  //   kPermissionDenied  the owner is another user (descriptor uid, file uid
  //                      or the kernel's access check);
  //   kNotFound          the owner process or its cache no longer exists;
  //   kStaleDescriptor   the pid now belongs to another process, or the fd
  //                      now holds another cache (nonce, size or seals differ);
  //   kInternal          an unexpected system error (named).
  static ShmMapping open(const ShmKVTransferInfo& info);

  ShmMapping(ShmMapping&& other) noexcept;
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ~ShmMapping();

  // The owner's cache bytes, read-only (PROT_READ).
  const std::byte* data() const noexcept { return base_ + kHeaderBytes; }
  // The owner's page epoch table (epochs.hpp), read-only: layout.num_pages
  // words after the cache.
  const std::uint64_t* epochs() const noexcept {
    return reinterpret_cast<const std::uint64_t*>(base_ + epoch_offset());
  }
  std::uint32_t epoch_pages() const noexcept { return info_.layout.num_pages; }
  // The owner's layer readiness words (readiness.hpp), read-only:
  // layout.num_pages words after the epoch table.
  const std::uint32_t* ready_words() const noexcept {
    return reinterpret_cast<const std::uint32_t*>(base_ + ready_offset());
  }
  std::size_t size() const noexcept { return info_.size; }
  const ShmKVTransferInfo& info() const noexcept { return info_; }

  // OK while the owner is alive and still holds this very cache at
  // /proc/<pid>/fd/<fd>; else kNotFound (owner exited, cache freed) or
  // kStaleDescriptor (the fd now names other memory). Two cheap syscalls.
  Status check_owner() const;

  static constexpr std::size_t kHeaderBytes = 4096;

 private:
  ShmMapping() = default;
  void reset() noexcept;
  std::size_t epoch_offset() const noexcept {
    return kHeaderBytes + ((info_.size + 4095) & ~std::size_t{4095});
  }
  std::size_t ready_offset() const noexcept {
    return epoch_offset() + ((std::size_t{info_.layout.num_pages} * 8 + 4095) & ~std::size_t{4095});
  }

  ShmKVTransferInfo info_;
  std::byte* base_ = nullptr;
  std::size_t mapped_bytes_ = 0;
  int pidfd_ = -1;
  std::uint64_t dev_ = 0;
  std::uint64_t ino_ = 0;
};

}  // namespace mstar::kv
