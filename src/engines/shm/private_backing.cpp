// Copyright mstar-kv authors.
#include "private_backing.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/shared_word.hpp"
#include "mstar/kv/core/regions.hpp"
#include "shm_memory.hpp"

namespace mstar::kv::shm {

namespace {

constexpr std::uint64_t kOsPage = 4096;
// Copied and remapped this much at a time: the memory the move needs beyond
// the cache's.
constexpr std::uint64_t kMoveChunk = 64ull << 20;

[[noreturn]] void fail(const std::string& what, int err) {
  const StatusCode code = (err == ENOMEM || err == ENOSPC || err == EMFILE || err == ENFILE)
                              ? StatusCode::kRetryLater
                              : StatusCode::kInternal;
  throw Error(code, "shm engine: cannot move the private cache into shared memory (map_private): " +
                        what + ": " + errno_text(err));
}

// All of [p, p + n) into the file at `offset`.
void write_all(int fd, const std::byte* p, std::uint64_t n, std::uint64_t offset) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("pwrite of " + std::to_string(n) + " bytes at " + hex_address(offset), errno);
    }
    p += w;
    n -= static_cast<std::uint64_t>(w);
    offset += static_cast<std::uint64_t>(w);
  }
}

}  // namespace

std::vector<Interior> backing_parts(const ShmKVTransferInfo& info) {
  std::vector<Interior> out;
  out.reserve(info.regions.size() + 2);
  std::uint64_t offset = kBackingHeaderBytes;
  auto add = [&](std::uint64_t lo, std::uint64_t hi) {
    out.push_back({lo, std::max(lo, hi), offset});
    offset += out.back().hi - lo;
  };
  for (std::uint64_t base : info.regions) {
    add((base + kOsPage - 1) & ~(kOsPage - 1), (base + info.region_bytes) & ~(kOsPage - 1));
  }
  if (info.backed_tables) {
    const std::uint64_t n = info.layout.num_pages;
    add(info.epochs_addr, (info.epochs_addr + n * 8 + kOsPage - 1) & ~(kOsPage - 1));
    add(info.ready_addr, (info.ready_addr + n * 4 + kOsPage - 1) & ~(kOsPage - 1));
  }
  return out;
}

std::uint64_t backing_file_bytes(std::span<const Interior> interiors) {
  std::uint64_t n = kBackingHeaderBytes;
  for (const Interior& i : interiors) n += i.hi - i.lo;
  return n;
}

PrivateBacking::PrivateBacking(const ShmKVTransferInfo& info) {
  const std::vector<Interior> parts = backing_parts(info);
  const std::uint64_t bytes = backing_file_bytes(parts);
  fd_ = ::memfd_create("mstar-kv-private", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd_ < 0) fail("memfd_create", errno);
  try {
    if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
      fail("ftruncate to " + std::to_string(bytes) + " bytes", errno);
    }
    // The size sealed: a reader's mapping can never fault with SIGBUS.
    if (::fcntl(fd_, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
      fail("fcntl(F_ADD_SEALS)", errno);
    }
    // Each chunk's bytes go into the file, then the file's pages replace the
    // chunk's at the same addresses (MAP_FIXED drops the private ones): at
    // no moment does the cache read other bytes than its own.
    for (const Interior& part : parts) {
      for (std::uint64_t off = 0; off < part.hi - part.lo; off += kMoveChunk) {
        const std::uint64_t n = std::min(kMoveChunk, part.hi - part.lo - off);
        auto* at = reinterpret_cast<std::byte*>(static_cast<std::uintptr_t>(part.lo + off));
        write_all(fd_, at, n, part.file_offset + off);
        void* p = ::mmap(at, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED | MAP_POPULATE, fd_,
                         static_cast<off_t>(part.file_offset + off));
        if (p == MAP_FAILED) fail("mmap over " + hex_address(part.lo + off), errno);
      }
    }
    void* h = ::mmap(nullptr, kBackingHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (h == MAP_FAILED) fail("mmap of the header page", errno);
    header_ = static_cast<std::byte*>(h);
  } catch (...) {
    ::close(fd_);
    throw;
  }
  BackingHeader hd;
  hd.magic = BackingHeader::kMagic;
  hd.nonce = info.nonce;
  hd.owner_pid = info.pid;
  hd.owner_uid = info.uid;
  hd.region_bytes = info.region_bytes;
  hd.file_bytes = bytes;
  hd.num_regions = static_cast<std::uint32_t>(info.regions.size());
  hd.flags = info.backed_tables ? 1 : 0;
  std::memcpy(header_, &hd, sizeof hd);
  std::atomic_thread_fence(std::memory_order_release);
}

PrivateBacking::~PrivateBacking() {
  // A reader that maps the file after this finds no nonce; one that mapped
  // it before fails its next anchor check (the anchor goes first).
  internal::store_seq_cst(reinterpret_cast<std::uint64_t*>(header_ + 8), std::uint64_t{0});
  ::munmap(header_, kBackingHeaderBytes);
  ::close(fd_);
}

}  // namespace mstar::kv::shm
