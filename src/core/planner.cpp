// Copyright mstar-kv authors.
#include "mstar/kv/core/planner.hpp"

#include <algorithm>
#include <bit>
#include <string>
#include <utility>

#include "mstar/kv/util/status.hpp"
#include "planner_detail.hpp"

namespace mstar::kv {

namespace {

using detail::invalid;
using detail::range;

// Open-addressing set of (layer, local page) keys, sized for n inserts.
// Linear in the number of reads, unlike a bitmap over the whole cache.
class KeySet {
 public:
  explicit KeySet(std::size_t n) {
    const std::size_t size = std::bit_ceil(n * 2 + 2);
    // The table of a thread's last plan is reused (cleared, not freed): a
    // fresh one of a few hundred KiB costs a page fault per 4 KiB, more than
    // the planning itself. Tables over kKeepSlots are not kept.
    std::vector<std::uint64_t>& kept = kept_slots();
    slots_ = size <= kKeepSlots ? &kept : &own_;
    slots_->assign(size, kEmpty);
    mask_ = size - 1;
  }

  // False if the key was already present.
  bool insert(std::uint64_t key) {
    std::vector<std::uint64_t>& slots = *slots_;
    std::size_t i = mix(key) & mask_;
    while (slots[i] != kEmpty) {
      if (slots[i] == key) return false;
      i = (i + 1) & mask_;
    }
    slots[i] = key;
    return true;
  }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  static constexpr std::size_t kKeepSlots = std::size_t{1} << 20;  // 8 MiB
  static std::vector<std::uint64_t>& kept_slots() {
    thread_local std::vector<std::uint64_t> slots;
    return slots;
  }
  static std::size_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return static_cast<std::size_t>(x);
  }
  std::vector<std::uint64_t> own_;
  std::vector<std::uint64_t>* slots_ = nullptr;
  std::size_t mask_ = 0;
};

}  // namespace

std::vector<KVReadInfo> plan_reads(const KVLayout& local, std::uint64_t start_len,
                                   std::uint64_t end_len,
                                   std::span<const std::uint32_t> local_pages,
                                   std::span<const std::uint32_t> remote_pages) {
  if (start_len > end_len) {
    invalid("start_len " + std::to_string(start_len) + " is greater than end_len " +
            std::to_string(end_len));
  }
  std::vector<KVReadInfo> reads;
  const std::uint64_t ps = local.page_size;
  const std::uint64_t first = start_len / ps;
  // Pages [0, needed); not (end_len + ps - 1) / ps, which wraps for an
  // end_len near 2^64 (found by fuzz_plan).
  const std::uint64_t needed = end_len / ps + (end_len % ps != 0 ? 1 : 0);
  if (local_pages.size() < needed) {
    invalid("local page table has " + std::to_string(local_pages.size()) + " entries, tokens " +
            range(start_len, end_len) + " need " + std::to_string(needed));
  }
  if (remote_pages.size() < needed) {
    invalid("remote page table has " + std::to_string(remote_pages.size()) + " entries, tokens " +
            range(start_len, end_len) + " need " + std::to_string(needed));
  }
  for (std::uint64_t i = first; i < needed; ++i) {
    if (local_pages[i] >= local.num_pages) {
      invalid("local page " + std::to_string(local_pages[i]) + " (table entry " +
              std::to_string(i) + ") out of range " + range(0, local.num_pages));
    }
  }
  // A local page named twice would be one destination of two reads, which
  // plan_copies refuses too; named here by the caller's table entries.
  if (needed - first > 1) {
    KeySet seen(needed - first);
    for (std::uint64_t i = first; i < needed; ++i) {
      if (!seen.insert(local_pages[i])) {
        std::uint64_t j = first;
        while (local_pages[j] != local_pages[i]) ++j;
        invalid("local page " + std::to_string(local_pages[i]) +
                " appears twice in the local "
                "page table (entries " +
                std::to_string(j) + " and " + std::to_string(i) +
                "): one destination for two pages");
      }
    }
  }
  // An empty range is validated as any other, then reads nothing.
  if (start_len == end_len) return reads;
  reads.reserve((needed - first) * local.num_layers);
  auto emit = [&](std::uint32_t layer, std::uint64_t i) {
    const std::uint64_t page_start = i * ps;
    const std::uint64_t ts = start_len > page_start ? start_len - page_start : 0;
    const std::uint64_t te = std::min<std::uint64_t>(ps, end_len - page_start);
    reads.push_back({layer, local_pages[i], remote_pages[i], static_cast<std::int64_t>(ts),
                     static_cast<std::int64_t>(te)});
  };
  if (detail::pages_outer(local)) {
    for (std::uint64_t i = first; i < needed; ++i) {
      for (std::uint32_t layer = 0; layer < local.num_layers; ++layer) emit(layer, i);
    }
  } else {
    for (std::uint32_t layer = 0; layer < local.num_layers; ++layer) {
      for (std::uint64_t i = first; i < needed; ++i) emit(layer, i);
    }
  }
  return reads;
}

void check_remote_pages(const KVLayout& local, const KVLayout& remote, std::uint64_t start_len,
                        std::uint64_t end_len, std::span<const std::uint32_t> remote_pages) {
  local.check_compatible(remote);
  if (start_len > end_len) return;            // plan_reads names it
  const std::uint64_t ps = remote.page_size;  // the remote table is in its own page size
  const std::uint64_t first = start_len / ps;
  const std::uint64_t needed = end_len / ps + (end_len % ps != 0 ? 1 : 0);
  const std::uint64_t last = std::min<std::uint64_t>(needed, remote_pages.size());
  for (std::uint64_t i = first; i < last; ++i) {
    if (remote_pages[i] >= remote.num_pages) {
      invalid("remote page " + std::to_string(remote_pages[i]) + " (table entry " +
              std::to_string(i) + ") out of range " + range(0, remote.num_pages) +
              " in remote cache");
    }
  }
}

namespace {

// plan_copies between caches of one geometry, for plain reads, pass 1:
// validates every read before anything is emitted; returns their bytes and
// spans before coalescing.
detail::PlainTotals check_plain(const KVLayout& local, const KVLayout& remote,
                                std::span<const KVReadInfo> reads) {
  local.check_compatible(remote);
  KeySet seen(reads.size());
  const bool same_order = local.page_order == remote.page_order;
  const bool nhd = local.page_order == PageOrder::kNHD;
  const std::uint64_t tb = local.token_bytes();
  const std::uint64_t heads = local.num_kv_heads;
  const std::int64_t ps = local.page_size;
  detail::PlainTotals totals;
  for (std::size_t n = 0; n < reads.size(); ++n) {
    const KVReadInfo& r = reads[n];
    detail::check_read(local, remote, r, n);
    const auto layer = static_cast<std::uint64_t>(r.layer_idx);
    const auto lpage = static_cast<std::uint64_t>(r.local_page_idx);
    if (!seen.insert(layer * local.num_pages + lpage)) {
      invalid(detail::read_name(n) + ": duplicate destination: layer " + std::to_string(layer) +
              " local page " + std::to_string(lpage) + " appears twice in one batch");
    }
    const auto tokens = static_cast<std::uint64_t>(r.token_end - r.token_start);
    const bool full = r.token_start == 0 && r.token_end == ps;
    totals.bytes += tokens * tb * local.num_kv();
    totals.spans += (same_order && (full || nhd) ? 1
                     : same_order                ? heads
                                                 : tokens * heads) *
                    local.num_kv();
  }
  return totals;
}

// Pass 2: emits the copies of reads that check_plain accepted into `sink`
// (add(local, remote, len)).
template <typename Sink>
void emit_plain(const KVLayout& local, const KVLayout& remote, std::span<const KVReadInfo> reads,
                Sink& sink) {
  const bool same_order = local.page_order == remote.page_order;
  const std::uint64_t hb = local.head_bytes();
  const std::uint64_t tb = local.token_bytes();
  const std::uint32_t heads = local.num_kv_heads;
  const detail::BlockStrides lstr(local);
  const detail::BlockStrides rstr(remote);
  const bool nhd = local.page_order == PageOrder::kNHD;
  const std::uint32_t page_size = local.page_size;
  auto emit = [&](const KVReadInfo& r, KV kv) {
    const auto layer = static_cast<std::uint32_t>(r.layer_idx);
    const auto ts = static_cast<std::uint32_t>(r.token_start);
    const auto te = static_cast<std::uint32_t>(r.token_end);
    const bool full = ts == 0 && te == page_size;
    sink.at_layer(layer);
    const std::uint64_t lb = lstr.offset(layer, kv, static_cast<std::uint32_t>(r.local_page_idx));
    const std::uint64_t rb = rstr.offset(layer, kv, static_cast<std::uint32_t>(r.remote_page_idx));
    if (same_order && (full || nhd)) {
      sink.add(lb + ts * tb, rb + ts * tb, std::uint64_t{te - ts} * tb);
    } else if (same_order) {  // partial HND page: one run per head
      for (std::uint32_t h = 0; h < heads; ++h) {
        const std::uint64_t off = local.in_block_offset(ts, h);
        sink.add(lb + off, rb + off, std::uint64_t{te - ts} * hb);
      }
    } else {  // NHD <-> HND: every (token, head) row moves on its own
      for (std::uint32_t t = ts; t < te; ++t) {
        for (std::uint32_t h = 0; h < heads; ++h) {
          sink.add(lb + local.in_block_offset(t, h), rb + remote.in_block_offset(t, h), hb);
        }
      }
    }
  };
  detail::emit_in_cache_order(
      local, reads.size(),
      [&](std::size_t i) {
        return std::pair{reads[i].layer_idx, reads[i].local_page_idx};
      },
      [&](std::size_t i, KV kv) { emit(reads[i], kv); });
}

template <typename Sink>
void plan_plain(const KVLayout& local, const KVLayout& remote, std::span<const KVReadInfo> reads,
                Sink& sink) {
  check_plain(local, remote, reads);
  emit_plain(local, remote, reads, sink);
}

}  // namespace

CopyPlan plan_copies(const KVLayout& local, const KVLayout& remote,
                     std::span<const KVReadInfo> reads) {
  // Caches of different geometry, or reads that name remote positions or
  // heads, take the general path (planner_mixed.cpp).
  bool plain = local.same_geometry(remote);
  for (std::size_t i = 0; plain && i < reads.size(); ++i) plain = reads[i].plain();
  if (!plain) return detail::plan_copies_mixed(local, remote, reads);
  CopyPlan plan;
  plan.spans.reserve(reads.size() * local.num_kv());
  detail::SpanSink sink(plan, detail::fence_layers(local, remote));
  plan_plain(local, remote, reads, sink);
  return plan;
}

namespace detail {

void plan_plain_strided(const KVLayout& local, const KVLayout& remote,
                        std::span<const KVReadInfo> reads, StridedPlan& out) {
  out.spans.reserve(reads.size() * local.num_kv());
  StridedSink sink{out, fence_layers(local, remote)};
  plan_plain(local, remote, reads, sink);
}

bool plain_same_geometry(const KVLayout& local, const KVLayout& remote,
                         std::span<const KVReadInfo> reads) noexcept {
  bool plain = local.same_geometry(remote) && local.page_order == remote.page_order;
  for (std::size_t i = 0; plain && i < reads.size(); ++i) plain = reads[i].plain();
  return plain;
}

PlainTotals check_plain_reads(const KVLayout& local, const KVLayout& remote,
                              std::span<const KVReadInfo> reads) {
  return check_plain(local, remote, reads);
}

void emit_plain_strided(const KVLayout& local, const KVLayout& remote,
                        std::span<const KVReadInfo> reads, StridedPlan& out) {
  StridedSink sink{out, fence_layers(local, remote)};
  emit_plain(local, remote, reads, sink);
}

}  // namespace detail

std::vector<CopySpan> strided_rows(std::span<const StridedSpan> spans, LayerBounds bounds) {
  std::uint64_t rows = 0;
  for (const StridedSpan& s : spans) rows += s.rows;
  std::vector<CopySpan> out;
  out.reserve(rows);
  for (const StridedSpan& s : spans) {
    for (std::uint64_t r = 0; r < s.rows; ++r) {
      const CopySpan row{s.local_offset + r * s.local_stride, s.remote_offset + r * s.remote_stride,
                         s.length};
      if (!out.empty() && out.back().local_offset + out.back().length == row.local_offset &&
          out.back().remote_offset + out.back().length == row.remote_offset &&
          !bounds.starts_layer(row.local_offset, row.remote_offset)) {
        out.back().length += row.length;
      } else {
        out.push_back(row);
      }
    }
  }
  return out;
}

std::vector<CopySpan> split_spans(std::span<const CopySpan> spans, std::uint64_t max_bytes) {
  if (max_bytes == 0) invalid("split_spans: max_bytes must be > 0");
  std::vector<CopySpan> out;
  out.reserve(spans.size());
  for (const CopySpan& s : spans) {
    for (std::uint64_t done = 0; done < s.length; done += max_bytes) {
      out.push_back(
          {s.local_offset + done, s.remote_offset + done, std::min(max_bytes, s.length - done)});
    }
  }
  return out;
}

}  // namespace mstar::kv
