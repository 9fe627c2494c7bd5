// Copyright mstar-kv authors.
#include "cma_anchor.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include "core/codec.hpp"
#include "core/shared_word.hpp"
#include "shm_memory.hpp"

namespace mstar::kv::shm {

std::uint64_t layout_hash(const KVLayout& layout) {
  codec::ByteWriter w;
  w.layout(layout);
  std::uint64_t h = 0xcbf29ce484222325ULL;
  for (std::uint8_t b : w.data()) {
    h ^= b;
    h *= 0x100000001b3ULL;
  }
  return h;
}

CmaAnchor::CmaAnchor(const KVCache& cache, bool map_private) {
  if (cache.memory_kind() != MemoryKind::kHost) {
    throw Error(StatusCode::kInvalidArgument,
                "cross-memory attach serves private host caches (kHost), got memory kind " +
                    std::to_string(static_cast<int>(cache.memory_kind())));
  }
  const KVLayout& layout = cache.layout();
  const RegionMap& map = cache.regions();
  // A split cache of one layer is one region.
  const std::size_t count = map.split() && map.count() > 1 ? map.count() : 1;
  info_.access = ShmKVTransferInfo::Access::kCma;
  info_.pid = static_cast<std::uint32_t>(::getpid());
  info_.uid = static_cast<std::uint32_t>(::geteuid());
  info_.start_time = process_start_time(::getpid());
  if (info_.start_time == 0) {
    throw Error(StatusCode::kInternal,
                "shm engine: cannot read this process's start time: " + errno_text(errno));
  }
  info_.nonce = random_nonce();
  info_.layout = layout;
  info_.region_bytes = count == 1 ? (map.split() ? layout.layer_bytes() : cache.memory().size())
                                  : layout.layer_bytes();
  info_.size = count == 1 ? info_.region_bytes : layout.total_bytes();
  info_.regions.reserve(count);
  for (std::size_t i = 0; i < count; ++i) info_.regions.push_back(map.base(i));
  info_.epochs_addr = reinterpret_cast<std::uintptr_t>(cache.epochs().words());
  info_.ready_addr = reinterpret_cast<std::uintptr_t>(cache.readiness().words());
  if (map_private) {
    info_.backed = true;
    // The tables too when the cache allocated them itself (its memory keeps
    // none: KVCache::bind_tables), whole pages of their own.
    const std::uint32_t n = layout.num_pages;
    const bool own = cache.split() || (cache.memory().epoch_words(n) == nullptr &&
                                       cache.memory().ready_words(n) == nullptr);
    info_.backed_tables = own && info_.epochs_addr % 4096 == 0 && info_.ready_addr % 4096 == 0;
    backing_ = std::make_unique<PrivateBacking>(info_);
    info_.fd = static_cast<std::uint32_t>(backing_->fd());
  }
  bytes_ = anchor_bytes(count);
  void* p = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    throw Error(err == ENOMEM ? StatusCode::kRetryLater : StatusCode::kInternal,
                "shm engine: cannot allocate the cross-memory attach anchor: " + errno_text(err));
  }
  page_ = static_cast<std::byte*>(p);
  info_.anchor = reinterpret_cast<std::uintptr_t>(page_);
  AnchorHeader h;
  h.magic = AnchorHeader::kMagic;
  h.nonce = info_.nonce;
  h.owner_pid = info_.pid;
  h.owner_uid = info_.uid;
  h.layout_hash = layout_hash(layout);
  h.epochs_addr = info_.epochs_addr;
  h.ready_addr = info_.ready_addr;
  h.region_bytes = info_.region_bytes;
  h.num_regions = static_cast<std::uint32_t>(count);
  h.num_pages = layout.num_pages;
  std::memcpy(page_ + sizeof h, info_.regions.data(), 8 * count);
  std::memcpy(page_, &h, sizeof h);
  // Readers copy with the kernel's loads; the fence orders the page's bytes
  // before anything this thread publishes after (the descriptor).
  std::atomic_thread_fence(std::memory_order_release);
}

CmaAnchor::~CmaAnchor() {
  if (page_ == nullptr) return;
  // The nonce first: a reader whose after-copy check runs from now on fails
  // stale, before the cache's memory can be freed (the engine holding this
  // anchor still holds the cache).
  // (shared_word.hpp: libc++ 14, the thread-safety build's, has no atomic_ref)
  internal::store_seq_cst(reinterpret_cast<std::uint64_t*>(page_ + 8), std::uint64_t{0});
  std::memset(page_, 0, sizeof(AnchorHeader));
  ::munmap(page_, bytes_);
  backing_.reset();  // after the anchor: readers fail stale on the anchor first
}

}  // namespace mstar::kv::shm
