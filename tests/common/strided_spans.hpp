// Copyright mstar-kv authors.
//
// Strided spans for the copy tests (the span walk on the host, the cuda_ipc
// kernel on a device): the reference copy every copy is compared with, and
// spans of odd lengths, offsets and strides.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "mstar/kv/core/planner.hpp"

namespace mstar::kv::testing {

// The reference: every row of every span with memcpy.
inline void reference_copy(std::span<const StridedSpan> spans, const std::byte* src,
                           std::byte* dst) {
  for (const StridedSpan& s : spans) {
    for (std::uint64_t r = 0; r < s.rows; ++r) {
      std::memcpy(dst + s.local_offset + r * s.local_stride,
                  src + s.remote_offset + r * s.remote_stride, s.length);
    }
  }
}

struct OddSpans {
  std::vector<StridedSpan> spans;
  std::uint64_t dst_end = 0;  // past the last destination byte and a gap
  std::uint64_t src_end = 0;  // past the last source byte and a gap
};

// One span of each length 1..max_len, of 1..max_rows rows at strides a few
// bytes past the length, from destination 3 and source 1 with odd gaps
// between spans: every misalignment a copy must handle. Drawn from `g`.
inline OddSpans odd_spans(std::uint64_t max_len, std::uint64_t max_rows, std::mt19937_64& g) {
  OddSpans o{{}, 3, 1};
  for (std::uint64_t len = 1; len <= max_len; ++len) {
    const std::uint64_t rows = 1 + g() % max_rows;
    const std::uint64_t ls = rows > 1 ? len + g() % 19 : 0;
    const std::uint64_t rs = rows > 1 ? len + g() % 23 : 0;
    o.spans.push_back({o.dst_end, o.src_end, len, rows, ls, rs});
    o.dst_end += (rows - 1) * ls + len + g() % 7;
    o.src_end += (rows - 1) * rs + len + g() % 5;
  }
  return o;
}

}  // namespace mstar::kv::testing
