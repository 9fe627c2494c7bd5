// Copyright mstar-kv authors.
//
// KVCachePool: page allocation per sequence over one KVCache, and publish().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv {

// Thread safety: every method is safe from any thread (one internal mutex).
// Errors: exhaustion throws Error(kRetryLater); a sequence larger than the
// whole cache, double allocation of a sequence, double frees and free_pages
// of a page a live sequence holds throw Error(kInvalidArgument), and so does
// release of an unknown sequence (never allocated or already released: a
// double free); pages and publish of an unknown sequence throw
// Error(kNotFound). A call that throws changes nothing.
//
// Epochs and leases (epochs.hpp): every allocation stamps its pages with a
// fresh epoch in the cache's epoch table (a freed page is stamped 0), and
// publish() puts that epoch on the SequenceInfo, so a reader whose pages
// were freed or reused fails with kStaleDescriptor instead of reading
// another request's KV. A published sequence is leased: unless done() or
// release() frees it first, it is freed once `lease` has passed since its
// first publish(). Expired leases are reaped by expire_leases() and at the
// start of allocate(), allocate_pages() and publish(); a
// pull after that fails with kStaleDescriptor.
//
// Shared pages (prefix caching, docs/correctness.md): adopt(..., allow_shared
// = true) lets a sequence hold pages another live sequence holds. A page
// counts its holders; its epoch names its content, not its owner: a shared
// page keeps the epoch it had (publish() lists it in the descriptor's
// page_epochs), stays stamped while any holder keeps it, and is freed
// (stamped 0, then reusable with a fresh epoch) only when its last holder
// goes (release, done, lease expiry). So freeing one sequence never makes
// a read of another fail or read wrong bytes. A page's readiness only rises
// while it is held: marking layers of one holder never lowers what another
// marked, and sharing a page does not reset it.
class KVCachePool {
 public:
  // How long a published sequence stays readable without a done notice.
  static constexpr std::chrono::milliseconds kDefaultLease{60000};

  // `descriptor` (usually KVTransferManager::get_kv_transfer_info()) is
  // stamped onto every published SequenceInfo. With scatter_seed != 0 the
  // free list is shuffled deterministically, so sequences get scattered
  // pages as they do in a long-running engine; with 0 pages are handed out
  // in ascending order. lease 0 = published sequences never expire; a
  // negative lease throws Error(kInvalidArgument).
  KVCachePool(std::shared_ptr<KVCache> cache, KVTransferInfo descriptor,
              std::uint64_t scatter_seed = 0, std::chrono::milliseconds lease = kDefaultLease);

  const KVCache& cache() const noexcept { return *cache_; }

  // Pages for a new sequence of num_tokens tokens: ceil(num_tokens/page_size)
  // (any num_tokens, up to 2^64 - 1, is checked against the cache's size).
  std::vector<std::uint32_t> allocate(std::uint64_t seq_id, std::uint64_t num_tokens);
  // A new sequence over pages the caller chose (an engine that allocates its
  // own blocks, such as vLLM, publishing a finished request's blocks):
  // exactly ceil(num_tokens / page_size) pages, each in range and named
  // once. The sequence gets a fresh epoch (its own, which done() takes),
  // stamped on its free pages as allocate() does; it is then released,
  // published, marked and leased as any other.
  // Without allow_shared every page must be free in this pool. With it, a
  // page a live sequence holds (adopted or allocated) is shared: it gains a
  // holder and keeps its epoch, its readiness and its bytes (the caller
  // asserts the content is the one published, as an engine's prefix cache
  // does for full blocks it no longer writes).
  // Throws Error(kInvalidArgument) naming the page or the counts, and
  // changes nothing, when a page is out of range, named twice, held by
  // allocate_pages, or (without allow_shared) held by a live sequence.
  // `epoch` (0: the pool picks) is the caller's choice of the sequence's
  // epoch, so that a descriptor can be predicted before the pool publishes
  // (vLLM's scheduler names it in a request's params); it must be at least
  // every epoch this pool stamped before (epochs only rise, none is
  // reused), else Error(kInvalidArgument) naming both.
  void adopt(std::uint64_t seq_id, std::uint64_t num_tokens, std::span<const std::uint32_t> pages,
             bool allow_shared = false, std::uint64_t epoch = 0);
  // Drops the sequence's hold on its pages; those no other sequence holds
  // are freed. A sequence whose lease expired was freed already: releasing
  // it again is a no-op.
  void release(std::uint64_t seq_id);
  // A reader's done notice: releases the sequence if it is still the one
  // published with `epoch` (0: whichever holds seq_id). False when it was
  // freed already (released, expired) or seq_id now names a newer sequence.
  bool done(std::uint64_t seq_id, std::uint64_t epoch = 0);
  // How many live sequences hold `page` (0: free or allocate_pages');
  // throws Error(kInvalidArgument) for a page out of range.
  std::uint32_t holders(std::uint32_t page) const;
  // Frees every published sequence whose lease has expired; returns how
  // many.
  std::size_t expire_leases();
  std::chrono::milliseconds lease() const noexcept { return lease_; }
  // Sequences freed by lease expiry since construction.
  std::uint64_t expired_count() const;
  // SequenceInfos published (publish calls that returned), and done
  // notices taken (done calls, whether or not they freed), since
  // construction: the owner side of KVTransferManager::stats().
  std::uint64_t published_count() const;
  std::uint64_t done_count() const;
  bool contains(std::uint64_t seq_id) const;
  std::vector<std::uint32_t> pages(std::uint64_t seq_id) const;

  // Low level: pages not tied to a sequence id. free_pages takes only pages
  // that allocate_pages handed out; a sequence's pages go back by release().
  std::vector<std::uint32_t> allocate_pages(std::size_t count);
  void free_pages(std::span<const std::uint32_t> pages);

  std::size_t free_page_count() const;

  // The SequenceInfo another process needs to pull this sequence: the
  // pages, the descriptor with the sequence's epoch (and, in page_epochs,
  // the pages it shares that carry an earlier one), the lease expiry. The
  // first publish starts the lease.
  SequenceInfo publish(std::uint64_t seq_id);

  // Layer-wise streaming (readiness.hpp, streaming.hpp). publish(seq_id)
  // above declares the sequence written: it marks every layer ready.
  // publish(seq_id, layers_ready) publishes it before its layers are
  // written (layers_ready usually 0), for readers that stream; the owner
  // then calls mark_layers_ready after each layer. Same errors as
  // mark_layers_ready, plus those of publish.
  SequenceInfo publish(std::uint64_t seq_id, std::uint32_t layers_ready);
  // Layers [0, layers_done) of the sequence hold their final bytes: stamped
  // on every page of it whose readiness is lower (a shared page another
  // holder marked further keeps its count), where the cache's readers see
  // it (the shm file, for shm readers). Cheap enough for every layer of a forward pass: the
  // pool's mutex and one store per page, no syscall. Monotonic: a value
  // equal to the current one is a no-op; a smaller one, or one beyond the
  // layout's num_layers, throws Error(kInvalidArgument) naming both values;
  // an unknown sequence throws Error(kNotFound). Need not follow publish.
  void mark_layers_ready(std::uint64_t seq_id, std::uint32_t layers_done);
  // What mark_layers_ready (or publish) last stamped; throws kNotFound.
  std::uint32_t layers_ready(std::uint64_t seq_id) const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Sequence {
    std::uint64_t num_tokens = 0;
    std::vector<std::uint32_t> pages;
    std::uint64_t epoch = 0;
    // Pages adopted shared, with the epoch they kept (sorted by page): the
    // descriptor's page_epochs.
    std::vector<PageEpoch> shared;
    std::uint32_t layers_ready = 0;
    bool leased = false;
    Clock::time_point expiry{};
    std::uint64_t expiry_unix_ms = 0;
  };
  // in_use_ marks (kSharing: an owned page seen once in the adopt call
  // being checked).
  static constexpr std::uint8_t kFree = 0, kLoose = 1, kOwned = 2, kFreeing = 3, kSharing = 4;
  std::vector<std::uint32_t> allocate_locked(std::size_t count) MSTAR_KV_REQUIRES(mu_);
  void free_locked(std::span<const std::uint32_t> pages, std::uint8_t owner) MSTAR_KV_REQUIRES(mu_);
  // Drops one hold on each of a sequence's pages; frees those left unheld.
  void drop_locked(const Sequence& s) MSTAR_KV_REQUIRES(mu_);
  std::size_t expire_locked(Clock::time_point now) MSTAR_KV_REQUIRES(mu_);
  void mark_locked(std::uint64_t seq_id, Sequence& s, std::uint32_t layers_done)
      MSTAR_KV_REQUIRES(mu_);
  SequenceInfo publish_locked(std::uint64_t seq_id, const std::uint32_t* layers_ready)
      MSTAR_KV_REQUIRES(mu_);

  std::shared_ptr<KVCache> cache_;
  KVTransferInfo descriptor_;
  mutable std::mutex mu_;
  std::vector<std::uint32_t> free_ MSTAR_KV_GUARDED_BY(mu_);     // back() is next
  std::vector<std::uint8_t> in_use_ MSTAR_KV_GUARDED_BY(mu_);    // one mark per page
  std::vector<std::uint32_t> holders_ MSTAR_KV_GUARDED_BY(mu_);  // sequences per kOwned page
  std::unordered_map<std::uint64_t, Sequence> sequences_ MSTAR_KV_GUARDED_BY(mu_);
  std::chrono::milliseconds lease_;
  std::uint64_t next_epoch_ MSTAR_KV_GUARDED_BY(mu_) = 1;  // above every epoch stamped
  bool stamped_any_ MSTAR_KV_GUARDED_BY(mu_) = false;      // else any epoch may start it
  Clock::time_point next_expiry_ MSTAR_KV_GUARDED_BY(mu_) = Clock::time_point::max();
  std::uint64_t expired_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  std::uint64_t published_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  std::uint64_t done_notices_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  std::unordered_set<std::uint64_t> expired_ids_ MSTAR_KV_GUARDED_BY(mu_);  // bounded
};

}  // namespace mstar::kv
