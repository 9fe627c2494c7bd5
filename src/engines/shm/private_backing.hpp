// Copyright mstar-kv authors.
//
// A private cache re-backed in place by a memfd (private to the shm engine;
// the option map_private, shm.hpp). The owner moves the whole pages of each
// region of its private cache into one anonymous, size-sealed memfd mapped
// MAP_SHARED | MAP_FIXED at the same addresses: the application keeps its
// pointers and its bytes, and a reader of the same user maps those pages
// read-only through /proc/<pid>/fd/<fd>, as it maps a shared cache, instead
// of asking the kernel to copy each batch of runs (process_vm_readv). What
// does not fill a whole page (a region's first and last partial pages), the
// page epochs, the readiness words and the anchor stay private and are read
// by cross-memory attach (cma_reader.hpp).
//
// The file: a 4 KiB header page (magic, the anchor's nonce, the owner, the
// regions' count and size), then each region's whole pages in region order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "mstar/kv/engines/shm.hpp"

namespace mstar::kv::shm {

struct BackingHeader {
  static constexpr std::uint64_t kMagic = 0x31565250564d5453ULL;  // "STMVPRV1"
  std::uint64_t magic = 0;
  std::uint64_t nonce = 0;  // the anchor's (the descriptor's)
  std::uint32_t owner_pid = 0;
  std::uint32_t owner_uid = 0;
  std::uint64_t region_bytes = 0;
  std::uint64_t file_bytes = 0;
  std::uint32_t num_regions = 0;
  std::uint32_t flags = 0;  // bit 0: the tables' pages follow the regions'
};

inline constexpr std::uint64_t kBackingHeaderBytes = 4096;

// The whole pages of one region: owner addresses [lo, hi), at file offset
// `file_offset` (hi == lo: none).
struct Interior {
  std::uint64_t lo = 0;
  std::uint64_t hi = 0;
  std::uint64_t file_offset = 0;
};

// Each region's whole pages and where they lie in the file (both sides
// compute them from the descriptor's regions and region bytes); with
// info.backed_tables, then the page epoch table's pages and the readiness
// words' (whole pages from their page-aligned starts: the cache's own
// allocations, nothing else in them).
std::vector<Interior> backing_parts(const ShmKVTransferInfo& info);
// The file's size: the header page and every interior.
std::uint64_t backing_file_bytes(std::span<const Interior> interiors);

// The owner's side. Making one copies every interior into a new memfd and
// maps it over the interior, 64 MiB at a time (the cache must not be
// written meanwhile); the bytes and addresses stay the application's. RAII:
// the destructor zeroes the header's nonce and closes the memfd; the cache's
// pages stay mapped from it until the application frees them.
class PrivateBacking {
 public:
  // `info`: the anchor's descriptor (kCma: pid, uid, nonce, regions).
  // Throws Error(kRetryLater) when the memory cannot be had (ENOMEM,
  // ENOSPC), kInternal naming the system call otherwise; the cache's bytes
  // are intact either way (a failed interior was not remapped).
  explicit PrivateBacking(const ShmKVTransferInfo& info);
  ~PrivateBacking();
  PrivateBacking(const PrivateBacking&) = delete;
  PrivateBacking& operator=(const PrivateBacking&) = delete;

  int fd() const noexcept { return fd_; }

 private:
  int fd_ = -1;
  std::byte* header_ = nullptr;
};

}  // namespace mstar::kv::shm
