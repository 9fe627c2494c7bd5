// Copyright mstar-kv authors.
//
// Page epochs: which request owns a page right now, and the readers' check.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

// Every page a KVCachePool hands out is stamped with a fresh 64-bit epoch
// (never reused by that pool; 0 means "free"), and the SequenceInfo the pool
// publishes carries the epoch of its sequence (KVTransferInfo::epoch; the
// pool stamps per sequence, so one epoch covers all its pages). A reader
// checks that every remote page it reads still carries that epoch:
// owner-served engines check before sending, one-sided engines check before
// and after the copy (a seqlock) and fail the read with kStaleDescriptor if
// any page changed owner in between. Where the table lives is the engine's
// business (the shm file after the pages, a registered region beside the
// cache for Mooncake and CUDA IPC, the owner's own table for UCX); the cache
// owns it and the pool writes it.

// A copy of the epoch table where readers of another kind of memory can
// see it (device memory for CUDA IPC readers): PageEpochs::stamp pushes the
// stamped words to it before returning, so the seqlock's writer order holds
// there too. Implementations are thread-safe; push never throws (a failure
// is reported by the implementation: see cuda_ipc.hpp).
class EpochMirror {
 public:
  virtual ~EpochMirror() = default;
  // `words` is the whole host table; `pages` the pages just stamped.
  virtual void push(const std::uint64_t* words,
                    std::span<const std::uint32_t> pages) const noexcept = 0;
};

// A view of num_pages 8-byte epoch words in host memory (owned elsewhere:
// by the KVCache or the memory behind it), optionally mirrored. Thread
// safety: every method is safe from any thread and from other processes
// mapping the same words.
class PageEpochs {
 public:
  PageEpochs() = default;
  PageEpochs(std::uint64_t* words, std::uint32_t num_pages,
             const EpochMirror* mirror = nullptr) noexcept
      : words_(words), num_pages_(num_pages), mirror_(mirror) {}

  std::uint32_t num_pages() const noexcept { return num_pages_; }
  std::uint64_t* words() const noexcept { return words_; }
  std::size_t size_bytes() const noexcept { return std::size_t{num_pages_} * 8; }

  // Owner side: stamps `epoch` on every page, then a full fence, so that
  // a reader that sees any byte written to those pages after this call also
  // sees the new epoch (the seqlock's writer half); with a mirror, the
  // stamped words reach it before this returns. Pages must be in range
  // (the pool checked them).
  void stamp(std::span<const std::uint32_t> pages, std::uint64_t epoch) const noexcept;
  std::uint64_t load(std::uint32_t page) const noexcept;

 private:
  std::uint64_t* words_ = nullptr;
  std::uint32_t num_pages_ = 0;
  const EpochMirror* mirror_ = nullptr;
};

// A first epoch for a writer of an epoch table (KVCachePool, a manager's
// request registry): random in [1, 2^62), so that two writers that ever
// served one cache (a restarted pool over a kept cache) never hand out the
// same epoch, with room to count.
std::uint64_t random_first_epoch();

// Reader side: OK when every page in `pages` carries `expect` in
// `table` (num_pages words: a read-only mapping of the owner's table, or a
// copy fetched from it); else kStaleDescriptor naming the first page that
// changed owner and `when` ("before the copy", "after the copy"). A page
// outside the table is kStaleDescriptor too (the engines bounds-check pages
// against the layout first). Loads are acquire loads; after_copy puts an
// acquire fence before them (the seqlock's reader half).
Status check_page_epochs(const std::uint64_t* table, std::uint32_t num_pages,
                         std::span<const std::uint32_t> pages, std::uint64_t expect,
                         std::string_view when, bool after_copy);

// The message of a stale read, shared by the engines that check elsewhere
// (e.g. the UCX owner): "remote page 7 changed owner before the copy (epoch
// 12, the descriptor's 9): the sequence was freed or its pages reused".
Status stale_page_status(std::uint32_t page, std::uint64_t found, std::uint64_t expect,
                         std::string_view when);

// True for a status made by stale_page_status (possibly with context added
// in front): the read lost a race with the owner's reuse of its pages. Such
// a failure is the transfer's, not the peer's: engines keep the connection.
bool is_page_epoch_failure(const Status& status) noexcept;

// The remote pages of a batch of reads, each once, in order of first
// appearance; `num_pages` is the remote cache's (pages at or beyond it, or
// negative, are kept once, so that the check refuses them). O(reads).
std::vector<std::uint32_t> remote_pages_of(std::span<const KVReadInfo> reads,
                                           std::uint32_t num_pages);

}  // namespace mstar::kv
