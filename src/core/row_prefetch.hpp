// Copyright mstar-kv authors.
//
// What a row-by-row copy of strided spans prefetches: a few rows ahead of
// the one it copies, on into the next span where this one ends. Shared by the
// shm engine's row copies and the ucx engine's row gathers, which tune how
// far ahead and how much of each row.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mstar/kv/core/planner.hpp"

namespace mstar::kv {

// The remote row `ahead` rows after row `row` of span `s` (at `row_ptr`);
// past the span's end, the row of `next` (its first row at `next_first`)
// that far on; nullptr past both.
inline const std::byte* row_ahead(const std::byte* row_ptr, const StridedSpan& s, std::uint64_t row,
                                  std::uint64_t ahead, const std::byte* next_first,
                                  const StridedSpan* next) noexcept {
  const std::uint64_t a = row + ahead;
  if (a < s.rows) return row_ptr + ahead * s.remote_stride;
  if (next != nullptr && a - s.rows < next->rows) {
    return next_first + (a - s.rows) * next->remote_stride;
  }
  return nullptr;
}

// Prefetches the first `n` bytes at `p` for reading, a line at a time.
template <int kLocality>
inline void prefetch_bytes(const std::byte* p, std::uint64_t n) noexcept {
  if (p == nullptr) return;
  for (std::uint64_t b = 0; b < n; b += 64) __builtin_prefetch(p + b, 0, kLocality);
}

}  // namespace mstar::kv
