// Copyright mstar-kv authors.
//
// Shared host memory for a KV cache: an anonymous, size-sealed memfd with a
// 4 KiB header page (private to the shm engine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mstar/kv/core/cache.hpp"
#include "util/posix_fd.hpp"

namespace mstar::kv::shm {

// The header page at offset 0 of every shared cache memfd.
struct Header {
  static constexpr std::uint64_t kMagic = 0x314d48535654534dULL;  // "MSTVSHM1"
  std::uint64_t magic = 0;
  std::uint64_t nonce = 0;
  std::uint64_t size = 0;  // cache bytes after the header page
  std::uint32_t owner_pid = 0;
  std::uint32_t owner_uid = 0;
  std::uint64_t epoch_offset = 0;  // file offset of the page epoch table
  std::uint64_t epoch_pages = 0;   // its length in 8-byte words
  std::uint64_t ready_offset = 0;  // file offset of the layer readiness table
};

// The memfd holds the header page, the cache, then the page epoch table
// (epochs.hpp), page-aligned, which readers map read-only with the cache.
inline std::uint64_t epoch_table_offset(std::uint64_t size) noexcept {
  return 4096 + ((size + 4095) & ~std::uint64_t{4095});
}
// Then the layer readiness table (readiness.hpp): num_pages 4-byte words,
// page-aligned, mapped read-only by readers with the rest.
inline std::uint64_t ready_table_offset(std::uint64_t size, std::uint32_t num_pages) noexcept {
  return epoch_table_offset(size) + ((std::uint64_t{num_pages} * 8 + 4095) & ~std::uint64_t{4095});
}
inline std::uint64_t shm_file_bytes(std::uint64_t size, std::uint32_t num_pages) noexcept {
  return ready_table_offset(size, num_pages) +
         ((std::uint64_t{num_pages} * 4 + 4095) & ~std::uint64_t{4095});
}

// Owns the memfd and its read-write mapping (populated at allocation, so the
// cache never pays first-touch page faults during a transfer).
class SharedMemory final : public KVMemory {
 public:
  // Throws Error(kRetryLater) when the memory cannot be allocated,
  // Error(kInternal) naming the failing system call otherwise.
  // `num_pages` epoch words follow the cache.
  static std::unique_ptr<SharedMemory> create(std::size_t size, std::uint32_t num_pages);
  ~SharedMemory() override;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  std::byte* data() const noexcept override { return base_ + kHeaderBytes; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return MemoryKind::kSharedHost; }
  std::uint64_t* epoch_words(std::uint32_t num_pages) const noexcept override {
    if (num_pages > epoch_pages_) return nullptr;
    return reinterpret_cast<std::uint64_t*>(base_ + epoch_table_offset(size_));
  }

  std::uint32_t* ready_words(std::uint32_t num_pages) const noexcept override {
    if (num_pages > epoch_pages_) return nullptr;
    return reinterpret_cast<std::uint32_t*>(base_ + ready_table_offset(size_, epoch_pages_));
  }

  int fd() const noexcept { return fd_; }
  std::uint64_t nonce() const noexcept { return nonce_; }
  std::uint32_t owner_pid() const noexcept { return owner_pid_; }
  std::uint32_t owner_uid() const noexcept { return owner_uid_; }
  std::uint64_t owner_start_time() const noexcept { return owner_start_time_; }

  static constexpr std::size_t kHeaderBytes = 4096;

 private:
  SharedMemory() = default;

  int fd_ = -1;
  std::byte* base_ = nullptr;
  std::size_t size_ = 0;
  std::uint32_t epoch_pages_ = 0;
  std::uint64_t nonce_ = 0;
  std::uint32_t owner_pid_ = 0;
  std::uint32_t owner_uid_ = 0;
  std::uint64_t owner_start_time_ = 0;
};

// Start time of a process in clock ticks since boot (/proc/<pid>/stat field
// 22); std::nullopt-like 0 with errno set when it cannot be read.
// Throws nothing.
std::uint64_t process_start_time(int pid) noexcept;

// A random nonzero 64-bit nonce (getrandom).
std::uint64_t random_nonce();

using posix::errno_text;
// The process (thread group) a pid or thread id belongs to, from
// /proc/<pid>/status; 0 when it cannot be read.
std::uint32_t thread_group_of(std::uint32_t pid) noexcept;

// After the reader pinned the owner's pid (a pidfd): throws unless `pid` is
// the leader of its process (a thread id's /proc entry opens the process's
// fds under another pid: kStaleDescriptor), still alive (kNotFound) and the
// process that published (start time `start_time`, else the pid was reused:
// kStaleDescriptor). `who` names the owner in the messages.
void check_owner_identity(std::uint32_t pid, std::uint64_t start_time, const std::string& who);

}  // namespace mstar::kv::shm
