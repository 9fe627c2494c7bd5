// Copyright mstar-kv authors.
//
// Internals shared by the planner's two halves: planner.cpp (caches of one
// geometry) and planner_mixed.cpp (page sizes, head shards).
#pragma once

#include <cstdint>
#include <string>

#include "mstar/kv/layout.hpp"
#include "mstar/kv/planner.hpp"
#include "mstar/kv/read_info.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv::detail {

[[noreturn]] inline void invalid(const std::string& msg) {
  throw Error(StatusCode::kInvalidArgument, msg);
}

// "[lo, hi)".
inline std::string range(std::uint64_t lo, std::uint64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

// Appends spans to a plan, merging each with the previous one when both
// sides continue it.
class SpanSink {
 public:
  explicit SpanSink(CopyPlan& plan) : plan_(plan) {}
  void add(std::uint64_t local, std::uint64_t remote, std::uint64_t len) {
    ++plan_.uncoalesced_spans;
    plan_.total_bytes += len;
    if (!plan_.spans.empty()) {
      CopySpan& last = plan_.spans.back();
      if (last.local_offset + last.length == local &&
          last.remote_offset + last.length == remote) {
        last.length += len;
        return;
      }
    }
    plan_.spans.push_back({local, remote, len});
  }

 private:
  CopyPlan& plan_;
};

// Keeps strided runs whole; contiguous ones coalesce as in SpanSink.
struct StridedSink {
  StridedPlan& plan;
  void add(std::uint64_t l, std::uint64_t r, std::uint64_t len) { add_run(l, r, len, 1); }
  void add_rows(std::uint64_t l, std::uint64_t r, std::uint64_t len, std::uint64_t rows,
                std::uint64_t ls, std::uint64_t rs) {
    if (rows == 1 || (ls == len && rs == len)) {  // the rows touch: one run
      add_run(l, r, len * rows, rows);
      return;
    }
    plan.uncoalesced_spans += rows;
    plan.total_bytes += len * rows;
    plan.spans.push_back({l, r, len, rows, ls, rs});
  }

 private:
  // A contiguous run of `rows` uncoalesced spans, merged with the previous
  // run when both sides continue it.
  void add_run(std::uint64_t l, std::uint64_t r, std::uint64_t len, std::uint64_t rows) {
    plan.uncoalesced_spans += rows;
    plan.total_bytes += len;
    if (!plan.spans.empty()) {
      StridedSpan& last = plan.spans.back();
      if (last.rows == 1 && last.local_offset + last.length == l &&
          last.remote_offset + last.length == r) {
        last.length += len;
        return;
      }
    }
    plan.spans.push_back({l, r, len, 1, 0, 0});
  }
};

// KVLayout::block_offset with the layout's strides computed once: planning
// calls it twice per span, and the layout recomputes block_bytes() (dtype
// size included) on every call.
struct BlockStrides {
  std::uint64_t layer = 0, kv = 0, page = 0;
  explicit BlockStrides(const KVLayout& l) {
    const std::uint64_t bb = l.block_bytes();
    if (l.cache_order == CacheOrder::kLayerMajor) {
      page = bb;
      kv = bb * l.num_pages;
      layer = kv * l.num_kv();
    } else {
      kv = bb;
      layer = bb * l.num_kv();
      page = layer * l.num_layers;
    }
  }
  std::uint64_t offset(std::uint32_t l, KV k, std::uint32_t p) const noexcept {
    return l * layer + static_cast<std::uint64_t>(k) * kv + p * page;
  }
};

// How errors name a read: its index in the caller's read_info
// ("read_info[3]"); KVTransferManager checks the page tables first, naming
// table entries, so its own reads never get here.
inline std::string read_name(std::size_t n) { return "read_info[" + std::to_string(n) + "]"; }

// Calls emit(i, kv) for reads 0..n-1 and each of K|V in the order that
// keeps neighbours of the local cache together: per read in a page-major
// cache (K and V of a layer are neighbours), per run of reads of one layer
// K first then V in a layer-major one.
template <typename LayerOf, typename Emit>
void emit_in_cache_order(const KVLayout& local, std::size_t n, LayerOf layer_of, Emit emit) {
  if (local.cache_order == CacheOrder::kPageMajor) {
    for (std::size_t i = 0; i < n; ++i) {
      for (std::uint32_t k = 0; k < local.num_kv(); ++k) emit(i, static_cast<KV>(k));
    }
    return;
  }
  std::size_t begin = 0;
  while (begin < n) {
    std::size_t end = begin + 1;
    while (end < n && layer_of(end) == layer_of(begin)) ++end;
    for (std::uint32_t k = 0; k < local.num_kv(); ++k) {
      for (std::size_t i = begin; i < end; ++i) emit(i, static_cast<KV>(k));
    }
    begin = end;
  }
}

// plan_copies for caches of one geometry and plain reads, into a strided
// plan (every span rows 1): what plan_strided_copies returns for them.
void plan_plain_strided(const KVLayout& local, const KVLayout& remote,
                        std::span<const KVReadInfo> reads, StridedPlan& out);

// Plain reads (KVReadInfo::plain) between caches of one geometry and
// in-page order: what plan_strided_copies plans with plan_plain_strided.
bool plain_same_geometry(const KVLayout& local, const KVLayout& remote,
                         std::span<const KVReadInfo> reads) noexcept;

// Such a plan in two passes, for engines that plan piece by piece on their
// copy threads: check_plain_reads validates every read exactly as
// plan_copies does (throws what it throws, before anything is planned) and
// returns the reads' bytes and spans before coalescing; emit_plain_strided
// then appends the copies of any run of checked reads to `out` (out's
// totals count them as plan_copies would; coalesced within the run only).
struct PlainTotals {
  std::uint64_t bytes = 0;
  std::uint64_t spans = 0;
};
PlainTotals check_plain_reads(const KVLayout& local, const KVLayout& remote,
                              std::span<const KVReadInfo> reads);
void emit_plain_strided(const KVLayout& local, const KVLayout& remote,
                        std::span<const KVReadInfo> reads, StridedPlan& out);

CopyPlan plan_copies_mixed(const KVLayout& local, const KVLayout& remote,
                           std::span<const KVReadInfo> reads);

}  // namespace mstar::kv::detail
