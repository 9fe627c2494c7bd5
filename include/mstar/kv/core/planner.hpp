// Copyright mstar-kv authors.
//
// Read planning: token ranges -> KVReadInfo per (layer, page) -> coalesced
// byte copies between two layouts. Pure functions, safe from any thread.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/read_info.hpp"

namespace mstar::kv {

// Cost: plan_reads is O(layers x pages touched); plan_copies is O(reads) when
// both sides use the same in-page order (a partial page in HND adds one span
// per head) and O(reads x tokens x heads) when the in-page orders differ
// (every (token, head) row is its own span; plan_strided_copies avoids that).
// Both allocate their output once.

// Reads for tokens [start_len, end_len) of a sequence whose page table is
// `local_pages` here and `remote_pages` there, for every layer, with the first
// and last page clipped. Emitted in the local cache's order (page-major:
// page, then layer; layer-major and layer_page: layer, then page) so that
// contiguous page tables coalesce into the fewest copies.
// Throws Error(kInvalidArgument) when start_len > end_len, a page table is
// shorter than end_len needs (ceil(end_len / page_size) entries), or a local
// page of the entries the range touches is out of range or named twice; the
// message names the table entry and the page. An empty range
// (start_len == end_len) passes the same checks (the entry it touches is
// that of the page holding start_len when start_len is mid-page; none when
// it is page-aligned), then returns an empty vector.
std::vector<KVReadInfo> plan_reads(const KVLayout& local, std::uint64_t start_len,
                                   std::uint64_t end_len,
                                   std::span<const std::uint32_t> local_pages,
                                   std::span<const std::uint32_t> remote_pages);

// The local half of plan_reads' checks: `local_pages` covers tokens
// [start_len, end_len) at the local page size and names pages of the cache.
// Throws what plan_reads throws for them.
void check_local_pages(const KVLayout& local, std::uint64_t start_len, std::uint64_t end_len,
                       std::span<const std::uint32_t> local_pages);

// The same for caches of different geometry (layout.hpp): tokens map by
// their position in the sequence, each side's page table in its own page
// size (a read never crosses a page boundary on either side: 16 -> 24
// splits where either side's pages end); only model heads [head_lo,
// head_hi) are read (0, 0: every head of the local cache, which the remote
// must then hold). Throws Error(kIncompatibleLayout) naming the field when
// the layouts cannot be read into each other, and what plan_reads throws.
// With one geometry on both sides and every head, the same as plan_reads.
std::vector<KVReadInfo> plan_reads(const KVLayout& local, const KVLayout& remote,
                                   std::uint64_t start_len, std::uint64_t end_len,
                                   std::span<const std::uint32_t> local_pages,
                                   std::span<const std::uint32_t> remote_pages,
                                   std::uint32_t head_lo = 0, std::uint32_t head_hi = 0);

// What plan_copies would refuse about the remote side of the same pull,
// named by the caller's table entries: throws Error(kIncompatibleLayout)
// unless local.check_compatible(remote), Error(kInvalidArgument) naming the
// entry and the page when a remote page the range touches is out of range
// ("remote page 64 (table entry 2) out of range [0, 64) in remote cache").
// Entries past the table's end are plan_reads' to name.
void check_remote_pages(const KVLayout& local, const KVLayout& remote, std::uint64_t start_len,
                        std::uint64_t end_len, std::span<const std::uint32_t> remote_pages);

// One contiguous copy: `length` bytes from remote_offset (a layout offset
// of the remote cache) to local_offset (of the local cache). The planners
// below never emit a copy (nor a strided span's row run) that crosses a
// layer boundary of a layout that is layer_contiguous(), on either side,
// so that a cache of one region per layer (regions.hpp) maps every copy
// from its first byte; runs of two layers merge only between two
// page-major caches.
struct CopySpan {
  std::uint64_t local_offset = 0;
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;

  bool operator==(const CopySpan&) const = default;
};

struct CopyPlan {
  std::vector<CopySpan> spans;  // coalesced, in read order
  std::uint64_t total_bytes = 0;
  std::uint64_t uncoalesced_spans = 0;  // spans before coalescing
};

// Validates every read against both layouts (layer, local and remote page,
// token range, duplicate (layer, local page) destinations) and the layouts'
// compatibility, then emits the byte copies, merging neighbours that are
// contiguous on both sides. Throws Error before returning anything; a bad
// read is named by its index ("read_info[3]: remote page 70 out of range"). Reads
// between caches of different geometry (or naming remote token positions or
// heads) copy only the heads both hold, token by token or head by head as
// the in-page orders allow; there two reads may fill different tokens or
// heads of one (layer, local page), never the same bytes.
CopyPlan plan_copies(const KVLayout& local, const KVLayout& remote,
                     std::span<const KVReadInfo> reads);

// `rows` runs of `length` bytes, the i-th from remote_offset + i *
// remote_stride to local_offset + i * local_stride (strides 0 when rows is
// 1): "N rows of L bytes, stride A on one side and B on the other" as one
// span, what a change of in-page order or head shard produces.
struct StridedSpan {
  std::uint64_t local_offset = 0;
  std::uint64_t remote_offset = 0;
  std::uint64_t length = 0;  // of one row
  std::uint64_t rows = 1;
  std::uint64_t local_stride = 0;
  std::uint64_t remote_stride = 0;

  std::uint64_t bytes() const noexcept { return length * rows; }
  bool operator==(const StridedSpan&) const = default;
};

struct StridedPlan {
  std::vector<StridedSpan> spans;  // in read order; contiguous ones coalesced
  std::uint64_t total_bytes = 0;
  std::uint64_t uncoalesced_spans = 0;  // rows before coalescing
};

// plan_copies for engines that copy strided spans natively (shm): the same
// validation and bytes, but a layout change costs one span per (read, k|v)
// (NHD <-> NHD head split, HND <-> HND), or per (read, k|v, head) (NHD <->
// HND), never one per (token, head) row. Caches of one geometry and order
// get plan_copies' coalesced spans (rows 1).
StridedPlan plan_strided_copies(const KVLayout& local, const KVLayout& remote,
                                std::span<const KVReadInfo> reads);

// Layer boundaries a merge of two copies must not cross: each side's
// layer_bytes() when its layout is layer_contiguous(), else 0 (none).
struct LayerBounds {
  std::uint64_t local = 0;
  std::uint64_t remote = 0;

  static LayerBounds of(const KVLayout& local, const KVLayout& remote) noexcept {
    return {local.layer_contiguous() ? local.layer_bytes() : 0,
            remote.layer_contiguous() ? remote.layer_bytes() : 0};
  }
  // True when a copy starting at these offsets starts a layer on a fenced
  // side: it must not be merged into the copy before it.
  bool starts_layer(std::uint64_t local_offset, std::uint64_t remote_offset) const noexcept {
    return (local != 0 && local_offset % local == 0) ||
           (remote != 0 && remote_offset % remote == 0);
  }
};

// The rows of strided spans as contiguous copies, in order (span by span,
// row by row), merging a row into the one before when both sides continue
// it and it does not start a layer of `bounds` (LayerBounds::of(local,
// remote) for spans planned between those layouts): what an engine without
// a strided form posts (plan_copies' spans for the same reads, up to that
// merging). Deterministic, so two ends that expand the same spans number
// the same rows.
std::vector<CopySpan> strided_rows(std::span<const StridedSpan> spans, LayerBounds bounds = {});

// Splits spans longer than max_bytes (> 0) into pieces of at most max_bytes,
// e.g. to spread one large copy over several workers.
std::vector<CopySpan> split_spans(std::span<const CopySpan> spans, std::uint64_t max_bytes);

}  // namespace mstar::kv
