// Copyright mstar-kv authors.
//
// Planning between caches of different geometry (layout.hpp): page sizes
// that differ (tokens map by their position in the sequence), head shards
// (tensor-parallel splits and merges: only the heads both sides hold move),
// and in-page orders. plan_copies hands reads that need it here.
#include <algorithm>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/status.hpp"
#include "planner_detail.hpp"

namespace mstar::kv {

namespace {

using detail::invalid;
using detail::range;

std::uint64_t pages_for(std::uint64_t tokens, std::uint64_t page_size) {
  return tokens / page_size + (tokens % page_size != 0 ? 1 : 0);
}

// A page table (`side` "local" or "remote") covers tokens [0, end_len) and
// names pages of `layout` from the one holding start_len on; `where` ends
// the out-of-range message.
void check_page_table(std::string_view side, const KVLayout& layout, std::uint64_t start_len,
                      std::uint64_t end_len, std::span<const std::uint32_t> pages,
                      std::string_view where) {
  const std::uint64_t ps = layout.page_size;
  const std::uint64_t need = pages_for(end_len, ps);
  if (pages.size() < need) {
    invalid(std::string(side) + " page table has " + std::to_string(pages.size()) + " entries of " +
            std::to_string(ps) + " tokens, tokens " + range(start_len, end_len) + " need " +
            std::to_string(need));
  }
  for (std::uint64_t i = start_len / ps; i < need; ++i) {
    if (pages[i] >= layout.num_pages) {
      invalid(std::string(side) + " page " + std::to_string(pages[i]) + " (table entry " +
              std::to_string(i) + ") out of range " + range(0, layout.num_pages) +
              std::string(where));
    }
  }
}

// A read's resolved fields.
struct Resolved {
  std::uint32_t layer, lpage, rpage, ts, te, rts, hs, he;
};

}  // namespace

void check_local_pages(const KVLayout& local, std::uint64_t start_len, std::uint64_t end_len,
                       std::span<const std::uint32_t> local_pages) {
  if (start_len > end_len) {
    invalid("start_len " + std::to_string(start_len) + " is greater than end_len " +
            std::to_string(end_len));
  }
  check_page_table("local", local, start_len, end_len, local_pages, "");
}

std::vector<KVReadInfo> plan_reads(const KVLayout& local, const KVLayout& remote,
                                   std::uint64_t start_len, std::uint64_t end_len,
                                   std::span<const std::uint32_t> local_pages,
                                   std::span<const std::uint32_t> remote_pages,
                                   std::uint32_t head_lo, std::uint32_t head_hi) {
  if (head_lo != 0 || head_hi != 0)
    local.check_shard(remote, head_lo, head_hi);
  else
    local.check_compatible(remote);
  const bool all_heads = (head_lo == 0 && head_hi == 0) ||
                         (head_lo == local.first_kv_head && head_hi == local.end_kv_head());
  if (local.page_size == remote.page_size && all_heads) {
    return plan_reads(local, start_len, end_len, local_pages, remote_pages);
  }
  check_local_pages(local, start_len, end_len, local_pages);
  std::vector<KVReadInfo> reads;
  const std::uint64_t lps = local.page_size, rps = remote.page_size;
  check_page_table("remote", remote, start_len, end_len, remote_pages, " in remote cache");
  if (start_len == end_len) return reads;  // validated all the same
  // Segments: token runs that stay inside one page on both sides.
  struct Segment {
    std::uint64_t li, ri, ts, te, rts;
  };
  std::vector<Segment> segs;
  for (std::uint64_t pos = start_len; pos < end_len;) {
    const std::uint64_t li = pos / lps, ri = pos / rps;
    const std::uint64_t end = std::min({end_len, (li + 1) * lps, (ri + 1) * rps});
    segs.push_back({li, ri, pos - li * lps, end - li * lps, pos - ri * rps});
    pos = end;
  }
  const auto hs = static_cast<std::int64_t>(all_heads ? 0 : head_lo);
  const auto he = static_cast<std::int64_t>(all_heads ? 0 : head_hi);
  reads.reserve(segs.size() * local.num_layers);
  auto emit = [&](std::uint32_t layer, const Segment& s) {
    reads.push_back({layer, local_pages[s.li], remote_pages[s.ri], static_cast<std::int64_t>(s.ts),
                     static_cast<std::int64_t>(s.te),
                     lps == rps ? -1 : static_cast<std::int64_t>(s.rts), hs, he});
  };
  if (detail::pages_outer(local)) {
    for (const Segment& s : segs) {
      for (std::uint32_t layer = 0; layer < local.num_layers; ++layer) emit(layer, s);
    }
  } else {
    for (std::uint32_t layer = 0; layer < local.num_layers; ++layer) {
      for (const Segment& s : segs) emit(layer, s);
    }
  }
  return reads;
}

namespace detail {

namespace {

// Validates every read (pass 1 of both plans): throws before anything is
// emitted.
std::vector<Resolved> resolve_reads(const KVLayout& local, const KVLayout& remote,
                                    std::span<const KVReadInfo> reads) {
  std::vector<Resolved> rs(reads.size());
  std::uint32_t checked_lo = 0, checked_hi = 0;
  // Pass 1: validate every read before emitting anything.
  for (std::size_t n = 0; n < reads.size(); ++n) {
    const KVReadInfo& r = reads[n];
    auto where = [&] { return detail::read_name(n) + ": "; };
    detail::check_read(local, remote, r, n);
    // The tokens (1 to the local page size of them, checked above) must fit
    // the remote page from rts on. Compared without forming rts + count: a
    // remote_token_start near INT64_MAX overflowed (UB), wrapped negative and
    // passed, and the read landed outside the remote page (fuzz_plan,
    // regress-remote-token-start-overflow).
    const std::int64_t rts = r.remote_token_start < 0 ? r.token_start : r.remote_token_start;
    const std::int64_t count = r.token_end - r.token_start;
    if (rts > std::int64_t{remote.page_size} - count) {
      invalid(where() + "remote tokens [" + std::to_string(rts) + ", " +
              std::to_string(static_cast<std::uint64_t>(rts) + static_cast<std::uint64_t>(count)) +
              ") do not fit in a remote page of " + std::to_string(remote.page_size) + " tokens");
    }
    std::int64_t hs = r.head_start, he = r.head_end;
    if (hs == 0 && he == 0) {
      hs = local.first_kv_head;
      he = local.end_kv_head();
    }
    if (hs < 0 || he > std::int64_t{local.end_kv_head()} || hs >= he) {
      invalid(where() + "heads " +
              range(static_cast<std::uint64_t>(std::max<std::int64_t>(hs, 0)),
                    static_cast<std::uint64_t>(std::max<std::int64_t>(he, 0))) +
              " are not a part of the local cache's heads " +
              range(local.first_kv_head, local.end_kv_head()));
    }
    const auto lo = static_cast<std::uint32_t>(hs), hi = static_cast<std::uint32_t>(he);
    if (lo != checked_lo || hi != checked_hi) {
      local.check_shard(remote, lo, hi);  // layers, dtype, ..., and the remote holds them
      checked_lo = lo;
      checked_hi = hi;
    }
    rs[n] = {static_cast<std::uint32_t>(r.layer_idx),
             static_cast<std::uint32_t>(r.local_page_idx),
             static_cast<std::uint32_t>(r.remote_page_idx),
             static_cast<std::uint32_t>(r.token_start),
             static_cast<std::uint32_t>(r.token_end),
             static_cast<std::uint32_t>(rts),
             lo,
             hi};
  }
  // Two reads may share a (layer, local page) when they fill different
  // tokens or heads of it (a 64-token page from four 16-token ones); never
  // the same bytes twice.
  {
    // Sorted by (layer, local page, first token): a compact key per read,
    // compared directly (an index sort through rs costs 5x more).
    struct Key {
      std::uint64_t page;  // layer * num_pages + local page
      std::uint32_t ts;
      std::uint32_t index;
      bool operator<(const Key& o) const noexcept {
        return page != o.page ? page < o.page : ts < o.ts;
      }
    };
    std::vector<Key> order(rs.size());
    for (std::size_t i = 0; i < rs.size(); ++i) {
      order[i] = {std::uint64_t{rs[i].layer} * local.num_pages + rs[i].lpage, rs[i].ts,
                  static_cast<std::uint32_t>(i)};
    }
    std::sort(order.begin(), order.end());
    for (std::size_t i = 0; i < order.size();) {
      std::size_t j = i + 1;
      while (j < order.size() && order[j].page == order[i].page) ++j;
      for (std::size_t a = i; a < j; ++a) {
        for (std::size_t b = a + 1; b < j; ++b) {
          const Resolved &x = rs[order[a].index], &y = rs[order[b].index];
          if (y.ts >= x.te) break;  // sorted by ts: no later one overlaps x's tokens
          if (x.hs < y.he && y.hs < x.he) {
            invalid(detail::read_name(order[b].index) + ": duplicate destination: layer " +
                    std::to_string(y.layer) + " local page " + std::to_string(y.lpage) +
                    " tokens " + range(y.ts, y.te) + " overlap another read's " +
                    range(x.ts, x.te) + " in one batch");
          }
        }
      }
      i = j;
    }
  }

  return rs;
}

// Emits the copies of resolved reads into `sink` (add(local, remote, len)
// for one contiguous run; add_rows(local, remote, len, rows, local_stride,
// remote_stride) for `rows` runs of `len` bytes at constant strides, which a
// flat sink takes run by run).
template <typename Sink>
void emit_reads(const KVLayout& local, const KVLayout& remote, const std::vector<Resolved>& rs,
                Sink& sink) {
  const std::uint64_t hb = local.head_bytes();
  const bool lnhd = local.page_order == PageOrder::kNHD;
  const bool rnhd = remote.page_order == PageOrder::kNHD;
  // One token's row of every head read is contiguous in NHD, one head's
  // tokens in HND.
  const std::uint64_t lrow = lnhd ? std::uint64_t{local.num_kv_heads} * hb : hb;  // next token
  const std::uint64_t rrow = rnhd ? std::uint64_t{remote.num_kv_heads} * hb : hb;
  const std::uint64_t lhead = lnhd ? hb : std::uint64_t{local.page_size} * hb;  // next head
  const std::uint64_t rhead = rnhd ? hb : std::uint64_t{remote.page_size} * hb;
  const detail::BlockStrides lstr(local);
  const detail::BlockStrides rstr(remote);
  auto emit = [&](const Resolved& r, KV kv) {
    const std::uint32_t lh = r.hs - local.first_kv_head, rh = r.hs - remote.first_kv_head;
    const std::uint32_t nh = r.he - r.hs, nt = r.te - r.ts;
    sink.at_layer(r.layer);
    // block_offset + in_block_offset, with the strides taken once.
    const std::uint64_t l0 = lstr.offset(r.layer, kv, r.lpage) + r.ts * lrow + lh * lhead;
    const std::uint64_t r0 = rstr.offset(r.layer, kv, r.rpage) + r.rts * rrow + rh * rhead;
    if (lnhd && rnhd) {  // per token: its run of heads
      sink.add_rows(l0, r0, std::uint64_t{nh} * hb, nt, lrow, rrow);
    } else if (!lnhd && !rnhd) {  // per head: its run of tokens
      sink.add_rows(l0, r0, std::uint64_t{nt} * hb, nh, lhead, rhead);
    } else {  // NHD <-> HND: per head, every token's row on its own
      for (std::uint32_t h = 0; h < nh; ++h) {
        sink.add_rows(l0 + h * lhead, r0 + h * rhead, hb, nt, lrow, rrow);
      }
    }
  };
  detail::emit_in_cache_order(
      local, rs.size(),
      [&](std::size_t i) {
        return std::pair{rs[i].layer, rs[i].lpage};
      },
      [&](std::size_t i, KV kv) { emit(rs[i], kv); });
}

// Takes strided runs one by one (a CopyPlan has no strides).
struct FlatSink {
  SpanSink& sink;
  void at_layer(std::uint32_t layer) noexcept { sink.at_layer(layer); }
  void add_rows(std::uint64_t l, std::uint64_t r, std::uint64_t len, std::uint64_t rows,
                std::uint64_t ls, std::uint64_t rs) {
    for (std::uint64_t i = 0; i < rows; ++i) sink.add(l + i * ls, r + i * rs, len);
  }
};

}  // namespace

CopyPlan plan_copies_mixed(const KVLayout& local, const KVLayout& remote,
                           std::span<const KVReadInfo> reads) {
  const std::vector<Resolved> rs = resolve_reads(local, remote, reads);
  CopyPlan plan;
  SpanSink sink(plan, fence_layers(local, remote));
  FlatSink flat{sink};
  emit_reads(local, remote, rs, flat);
  return plan;
}

}  // namespace detail

StridedPlan plan_strided_copies(const KVLayout& local, const KVLayout& remote,
                                std::span<const KVReadInfo> reads) {
  StridedPlan out;
  if (detail::plain_same_geometry(local, remote, reads)) {
    // Nothing strided to gain: the coalescing planner, into strided spans.
    detail::plan_plain_strided(local, remote, reads, out);
    return out;
  }
  const std::vector<Resolved> rs = detail::resolve_reads(local, remote, reads);
  // One span per (read, k|v) in most layouts (per head more for NHD <-> HND).
  out.spans.reserve(rs.size() * local.num_kv());
  detail::StridedSink sink{out, detail::fence_layers(local, remote)};
  detail::emit_reads(local, remote, rs, sink);
  return out;
}

}  // namespace mstar::kv
