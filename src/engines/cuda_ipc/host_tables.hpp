// Copyright mstar-kv authors.
//
// The host tables of a device cache (cuda_ipc.hpp "Layer readiness"): the
// cache's page epochs and layer readiness words (epochs.hpp, readiness.hpp)
// in a small sealed memfd of the owner, so that a reader on the same host
// sees the owner's readiness without a CUDA call (a device table would cost
// a device-to-host copy per poll). The owner's KVCache uses them as its host
// tables (the pool stamps them; the epochs are still mirrored to the device
// table that the copies' seqlock checks). Readers open the memfd through
// /proc/<owner pid>/fd/<fd> read-only, as the shm engine opens its caches,
// and check it before mapping: a regular file of the descriptor's uid,
// size-sealed (no SIGBUS), of exactly the expected size, whose header names
// the descriptor's generation and page count.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cuda_ipc {

// Bytes of the tables of num_pages pages: a 64-byte header, 8 bytes of
// epoch and 4 of readiness per page.
std::uint64_t host_tables_bytes(std::uint32_t num_pages) noexcept;

// Owner side. RAII: unmaps and closes.
class HostTables {
 public:
  // Zero-filled. Throws Error(kRetryLater / kInternal) naming the system
  // call that failed.
  HostTables(std::uint32_t num_pages, std::uint64_t generation);
  ~HostTables();
  HostTables(const HostTables&) = delete;
  HostTables& operator=(const HostTables&) = delete;

  std::uint64_t* epochs() const noexcept;
  std::uint32_t* ready() const noexcept;
  int fd() const noexcept { return fd_; }
  std::uint32_t uid() const noexcept { return uid_; }

 private:
  std::byte* base_ = nullptr;
  std::uint32_t num_pages_ = 0;
  int fd_ = -1;
  std::uint32_t uid_ = 0;
};

// Reader side: an owner's tables mapped read-only. RAII: unmaps.
class HostTablesView {
 public:
  // Throws Error: kNotFound (the owner or its fd is gone), kPermissionDenied
  // (another user's file, or /proc refuses), kStaleDescriptor (the fd now
  // names something else: not a sealed file of the right size and header).
  HostTablesView(std::uint32_t owner_pid, std::uint32_t fd, std::uint32_t uid,
                 std::uint64_t generation, std::uint32_t num_pages);
  ~HostTablesView();
  HostTablesView(const HostTablesView&) = delete;
  HostTablesView& operator=(const HostTablesView&) = delete;

  const std::uint64_t* epochs() const noexcept;
  const std::uint32_t* ready() const noexcept;
  std::uint32_t num_pages() const noexcept { return num_pages_; }
  // Two syscalls: the owner still runs (its pidfd) and its fd still names
  // these tables (kNotFound / kStaleDescriptor otherwise).
  Status check_owner() const;

 private:
  const std::byte* base_ = nullptr;
  std::uint32_t num_pages_ = 0;
  int pidfd_ = -1;
  std::string path_;
  std::string who_;
  dev_t dev_ = 0;
  ino_t ino_ = 0;
};

}  // namespace mstar::kv::cuda_ipc
