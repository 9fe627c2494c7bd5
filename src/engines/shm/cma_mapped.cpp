// Copyright mstar-kv authors.
//
// CmaPeer's mapping of a backed cache's whole pages (map_private,
// private_backing.hpp): opened and checked once, then where a span's rows
// are in it.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "cma_reader.hpp"
#include "shm_memory.hpp"
#include "util/posix_fd.hpp"

namespace mstar::kv::shm {

void CmaPeer::map_backing() {
  const std::string who = this->who();
  const std::string fd = std::to_string(info_.fd);
  const std::string path = "/proc/" + std::to_string(info_.pid) + "/fd/" + fd;
  const posix::PeerFile file = posix::open_peer_file(
      path, who, info_.uid,
      "fd " + fd + " is not the cache's memfd (not a regular file): its engine shut down",
      "(only the owner's user may map its cache)", "memory");
  interiors_ = backing_parts(info_);
  const std::uint64_t want = backing_file_bytes(interiors_);
  const int seals = ::fcntl(file.fd.get(), F_GET_SEALS);
  if (seals < 0 || (seals & F_SEAL_SHRINK) == 0 || (seals & F_SEAL_GROW) == 0) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": fd " + fd + " is not a size-sealed memfd: not the cache's pages");
  }
  if (static_cast<std::uint64_t>(file.st.st_size) != want) {
    throw Error(StatusCode::kStaleDescriptor, who + ": fd " + fd + " holds " +
                                                  std::to_string(file.st.st_size) +
                                                  " bytes, the regions' whole pages need " +
                                                  std::to_string(want) + ": not the cache's pages");
  }
  // Populated now, once per peer, as a shared cache's mapping is.
  void* m = ::mmap(nullptr, want, PROT_READ, MAP_SHARED | MAP_POPULATE, file.fd.get(), 0);
  if (m == MAP_FAILED) {
    const int err = errno;
    throw Error(err == ENOMEM ? StatusCode::kRetryLater : StatusCode::kInternal,
                who + ": mmap of " + std::to_string(want) + " bytes: " + errno_text(err));
  }
  backing_ = static_cast<const std::byte*>(m);
  backing_bytes_ = want;
  BackingHeader h;
  std::memcpy(static_cast<void*>(&h), backing_, sizeof h);
  if (h.magic != BackingHeader::kMagic || h.nonce != info_.nonce || h.owner_pid != info_.pid ||
      h.owner_uid != info_.uid || h.region_bytes != info_.region_bytes || h.file_bytes != want ||
      h.num_regions != info_.regions.size() || h.flags != (info_.backed_tables ? 1u : 0u)) {
    throw Error(StatusCode::kStaleDescriptor,
                who + ": fd " + fd + " does not hold this cache's pages (its header names " +
                    (h.magic == BackingHeader::kMagic ? "nonce " + std::to_string(h.nonce)
                                                      : std::string("no cache")) +
                    ", the descriptor's nonce is " + std::to_string(info_.nonce) +
                    "): its engine shut down, or the descriptor is forged");
  }
  map_tables();
}

void CmaPeer::map_tables() noexcept {
  if (!info_.backed_tables) return;
  const std::size_t count = info_.regions.size();
  mapped_nonce_ = reinterpret_cast<const std::uint64_t*>(backing_ + 8);
  mapped_epochs_ = reinterpret_cast<const std::uint64_t*>(backing_ + interiors_[count].file_offset);
}

const Interior* CmaPeer::interior_of(const StridedSpan& s) const noexcept {
  if (backing_ == nullptr) return nullptr;
  return &interiors_[regions_.split() ? s.remote_offset / regions_.layer_bytes() : 0];
}

const std::byte* CmaPeer::mapped_rows(const StridedSpan& s, const Interior* in) const noexcept {
  if (in == nullptr) return nullptr;
  const std::uint64_t first = regions_.address(s.remote_offset);
  const std::uint64_t end = first + (s.rows - 1) * s.remote_stride + s.length;
  if (first < in->lo || end > in->hi) return nullptr;
  return backing_ + in->file_offset + (first - in->lo);
}

}  // namespace mstar::kv::shm
