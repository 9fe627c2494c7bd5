// Copyright mstar-kv authors.
//
// CmaPeer, internal to the shm engine: a reader's handle on an owner's
// private cache served through cross-memory attach (cma_anchor.hpp is the
// owner's half). Bytes move with process_vm_readv(2): the kernel copies from
// the owner's pages straight into this process's (one copy), up to IOV_MAX
// (1024) runs on each side per call. Every check a memfd mapping makes has
// its twin here: uid, a pidfd that pins the owner, its start time, and the
// owner's anchor (nonce, regions, tables, layout), read and compared with
// the descriptor before any byte moves and re-read around every copy.
//
// Unlike a memfd mapping, the owner's memory does not outlive it: a copy
// running when the owner dies fails (kNotFound), and so does every later
// one.
//
// An owner whose private cache is re-backed by a memfd (map_private,
// private_backing.hpp) names it in the descriptor (backed): the reader maps
// it read-only at open, after the same checks and its own (a sealed memfd of
// the owner's user whose header names the anchor's nonce, owner and
// regions), and copies every span that lies in a region's whole pages out
// of that mapping; the rest still goes through process_vm_readv.
#pragma once

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/readiness.hpp"
#include "mstar/kv/core/regions.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/util/status.hpp"
#include "private_backing.hpp"

namespace mstar::kv::shm {

class CmaPeer {
 public:
  // Validates the descriptor (kCma, decoded) against the live owner and its
  // anchor. Throws Error:
  //   kPermissionDenied  another user, or the kernel refuses the
  //                      cross-memory attach (EPERM: the message names
  //                      why, e.g. Yama's ptrace_scope, and what to change);
  //   kNotFound          the owner process no longer exists;
  //   kStaleDescriptor   the pid now names another process, or the anchor
  //                      no longer names this cache (re-allocated, engine
  //                      shut down), or differs from the descriptor;
  //   kUnavailable       a kernel without process_vm_readv;
  //   kInternal          an unexpected system error (named).
  static std::shared_ptr<const CmaPeer> open(const ShmKVTransferInfo& info);
  ~CmaPeer();
  CmaPeer(const CmaPeer&) = delete;
  CmaPeer& operator=(const CmaPeer&) = delete;

  const ShmKVTransferInfo& info() const noexcept { return info_; }
  // The owner's regions: remote layout offsets -> addresses in the owner.
  const RegionMap& regions() const noexcept { return regions_; }

  // OK while the owner lives (a pidfd poll, no read); else kNotFound.
  Status check_alive() const;
  // Re-reads the anchor's nonce and, with epoch != 0, the owner's page
  // epochs of `pages` (sorted, distinct, in range): kStaleDescriptor
  // naming the first page that changed owner `when` ("before the copy"), or
  // the anchor that changed; the errors of a failed read otherwise. A
  // backed cache whose tables are mapped reads them (and the nonce its
  // memfd's header carries) in the mapping: no system call; `after_copy`
  // fences the copy's loads before them (check_page_epochs).
  Status verify(std::span<const std::uint32_t> pages, std::uint64_t epoch, std::string_view when,
                bool after_copy = false) const;
  // Copies the rows of spans [b, e) from the owner (remote offsets through
  // regions()) to dst (local offsets), batching up to IOV_MAX runs per side
  // in each call. A short copy (the owner unmapped the memory) or a failed
  // call is an error (kNotFound when the owner exited, kStaleDescriptor
  // when it lives but no longer maps the cache). Spans inside a backed
  // cache's whole pages are copied from its mapping (`streaming`:
  // span_copy.hpp's mode, fenced before this returns).
  Status copy(const RegionMap& dst, const StridedSpan* b, const StridedSpan* e,
              bool streaming = false) const;
  // True when the owner's whole pages are mapped here (a backed cache).
  bool mapped() const noexcept { return backing_ != nullptr; }
  // A layer watch over the owner's readiness words of `pages` (sorted,
  // distinct), three reads a poll (epochs, words, epochs: the seqlock of
  // readiness.hpp), at most one a `min_interval`; an owner that died
  // with layers missing ends it with kNotFound. `self` keeps the peer.
  static std::unique_ptr<LayerWatch> watch(std::shared_ptr<const CmaPeer> self,
                                           std::vector<std::uint32_t> pages, std::uint64_t epoch);

  // "shm cache of pid 7 (private memory, cross-memory attach)".
  std::string who() const;

  // Reads n 8- or 4-byte words of each page in `pages` (sorted, distinct)
  // from the table at `table` (word size `word`) into out (pages.size()
  // words); with `nonce_first`, the anchor's nonce first into *nonce.
  Status read_words(std::uint64_t table, std::size_t word, std::span<const std::uint32_t> pages,
                    void* out, std::uint64_t* nonce) const;

 private:
  explicit CmaPeer(const ShmKVTransferInfo& info) : info_(info) {}
  // One process_vm_readv (at most IOV_MAX entries each side) of `bytes`
  // bytes in all; a short or failed read is the status of `what`.
  Status read(const iovec* local, std::size_t nlocal, const iovec* remote, std::size_t nremote,
              std::size_t bytes, std::string_view what) const;
  Status nonce_status(std::uint64_t found) const;
  // Maps the memfd of a backed cache (open's last step); throws Error.
  void map_backing();
  // Where the mapping holds the header's nonce and the page epochs (backed
  // tables only).
  void map_tables() noexcept;
  // The whole pages of the span's region (nullptr: not a backed cache).
  const Interior* interior_of(const StridedSpan& s) const noexcept;
  // Where the span's remote rows are in the mapping, or nullptr when any
  // byte of them is not in `in`, its region's whole pages (interior_of).
  const std::byte* mapped_rows(const StridedSpan& s, const Interior* in) const noexcept;

  ShmKVTransferInfo info_;
  RegionMap regions_;
  int pidfd_ = -1;
  const std::byte* backing_ = nullptr;
  std::size_t backing_bytes_ = 0;
  std::vector<Interior> interiors_;  // the regions', then (backed_tables) the tables'
  const std::uint64_t* mapped_nonce_ = nullptr;
  const std::uint64_t* mapped_epochs_ = nullptr;
};

// Why the kernel may refuse a cross-memory attach here, and what to change
// (Yama's ptrace_scope, dumpable owners, seccomp), for EPERM messages.
std::string cma_permission_hint();

}  // namespace mstar::kv::shm
