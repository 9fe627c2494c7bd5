// Copyright mstar-kv authors.
//
// The span walk: one read's copy plan (the planner's CopySpans and
// StridedSpans, as a SpanTable: span_table.hpp) as a flat space of work
// units, each unit at most kUnitBytes bytes of one row of one span, and the
// map from a unit's index to (source offset, destination offset, bytes).
// Driven only by the spans: head slices, NHD <-> HND, page sizes and every
// cache order are the planner's business, never this file's.
//
// The same code runs on the host (plain C++: the tests) and on the device
// (nvcc: the copy kernel, cuda_ipc's span_kernel.cu): every function is
// MSTAR_KV_HD, and the kernel's work split (blocks of kThreads threads,
// tiles of kTileUnits units visited grid-stride) is copy_tile_thread()
// below, which the kernel calls once per thread and a host test calls for
// every (block, thread) of a grid. No allocation, no exceptions, no
// standard library beyond <cstdint>/<cstring>.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MSTAR_KV_HD __host__ __device__ __forceinline__
#else
#define MSTAR_KV_HD inline
#endif

namespace mstar::kv::walk {

// Bytes of one work unit: one 16-byte vector when both ends are aligned.
inline constexpr std::uint32_t kUnitBytes = 16;
// The kernel's shape: threads per block, units per thread per tile.
inline constexpr std::uint32_t kThreads = 256;
inline constexpr std::uint32_t kUnitsPerThread = 8;
inline constexpr std::uint64_t kTileUnits = std::uint64_t{kThreads} * kUnitsPerThread;
// Limits of one table entry (span_table.cpp splits what exceeds them).
inline constexpr std::uint64_t kMaxRowBytes = std::uint64_t{1} << 31;
inline constexpr std::uint64_t kMaxRows = 0xFFFFFFFFull;
inline constexpr std::uint64_t kMaxStride = 0xFFFFFFFFull;

// One entry: `rows` rows of `length` bytes, the i-th from src + i *
// src_stride to dst + i * dst_stride (offsets from the two base pointers).
// 32 bytes. length >= 1, rows >= 1.
struct WalkSpan {
  std::uint64_t dst;
  std::uint64_t src;
  std::uint32_t length;
  std::uint32_t rows;
  std::uint32_t dst_stride;
  std::uint32_t src_stride;
};
static_assert(sizeof(WalkSpan) == 32, "WalkSpan is uploaded as bytes");

// A table as the walk reads it: `count` entries, count + 1 unit starts
// (starts[i] = first unit of entry i, starts[count] = every unit) and, per
// tile of kTileUnits units, the entry holding its first unit (tile_first:
// a thread finds its entry from there in a few steps, not by a search of
// the whole table). Plain pointers: host memory on the host, device memory
// in the kernel.
struct WalkTable {
  const WalkSpan* spans = nullptr;
  const std::uint64_t* starts = nullptr;
  const std::uint32_t* tile_first = nullptr;
  std::uint32_t count = 0;
  std::uint64_t units = 0;
};

// One unit: `bytes` (1..kUnitBytes) from src to dst (offsets).
struct WalkStep {
  std::uint64_t dst;
  std::uint64_t src;
  std::uint32_t bytes;
};

MSTAR_KV_HD std::uint32_t units_per_row(std::uint32_t length) {
  return (length + kUnitBytes - 1) / kUnitBytes;
}
MSTAR_KV_HD std::uint64_t units_of(const WalkSpan& s) {
  return std::uint64_t{s.rows} * units_per_row(s.length);
}

// The entry holding unit u, searching entries [lo, count): the largest i
// with starts[i] <= u. Needs starts[lo] <= u < starts[count].
MSTAR_KV_HD std::uint32_t find_span(const std::uint64_t* starts, std::uint32_t lo,
                                    std::uint32_t count, std::uint64_t u) {
  std::uint32_t hi = count;
  while (hi - lo > 1) {
    const std::uint32_t mid = lo + (hi - lo) / 2;
    if (starts[mid] <= u) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Unit k (0-based) of entry s.
MSTAR_KV_HD WalkStep step_of(const WalkSpan& s, std::uint64_t k) {
  const std::uint32_t per_row = units_per_row(s.length);
  std::uint64_t row = 0;
  std::uint32_t chunk = 0;
  if (s.rows == 1) {
    chunk = static_cast<std::uint32_t>(k);
  } else if (k <= 0xFFFFFFFFull) {  // 32-bit division where it fits
    const auto k32 = static_cast<std::uint32_t>(k);
    row = k32 / per_row;
    chunk = k32 - static_cast<std::uint32_t>(row) * per_row;
  } else {
    row = k / per_row;
    chunk = static_cast<std::uint32_t>(k - row * per_row);
  }
  const std::uint32_t off = chunk * kUnitBytes;
  const std::uint32_t left = s.length - off;
  return WalkStep{s.dst + row * s.dst_stride + off, s.src + row * s.src_stride + off,
                  left < kUnitBytes ? left : kUnitBytes};
}

// The step of unit u of the table (u < t.units).
MSTAR_KV_HD WalkStep locate(const WalkTable& t, std::uint64_t u) {
  const std::uint32_t i = find_span(t.starts, 0, t.count, u);
  return step_of(t.spans[i], u - t.starts[i]);
}

// Moves cursor i (an entry holding a unit <= u) to the entry holding unit
// u, knowing that u is at most `window` units past the cursor's unit: one
// step when u is in the next entry, else a search of the next `window`
// entries (every entry holds at least one unit).
MSTAR_KV_HD std::uint32_t advance(const WalkTable& t, std::uint32_t i, std::uint64_t u,
                                  std::uint64_t window) {
  if (t.starts[i + 1] > u) return i;
  ++i;
  if (t.starts[i + 1] > u) return i;
  const std::uint64_t hi = std::uint64_t{i} + window + 1;
  return find_span(t.starts, i, hi < t.count ? static_cast<std::uint32_t>(hi) : t.count, u);
}

// Calls fn(step) for units first, first + stride, ... below end, in order,
// with a cursor that moves forward from entry `from` (which holds a unit
// <= first, at most `stride` units before it).
template <typename Fn>
MSTAR_KV_HD void walk_units(const WalkTable& t, std::uint32_t from, std::uint64_t first,
                            std::uint64_t end, std::uint64_t stride, Fn&& fn) {
  std::uint32_t i = from;
  for (std::uint64_t u = first; u < end; u += stride) {
    i = advance(t, i, u, stride);
    fn(step_of(t.spans[i], u - t.starts[i]));
  }
}
// The same from a search of the whole table.
template <typename Fn>
MSTAR_KV_HD void walk_units(const WalkTable& t, std::uint64_t first, std::uint64_t end,
                            std::uint64_t stride, Fn&& fn) {
  if (first >= end) return;
  walk_units(t, find_span(t.starts, 0, t.count, first), first, end, stride, fn);
}

MSTAR_KV_HD std::uint64_t tiles_of(std::uint64_t units) {
  return (units + kTileUnits - 1) / kTileUnits;
}

// The width a unit is copied with: 16 (one vector: a full unit, both ends
// 16-byte aligned), 8 or 4 (words: both ends and the length multiples of
// it), else 1. From the real addresses, so a cache at an odd offset in its
// allocation is still copied right, only slower.
MSTAR_KV_HD std::uint32_t unit_width(const void* src, const void* dst, std::uint32_t bytes) {
  const auto a = static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(src)) |
                 static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(dst));
  if (bytes == kUnitBytes && (a & 15) == 0) return 16;
  if (((a | bytes) & 7) == 0) return 8;
  if (((a | bytes) & 3) == 0) return 4;
  return 1;
}

// A 16-byte vector: uint4 on the device, two words on the host.
#if defined(__CUDA_ARCH__)
using Vec16 = uint4;
#else
struct alignas(16) Vec16 {
  std::uint64_t a;
  std::uint64_t b;
};
#endif

MSTAR_KV_HD Vec16 load16(const std::byte* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const uint4*>(p);
#else
  Vec16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}
MSTAR_KV_HD void store16(std::byte* p, const Vec16& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(p) = v;
#else
  std::memcpy(p, &v, sizeof v);
#endif
}

// Copies one step that is not a full aligned vector, in words of its width
// (memcpy of a word on the host, where std::byte storage is not a word's).
MSTAR_KV_HD void copy_narrow(const std::byte* src, std::byte* dst, std::uint32_t bytes,
                             std::uint32_t width) {
#if defined(__CUDA_ARCH__)
  if (width == 8) {
    for (std::uint32_t i = 0; i < bytes; i += 8) {
      *reinterpret_cast<std::uint64_t*>(dst + i) = *reinterpret_cast<const std::uint64_t*>(src + i);
    }
  } else if (width == 4) {
    for (std::uint32_t i = 0; i < bytes; i += 4) {
      *reinterpret_cast<std::uint32_t*>(dst + i) = *reinterpret_cast<const std::uint32_t*>(src + i);
    }
  } else {
    for (std::uint32_t i = 0; i < bytes; ++i) dst[i] = src[i];
  }
#else
  for (std::uint32_t i = 0; i < bytes; i += width) std::memcpy(dst + i, src + i, width);
#endif
}

#if defined(__CUDA_ARCH__)
#define MSTAR_KV_UNROLL _Pragma("unroll")
#else
#define MSTAR_KV_UNROLL
#endif

// The units of thread `thread` of block `block` in a grid of `grid` blocks:
// for tiles block, block + grid, ..., units tile * kTileUnits + thread +
// j * kThreads (j < kUnitsPerThread), in order; calls fn(step) for each and
// tile_end() after each tile. Every unit of the table belongs to exactly
// one (block, thread) of any grid >= 1. (The units copy_tile_thread copies;
// the tests check the cover with this.)
template <typename Fn, typename TileEnd>
MSTAR_KV_HD void for_tile_thread(const WalkTable& t, std::uint64_t block, std::uint64_t grid,
                                 std::uint32_t thread, Fn&& fn, TileEnd&& tile_end) {
  const std::uint64_t tiles = tiles_of(t.units);
  for (std::uint64_t tile = block; tile < tiles; tile += grid) {
    std::uint64_t end = (tile + 1) * kTileUnits;
    if (end > t.units) end = t.units;
    walk_units(t, t.tile_first[tile], tile * kTileUnits + thread, end, kThreads, fn);
    tile_end();
  }
}

// What one thread of the copy kernel does: its units (for_tile_thread's)
// from src_base to dst_base. Per tile, a thread's kUnitsPerThread units are
// located first, then all their loads issued, then their stores, with
// indices known at compile time (registers, no local memory), so that
// several loads are in flight. `narrow` (host tests) counts the units
// copied narrower than a 16-byte vector.
MSTAR_KV_HD void copy_tile_thread(const WalkTable& t, const std::byte* src_base,
                                  std::byte* dst_base, std::uint64_t block, std::uint64_t grid,
                                  std::uint32_t thread, std::uint64_t* narrow = nullptr) {
  const std::uint64_t tiles = tiles_of(t.units);
  for (std::uint64_t tile = block; tile < tiles; tile += grid) {
    std::uint64_t end = (tile + 1) * kTileUnits;
    if (end > t.units) end = t.units;
    const std::uint64_t first = tile * kTileUnits + thread;
    WalkStep st[kUnitsPerThread];
    bool wide[kUnitsPerThread];
    Vec16 v[kUnitsPerThread];
    std::uint32_t i = t.tile_first[tile];
    MSTAR_KV_UNROLL
    for (std::uint32_t j = 0; j < kUnitsPerThread; ++j) {
      const std::uint64_t u = first + std::uint64_t{j} * kThreads;
      st[j] = WalkStep{0, 0, 0};
      wide[j] = false;
      if (u < end) {
        i = advance(t, i, u, kThreads);
        st[j] = step_of(t.spans[i], u - t.starts[i]);
        wide[j] = unit_width(src_base + st[j].src, dst_base + st[j].dst, st[j].bytes) == 16;
      }
    }
    MSTAR_KV_UNROLL
    for (std::uint32_t j = 0; j < kUnitsPerThread; ++j) {
      if (wide[j]) v[j] = load16(src_base + st[j].src);
    }
    MSTAR_KV_UNROLL
    for (std::uint32_t j = 0; j < kUnitsPerThread; ++j) {
      if (wide[j]) {
        store16(dst_base + st[j].dst, v[j]);
      } else if (st[j].bytes != 0) {
        const std::byte* s = src_base + st[j].src;
        std::byte* d = dst_base + st[j].dst;
        copy_narrow(s, d, st[j].bytes, unit_width(s, d, st[j].bytes));
        if (narrow != nullptr) ++*narrow;
      }
    }
  }
}

}  // namespace mstar::kv::walk
