// Copyright mstar-kv authors.
//
// Read planning from arbitrary inputs: two layouts (valid or not), a token
// range, two page tables, or a raw list of reads. Planning either throws
// Error or returns a plan whose every span lies inside both caches, whose
// destination spans never overlap, and whose total is the sum of its spans
// and the bytes the reads ask for.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "fuzz_util.hpp"
#include "mstar/kv/core/layout.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/status.hpp"

namespace {

using namespace mstar::kv;

// Mostly small values (cheap plans), sometimes a limit, just past it, 0 or
// the type's maximum.
std::uint32_t pick(FuzzedDataProvider& p, std::uint32_t small_max, std::uint32_t limit) {
  switch (p.ConsumeIntegralInRange<int>(0, 9)) {
    case 0:
      return 0;
    case 1:
      return limit;
    case 2:
      return limit + 1;
    case 3:
      return std::numeric_limits<std::uint32_t>::max();
    default:
      return p.ConsumeIntegralInRange<std::uint32_t>(1, small_max);
  }
}

// One of the three cache orders, now and then one past them (which
// validate() must refuse).
CacheOrder fuzz_cache_order(FuzzedDataProvider& p) {
  const bool wild = p.ConsumeIntegralInRange<int>(0, 15) == 0;
  return static_cast<CacheOrder>(
      p.ConsumeIntegralInRange<std::uint8_t>(0, static_cast<std::uint8_t>(kMaxCacheOrder + wild)));
}

KVLayout fuzz_layout(FuzzedDataProvider& p) {
  KVLayout l;
  l.num_layers = pick(p, 4, LayoutLimits::kMaxLayers);
  l.num_pages = pick(p, 48, LayoutLimits::kMaxPages);
  l.page_size = pick(p, 24, LayoutLimits::kMaxPageSize);
  l.num_kv_heads = pick(p, 6, LayoutLimits::kMaxHeads);
  l.head_dim = pick(p, 64, LayoutLimits::kMaxHeadDim);
  l.dtype = static_cast<DType>(p.ConsumeIntegralInRange<std::uint8_t>(0, 4));
  l.has_v = p.ConsumeBool();
  l.cache_order = fuzz_cache_order(p);
  l.page_order = p.ConsumeBool() ? PageOrder::kHND : PageOrder::kNHD;
  if (p.ConsumeIntegralInRange<int>(0, 3) == 0) {  // a head shard of a bigger model
    l.total_kv_heads = pick(p, 12, LayoutLimits::kMaxHeads);
    l.first_kv_head = p.ConsumeIntegralInRange<std::uint32_t>(0, 8);
  }
  return l;
}

// A remote layout compatible with `local` most of the time, often of
// another geometry (page size, head shard).
KVLayout fuzz_remote(FuzzedDataProvider& p, const KVLayout& local) {
  if (p.ConsumeIntegralInRange<int>(0, 7) == 0) return fuzz_layout(p);
  KVLayout r = local;
  r.num_pages = pick(p, 48, LayoutLimits::kMaxPages);
  r.cache_order = fuzz_cache_order(p);
  r.page_order = p.ConsumeBool() ? PageOrder::kHND : PageOrder::kNHD;
  if (p.ConsumeBool()) r.page_size = pick(p, 24, LayoutLimits::kMaxPageSize);
  if (p.ConsumeBool()) {
    r.total_kv_heads = local.model_kv_heads();
    r.first_kv_head = p.ConsumeIntegralInRange<std::uint32_t>(0, local.first_kv_head);
    r.num_kv_heads =
        local.end_kv_head() - r.first_kv_head + p.ConsumeIntegralInRange<std::uint32_t>(0, 2);
  }
  return r;
}

std::uint64_t pick_len(FuzzedDataProvider& p, std::uint32_t page_size) {
  switch (p.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      return p.ConsumeIntegral<std::uint64_t>();
    case 1:
      return std::numeric_limits<std::uint64_t>::max() -
             p.ConsumeIntegralInRange<std::uint64_t>(0, 64);
    case 2:
      return std::uint64_t{page_size} * p.ConsumeIntegralInRange<std::uint64_t>(0, 40);
    default:
      return p.ConsumeIntegralInRange<std::uint64_t>(0, 600);
  }
}

std::vector<std::uint32_t> fuzz_pages(FuzzedDataProvider& p, std::uint32_t num_pages) {
  std::vector<std::uint32_t> pages(p.ConsumeIntegralInRange<std::size_t>(0, 40));
  for (auto& x : pages) {
    x = p.ConsumeBool() ? p.ConsumeIntegral<std::uint32_t>()
                        : p.ConsumeIntegralInRange<std::uint32_t>(0, num_pages > 0 ? num_pages : 0);
  }
  return pages;
}

// The plan's spans must stay inside both caches and never overlap on the
// destination; its total must be the sum of its spans.
void check_plan(const KVLayout& local, const KVLayout& remote, const CopyPlan& plan) {
  std::uint64_t sum = 0;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> dst;
  dst.reserve(plan.spans.size());
  for (const CopySpan& s : plan.spans) {
    fuzz::require(s.length > 0, "empty span");
    fuzz::require(
        s.local_offset <= local.total_bytes() && s.length <= local.total_bytes() - s.local_offset,
        "span outside the local cache");
    fuzz::require(s.remote_offset <= remote.total_bytes() &&
                      s.length <= remote.total_bytes() - s.remote_offset,
                  "span outside the remote cache");
    sum += s.length;
    dst.emplace_back(s.local_offset, s.local_offset + s.length);
  }
  fuzz::require(sum == plan.total_bytes, "total_bytes is not the sum of the spans");
  fuzz::require(plan.spans.size() <= plan.uncoalesced_spans, "more spans than before coalescing");
  std::sort(dst.begin(), dst.end());
  for (std::size_t i = 1; i < dst.size(); ++i) {
    fuzz::require(dst[i - 1].second <= dst[i].first, "two spans write the same local byte");
  }
  if (!plan.spans.empty()) {
    const std::uint64_t max = std::max<std::uint64_t>(1, plan.total_bytes / 3);
    const auto split = split_spans(plan.spans, max);
    std::uint64_t split_sum = 0;
    for (const CopySpan& s : split) {
      fuzz::require(s.length > 0 && s.length <= max, "split span out of bounds");
      split_sum += s.length;
    }
    fuzz::require(split_sum == sum, "split_spans changed the total");
  }
}

std::uint64_t bytes_of(const KVLayout& l, std::span<const KVReadInfo> reads) {
  std::uint64_t n = 0;
  for (const KVReadInfo& r : reads) {
    const std::uint64_t heads = r.head_start == 0 && r.head_end == 0
                                    ? l.num_kv_heads
                                    : static_cast<std::uint64_t>(r.head_end - r.head_start);
    n += static_cast<std::uint64_t>(r.token_end - r.token_start) * heads * l.head_bytes() *
         l.num_kv();
  }
  return n;
}

// A bound on the spans plan_copies emits, to keep each input cheap (its
// cost is documented: every (token, head) row when the page orders differ).
bool cheap(const KVLayout& local, std::size_t reads) {
  const std::uint64_t per_read =
      std::uint64_t{local.page_size} * local.num_kv_heads * local.num_kv();
  return reads <= 20000 && per_read <= 20000 && reads * per_read <= 400000;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider p(data, size);
  const KVLayout local = fuzz_layout(p);
  const KVLayout remote = fuzz_remote(p, local);
  // Layouts reach the planner validated (KVCache and the descriptor decoders
  // validate them); invalid ones must be rejected by validate() with Error.
  try {
    local.validate();
    remote.validate();
  } catch (const Error& e) {
    fuzz::require(e.code() == StatusCode::kInvalidArgument, "validate threw a non-argument code");
    return 0;
  }
  const bool raw_reads = p.ConsumeBool();
  std::vector<KVReadInfo> reads;
  if (raw_reads) {
    reads.resize(p.ConsumeIntegralInRange<std::size_t>(0, 64));
    for (KVReadInfo& r : reads) {
      // Wild per field, not per read: one wild field among valid ones
      // reaches the checks after the first (a wild remote_token_start
      // overflowed rts + tokens only behind valid layer, pages and tokens).
      auto wild = [&] { return p.ConsumeIntegralInRange<int>(0, 15) == 0; };
      auto v = [&](std::int64_t hi) {
        return wild() ? p.ConsumeIntegral<std::int64_t>()
                      : p.ConsumeIntegralInRange<std::int64_t>(0, hi);
      };
      r.layer_idx = v(local.num_layers);
      r.local_page_idx = v(local.num_pages);
      r.remote_page_idx = v(remote.num_pages);
      r.token_start = v(local.page_size);
      r.token_end = v(local.page_size);
      // -1 (where the local tokens start) up to the remote page's last
      // token, or any value when wild (never v() - 1: INT64_MIN - 1
      // overflowed in the harness, not in the library).
      if (p.ConsumeBool()) {
        r.remote_token_start =
            wild() ? p.ConsumeIntegral<std::int64_t>()
                   : p.ConsumeIntegralInRange<std::int64_t>(-1, std::int64_t{remote.page_size} - 1);
      }
      if (p.ConsumeIntegralInRange<int>(0, 3) == 0) {
        r.head_start = v(local.end_kv_head());
        r.head_end = v(local.end_kv_head() + 1);
      }
    }
  } else {
    const std::uint64_t start = pick_len(p, local.page_size);
    const std::uint64_t end = p.ConsumeBool()
                                  ? start + p.ConsumeIntegralInRange<std::uint64_t>(0, 300)
                                  : pick_len(p, local.page_size);
    const auto lpages = fuzz_pages(p, local.num_pages);
    const auto rpages = fuzz_pages(p, remote.num_pages);
    // plan_reads emits layers x pages: bound it like plan_copies.
    if (std::uint64_t{local.num_layers} * (std::max(lpages.size(), rpages.size()) + 1) > 200000) {
      return 0;
    }
    const bool mixed = p.ConsumeBool();
    const std::uint32_t hlo = p.ConsumeIntegralInRange<std::uint32_t>(0, local.end_kv_head());
    const std::uint32_t hhi = p.ConsumeIntegralInRange<std::uint32_t>(0, local.end_kv_head() + 1);
    try {
      reads = mixed ? plan_reads(local, remote, start, end, lpages, rpages, hlo, hhi)
                    : plan_reads(local, start, end, lpages, rpages);
    } catch (const Error& e) {
      fuzz::require(e.code() == StatusCode::kInvalidArgument ||
                        (mixed && e.code() == StatusCode::kIncompatibleLayout),
                    "plan_reads threw an unexpected code");
      return 0;
    }
    fuzz::require(end >= start, "plan_reads accepted start > end");
    if (start == end) fuzz::require(reads.empty(), "reads for an empty range");
    std::uint64_t tokens = 0;
    for (const KVReadInfo& r : reads) {
      fuzz::require(r.layer_idx >= 0 && r.layer_idx < std::int64_t{local.num_layers}, "read layer");
      fuzz::require(r.local_page_idx >= 0 && r.local_page_idx < std::int64_t{local.num_pages},
                    "read local page");
      fuzz::require(0 <= r.token_start && r.token_start < r.token_end &&
                        r.token_end <= std::int64_t{local.page_size},
                    "read token range");
      tokens += static_cast<std::uint64_t>(r.token_end - r.token_start);
    }
    fuzz::require(tokens == (end - start) * local.num_layers,
                  "reads do not cover [start, end) once per layer");
  }
  if (!cheap(local, reads.size())) return 0;
  CopyPlan plan;
  try {
    plan = plan_copies(local, remote, reads);
  } catch (const Error& e) {
    fuzz::require(
        e.code() == StatusCode::kInvalidArgument || e.code() == StatusCode::kIncompatibleLayout,
        "plan_copies threw an unexpected code");
    return 0;
  }
  check_plan(local, remote, plan);
  fuzz::require(plan.total_bytes == bytes_of(local, reads),
                "plan total != bytes the reads ask for");
  // The strided plan of the same reads: the same bytes, every row inside
  // both caches, and row for row the same destinations as the flat plan.
  const StridedPlan sp = plan_strided_copies(local, remote, reads);
  fuzz::require(sp.total_bytes == plan.total_bytes, "strided plan total != flat plan total");
  std::vector<std::pair<std::uint64_t, std::uint64_t>> rows;
  for (const StridedSpan& s : sp.spans) {
    fuzz::require(s.rows >= 1 && s.length > 0, "empty strided span");
    for (std::uint64_t i = 0; i < s.rows; ++i) {
      const std::uint64_t lo = s.local_offset + i * s.local_stride;
      const std::uint64_t ro = s.remote_offset + i * s.remote_stride;
      fuzz::require(lo <= local.total_bytes() && s.length <= local.total_bytes() - lo,
                    "strided row outside the local cache");
      fuzz::require(ro <= remote.total_bytes() && s.length <= remote.total_bytes() - ro,
                    "strided row outside the remote cache");
      rows.emplace_back(lo, lo + s.length);
    }
  }
  std::sort(rows.begin(), rows.end());
  for (std::size_t i = 1; i < rows.size(); ++i) {
    fuzz::require(rows[i - 1].second <= rows[i].first, "two strided rows write the same byte");
  }
  return 0;
}
