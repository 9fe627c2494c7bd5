// Copyright mstar-kv authors.
//
// Span tables: a read's copy plan (planner.hpp's StridedSpans or CopySpans)
// as the entries the span walk (span_walk.hpp) reads, laid out in one block
// of bytes so that it can be uploaded to a device with one copy:
//   [starts: entries + 1 u64][tile_first: one u32 per tile of kTileUnits]
//   [padding to 32 bytes][entries: one WalkSpan each]
// A span whose row or strides do not fit an entry (rows of 2 GiB or more,
// strides of 4 GiB or more, 2^32 rows or more) is split, never refused.
// Host only; safe from any thread (pure functions).
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/span_walk.hpp"
#include "mstar/kv/core/planner.hpp"

namespace mstar::kv::walk {

// Which side of each span is a packed buffer instead of a cache:
//   kNone         dst = local_offset, src = remote_offset (cache to cache)
//   kSource       src = packed (the spans' rows back to back from
//                 packed_base, in order), dst = local_offset: a scatter
//                 from a staging buffer into the local cache
//   kDestination  src = remote_offset, dst = packed: a gather of the
//                 remote side's rows into a staging buffer
enum class Packing : std::uint8_t { kNone, kSource, kDestination };

struct TableSize {
  std::size_t entries = 0;
  std::uint64_t units = 0;
  std::uint64_t bytes = 0;  // bytes the spans move
};

// What write_table will write for `spans`. Throws Error(kInvalidArgument)
// when the table would have 2^32 entries or more.
TableSize measure_table(std::span<const StridedSpan> spans);
// Bytes of the block of a table of that size.
std::size_t table_bytes(const TableSize& size);

// Writes the table of `spans` into `out` (table_bytes(size) bytes,
// 8-byte aligned; `size` from measure_table of the same spans) and returns
// the walk's view of the same block at `view` (out itself, or the address a
// device copy of the block will have).
WalkTable write_table(std::span<const StridedSpan> spans, Packing packing,
                      std::uint64_t packed_base, const TableSize& size, std::byte* out,
                      const std::byte* view);

// An owned host table (tests, host staging).
struct SpanTable {
  TableSize size;
  std::vector<std::uint64_t> storage;  // the block, 8-byte aligned
  WalkTable table;                     // over storage

  const std::byte* data() const { return reinterpret_cast<const std::byte*>(storage.data()); }
};
SpanTable make_table(std::span<const StridedSpan> spans, Packing packing = Packing::kNone,
                     std::uint64_t packed_base = 0);
SpanTable make_table(std::span<const CopySpan> spans, Packing packing = Packing::kNone,
                     std::uint64_t packed_base = 0);

// Runs the copy kernel's work split on the host: every (block, thread) of a
// grid of `grid` blocks, copy_tile_thread. What the kernel does, for tests
// and host staging. Returns the units copied narrower than a vector.
std::uint64_t copy_on_host(const WalkTable& t, const std::byte* src_base, std::byte* dst_base,
                           std::uint64_t grid = 1);

}  // namespace mstar::kv::walk
