// Copyright mstar-kv authors.
//
// Serving a private host cache to same-host readers through cross-memory
// attach (process_vm_readv), the owner's half (private to the shm engine;
// cma_reader.hpp is the reader's).
//
// A private cache (kHost: a tensor the application allocated, vLLM's
// per-layer tensors) has no file another process could map. A reader of the
// same user copies straight out of the owner's memory with process_vm_readv:
// one copy, as the memfd path's memcpy from its mapping, done by the
// kernel, which checks ptrace read access (same user, the owner dumpable, no
// Yama or seccomp rule against it). The owner keeps an anchor: a page of its
// own memory naming the cache (magic, a random nonce, pid, uid, its regions,
// where its page epochs and readiness words are, a hash of its layout). A
// reader reads the anchor and compares it with the descriptor before any
// byte moves, and re-reads its nonce around every copy: an owner restarted
// (start time), a cache re-allocated or an engine shut down (the anchor is
// zeroed, then unmapped) is kStaleDescriptor, never another cache's bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "private_backing.hpp"

namespace mstar::kv::shm {

// The anchor page's first bytes; the region addresses follow (u64 each).
struct AnchorHeader {
  static constexpr std::uint64_t kMagic = 0x31414d4356545354ULL;  // "TSTVCMA1"
  std::uint64_t magic = 0;
  std::uint64_t nonce = 0;
  std::uint32_t owner_pid = 0;
  std::uint32_t owner_uid = 0;
  std::uint64_t layout_hash = 0;
  std::uint64_t epochs_addr = 0;
  std::uint64_t ready_addr = 0;
  std::uint64_t region_bytes = 0;
  std::uint32_t num_regions = 0;
  std::uint32_t num_pages = 0;
};
static_assert(sizeof(AnchorHeader) == 64);

// Bytes of the anchor of a cache of `regions` regions (whole pages).
inline std::uint64_t anchor_bytes(std::uint64_t regions) noexcept {
  return (sizeof(AnchorHeader) + 8 * regions + 4095) & ~std::uint64_t{4095};
}

// A hash of the layout's fields (FNV-1a over its encoding): the anchor's
// word for "this layout".
std::uint64_t layout_hash(const KVLayout& layout);

// The owner's anchor of one private host cache. RAII: the destructor zeroes
// the nonce (readers in the middle of a copy then fail their after-copy
// check) and unmaps the page. Not copyable.
class CmaAnchor {
 public:
  // Throws Error(kInvalidArgument) for a device or shared cache,
  // Error(kRetryLater) / kInternal when the page cannot be allocated or the
  // process's start time read. With `map_private`, the cache's whole pages
  // are re-backed by a memfd first (private_backing.hpp; its errors).
  explicit CmaAnchor(const KVCache& cache, bool map_private = false);
  ~CmaAnchor();
  CmaAnchor(const CmaAnchor&) = delete;
  CmaAnchor& operator=(const CmaAnchor&) = delete;

  // The descriptor readers need (access kCma).
  const ShmKVTransferInfo& info() const noexcept { return info_; }

 private:
  std::byte* page_ = nullptr;
  std::size_t bytes_ = 0;
  ShmKVTransferInfo info_;
  std::unique_ptr<PrivateBacking> backing_;
};

}  // namespace mstar::kv::shm
