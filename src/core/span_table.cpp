// Copyright mstar-kv authors.
#include "core/span_table.hpp"

#include <algorithm>
#include <string>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::walk {

namespace {

// Calls emit(WalkSpan) for the entries of `spans`, in order, with the
// packed side (if any) advancing from packed_base.
template <typename Emit>
void for_each_entry(std::span<const StridedSpan> spans, Packing packing, std::uint64_t packed,
                    Emit&& emit) {
  const auto put = [&](std::uint64_t dst, std::uint64_t src, std::uint64_t length,
                       std::uint64_t rows, std::uint64_t dst_stride, std::uint64_t src_stride) {
    emit(WalkSpan{dst, src, static_cast<std::uint32_t>(length), static_cast<std::uint32_t>(rows),
                  static_cast<std::uint32_t>(rows > 1 ? dst_stride : 0),
                  static_cast<std::uint32_t>(rows > 1 ? src_stride : 0)});
  };
  // One contiguous run, in pieces of at most kMaxRowBytes.
  const auto run = [&](std::uint64_t dst, std::uint64_t src, std::uint64_t length) {
    for (std::uint64_t off = 0; off < length; off += kMaxRowBytes) {
      put(dst + off, src + off, std::min(kMaxRowBytes, length - off), 1, 0, 0);
    }
  };
  for (const StridedSpan& s : spans) {
    if (s.length == 0 || s.rows == 0) continue;
    std::uint64_t dst_stride = s.local_stride;
    std::uint64_t src_stride = s.remote_stride;
    std::uint64_t dst = s.local_offset;
    std::uint64_t src = s.remote_offset;
    if (packing == Packing::kSource) {
      src = packed;
      src_stride = s.length;
    } else if (packing == Packing::kDestination) {
      dst = packed;
      dst_stride = s.length;
    }
    packed += s.length * s.rows;
    if (s.rows == 1) {
      run(dst, src, s.length);
    } else if (s.length > kMaxRowBytes || dst_stride > kMaxStride || src_stride > kMaxStride) {
      for (std::uint64_t r = 0; r < s.rows; ++r) {
        run(dst + r * dst_stride, src + r * src_stride, s.length);
      }
    } else {
      for (std::uint64_t r = 0; r < s.rows; r += kMaxRows) {
        put(dst + r * dst_stride, src + r * src_stride, s.length, std::min(kMaxRows, s.rows - r),
            dst_stride, src_stride);
      }
    }
  }
}

constexpr std::uint64_t kMaxEntries = 0xFFFFFFFFull - 1;

}  // namespace

TableSize measure_table(std::span<const StridedSpan> spans) {
  TableSize t;
  for_each_entry(spans, Packing::kNone, 0, [&](const WalkSpan& w) {
    ++t.entries;
    t.units += units_of(w);
    t.bytes += std::uint64_t{w.length} * w.rows;
  });
  if (t.entries > kMaxEntries) {
    throw Error(StatusCode::kInvalidArgument, "copy plan of " + std::to_string(t.entries) +
                                                  " table entries exceeds the span "
                                                  "walk's limit of " +
                                                  std::to_string(kMaxEntries));
  }
  return t;
}

namespace {

std::size_t tile_first_offset(const TableSize& size) {
  return (size.entries + 1) * sizeof(std::uint64_t);
}

std::size_t entries_offset(const TableSize& size) {
  const std::size_t end = tile_first_offset(size) + tiles_of(size.units) * sizeof(std::uint32_t);
  return (end + 31) / 32 * 32;
}

}  // namespace

std::size_t table_bytes(const TableSize& size) {
  return entries_offset(size) + size.entries * sizeof(WalkSpan);
}

WalkTable write_table(std::span<const StridedSpan> spans, Packing packing,
                      std::uint64_t packed_base, const TableSize& size, std::byte* out,
                      const std::byte* view) {
  auto* starts = reinterpret_cast<std::uint64_t*>(out);
  auto* tile_first = reinterpret_cast<std::uint32_t*>(out + tile_first_offset(size));
  auto* entries = reinterpret_cast<WalkSpan*>(out + entries_offset(size));
  const std::uint64_t tiles = tiles_of(size.units);
  std::size_t i = 0;
  std::uint64_t units = 0;
  std::uint64_t tile = 0;
  for_each_entry(spans, packing, packed_base, [&](const WalkSpan& w) {
    if (i >= size.entries) throw Error(StatusCode::kInternal, "span table longer than measured");
    starts[i] = units;
    entries[i] = w;
    units += units_of(w);
    for (; tile < tiles && tile * kTileUnits < units; ++tile) {
      tile_first[tile] = static_cast<std::uint32_t>(i);
    }
    ++i;
  });
  starts[i] = units;
  if (i != size.entries || units != size.units) {
    throw Error(StatusCode::kInternal, "span table size differs from its measure");
  }
  return WalkTable{reinterpret_cast<const WalkSpan*>(view + entries_offset(size)),
                   reinterpret_cast<const std::uint64_t*>(view),
                   reinterpret_cast<const std::uint32_t*>(view + tile_first_offset(size)),
                   static_cast<std::uint32_t>(size.entries), units};
}

SpanTable make_table(std::span<const StridedSpan> spans, Packing packing,
                     std::uint64_t packed_base) {
  SpanTable t;
  t.size = measure_table(spans);
  t.storage.assign((table_bytes(t.size) + 7) / 8, 0);
  auto* block = reinterpret_cast<std::byte*>(t.storage.data());
  t.table = write_table(spans, packing, packed_base, t.size, block, block);
  return t;
}

SpanTable make_table(std::span<const CopySpan> spans, Packing packing, std::uint64_t packed_base) {
  std::vector<StridedSpan> s;
  s.reserve(spans.size());
  for (const CopySpan& c : spans) s.push_back({c.local_offset, c.remote_offset, c.length, 1, 0, 0});
  return make_table(s, packing, packed_base);
}

std::uint64_t copy_on_host(const WalkTable& t, const std::byte* src_base, std::byte* dst_base,
                           std::uint64_t grid) {
  std::uint64_t narrow = 0;
  for (std::uint64_t b = 0; b < grid; ++b) {
    for (std::uint32_t th = 0; th < kThreads; ++th) {
      copy_tile_thread(t, src_base, dst_base, b, grid, th, &narrow);
    }
  }
  return narrow;
}

}  // namespace mstar::kv::walk
