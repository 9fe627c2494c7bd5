// Copyright mstar-kv authors.
//
// Shared host memory for a KV cache: an anonymous, size-sealed memfd with a
// 4 KiB header page (private to the shm engine).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "mstar/kv/cache.hpp"

namespace mstar::kv::shm {

// The header page at offset 0 of every shared cache memfd.
struct Header {
  static constexpr std::uint64_t kMagic = 0x314d48535654534dULL;  // "MSTVSHM1"
  std::uint64_t magic = 0;
  std::uint64_t nonce = 0;
  std::uint64_t size = 0;  // cache bytes after the header page
  std::uint32_t owner_pid = 0;
  std::uint32_t owner_uid = 0;
};

// Owns the memfd and its read-write mapping (populated at allocation, so the
// cache never pays first-touch page faults during a transfer).
class SharedMemory final : public KVMemory {
 public:
  // Throws Error(kRetryLater) when the memory cannot be allocated,
  // Error(kInternal) naming the failing system call otherwise.
  static std::unique_ptr<SharedMemory> create(std::size_t size);
  ~SharedMemory() override;
  SharedMemory(const SharedMemory&) = delete;
  SharedMemory& operator=(const SharedMemory&) = delete;

  std::byte* data() const noexcept override { return base_ + kHeaderBytes; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return MemoryKind::kSharedHost; }

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
  std::uint64_t nonce_ = 0;
  std::uint32_t owner_pid_ = 0;
  std::uint32_t owner_uid_ = 0;
  std::uint64_t owner_start_time_ = 0;
};

// Start time of a process in clock ticks since boot (/proc/<pid>/stat field
// 22); std::nullopt-like 0 with errno set when it cannot be read.
// Throws nothing.
std::uint64_t process_start_time(int pid) noexcept;

// "open: No such file or directory" style text for errno.
std::string errno_text(int err);

}  // namespace mstar::kv::shm
