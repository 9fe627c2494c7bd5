// Copyright mstar-kv authors.
//
// Internals shared by the planner's two halves: planner.cpp (caches of one
// geometry) and planner_mixed.cpp (page sizes, head shards).
#pragma once

#include <cstdint>
#include <string>

#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::detail {

[[noreturn]] inline void invalid(const std::string& msg) {
  throw Error(StatusCode::kInvalidArgument, msg);
}

// "[lo, hi)".
inline std::string range(std::uint64_t lo, std::uint64_t hi) {
  return "[" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

// A copy never crosses a layer boundary of a layer-contiguous cache, on
// either side (such a cache may live in one region per layer: regions.hpp):
// when either layout is layer-contiguous, the sinks below never merge runs
// of two layers. The emitters name the layer of the runs they add
// (at_layer); for two page-major caches nothing is fenced.
inline bool fence_layers(const KVLayout& local, const KVLayout& remote) noexcept {
  return local.layer_contiguous() || remote.layer_contiguous();
}

// Appends spans to a plan, merging each with the previous one when both
// sides continue it (and, fenced, it is of the same layer).
class SpanSink {
 public:
  SpanSink(CopyPlan& plan, bool fence) : plan_(plan), fence_(fence) {}
  void at_layer(std::uint32_t layer) noexcept { layer_ = layer; }
  void add(std::uint64_t local, std::uint64_t remote, std::uint64_t len) {
    ++plan_.uncoalesced_spans;
    plan_.total_bytes += len;
    if (!plan_.spans.empty() && (!fence_ || layer_ == last_layer_)) {
      CopySpan& last = plan_.spans.back();
      if (last.local_offset + last.length == local && last.remote_offset + last.length == remote) {
        last.length += len;
        return;
      }
    }
    plan_.spans.push_back({local, remote, len});
    last_layer_ = layer_;
  }

 private:
  CopyPlan& plan_;
  bool fence_ = false;
  std::uint32_t layer_ = 0;
  std::uint32_t last_layer_ = 0;
};

// Keeps strided runs whole; contiguous ones coalesce as in SpanSink.
struct StridedSink {
  StridedPlan& plan;
  bool fence = false;  // fence_layers(local, remote)
  std::uint32_t layer = 0;
  std::uint32_t last_layer = 0;

  void at_layer(std::uint32_t l) noexcept { layer = l; }
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
    last_layer = layer;
  }

 private:
  // A contiguous run of `rows` uncoalesced spans, merged with the previous
  // run when both sides continue it.
  void add_run(std::uint64_t l, std::uint64_t r, std::uint64_t len, std::uint64_t rows) {
    plan.uncoalesced_spans += rows;
    plan.total_bytes += len;
    if (!plan.spans.empty() && (!fence || layer == last_layer)) {
      StridedSpan& last = plan.spans.back();
      if (last.rows == 1 && last.local_offset + last.length == l &&
          last.remote_offset + last.length == r) {
        last.length += len;
        return;
      }
    }
    plan.spans.push_back({l, r, len, 1, 0, 0});
    last_layer = layer;
  }
};

// KVLayout::block_offset with the layout's strides computed once: planning
// calls it twice per span, and the layout recomputes block_bytes() (dtype
// size included) on every call.
struct BlockStrides {
  std::uint64_t layer = 0, kv = 0, page = 0;
  explicit BlockStrides(const KVLayout& l) {
    const std::uint64_t bb = l.block_bytes();
    switch (l.cache_order) {
      case CacheOrder::kLayerMajor:
        page = bb;
        kv = bb * l.num_pages;
        layer = kv * l.num_kv();
        break;
      case CacheOrder::kPageMajor:
        kv = bb;
        layer = bb * l.num_kv();
        page = layer * l.num_layers;
        break;
      case CacheOrder::kLayerPage:
        kv = bb;
        page = bb * l.num_kv();
        layer = page * l.num_pages;
        break;
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

// The checks every read passes in both planners before anything is
// planned: its layer, both pages and its tokens of the local page in
// range. Inline: planning checks millions of reads, and builds a message
// only on the error path.
inline void check_read(const KVLayout& local, const KVLayout& remote, const KVReadInfo& r,
                       std::size_t n) {
  auto where = [n] { return read_name(n) + ": "; };
  if (r.layer_idx < 0 || r.layer_idx >= std::int64_t{local.num_layers}) {
    invalid(where() + "layer " + std::to_string(r.layer_idx) + " out of range " +
            range(0, local.num_layers));
  }
  if (r.local_page_idx < 0 || r.local_page_idx >= std::int64_t{local.num_pages}) {
    invalid(where() + "local page " + std::to_string(r.local_page_idx) + " out of range " +
            range(0, local.num_pages) + " in local cache");
  }
  if (r.remote_page_idx < 0 || r.remote_page_idx >= std::int64_t{remote.num_pages}) {
    invalid(where() + "remote page " + std::to_string(r.remote_page_idx) + " out of range " +
            range(0, remote.num_pages) + " in remote cache");
  }
  if (r.token_start < 0 || r.token_start >= r.token_end ||
      r.token_end > std::int64_t{local.page_size}) {
    invalid(where() + "token range [" + std::to_string(r.token_start) + ", " +
            std::to_string(r.token_end) +
            ") must satisfy 0 <= start < end <= " + std::to_string(local.page_size));
  }
}

// Reads are listed page by page (every layer of a page before the next
// page) for a page-major local cache, layer by layer for the other two:
// the order in which neighbouring pages of the local cache follow each
// other.
inline bool pages_outer(const KVLayout& local) noexcept {
  return local.cache_order == CacheOrder::kPageMajor;
}

// Calls emit(i, kv) for reads 0..n-1 and each of K|V in the order that
// keeps neighbours of the local cache together. Reads come in runs of one
// destination block row: one layer in a layer-major cache (all K blocks of a
// layer are neighbours), one (layer, local page) in the other two (K and V
// of a page are neighbours; a run is longer than one read where several
// remote pages fill one local page). Each run emits its K first, then its
// V. key_of(i) is the read's (layer, local page).
template <typename KeyOf, typename Emit>
void emit_in_cache_order(const KVLayout& local, std::size_t n, KeyOf key_of, Emit emit) {
  const bool by_layer = local.cache_order == CacheOrder::kLayerMajor;
  auto same_run = [&](std::size_t a, std::size_t b) {
    const auto [la, pa] = key_of(a);
    const auto [lb, pb] = key_of(b);
    return la == lb && (by_layer || pa == pb);
  };
  std::size_t begin = 0;
  while (begin < n) {
    std::size_t end = begin + 1;
    while (end < n && same_run(end, begin)) ++end;
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
