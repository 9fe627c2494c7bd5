// Copyright mstar-kv authors.
//
// The shm engine's span copies (src/engines/shm/span_copy.hpp), cached and
// streaming, against a byte-by-byte reference: every alignment of both
// sides, run lengths around the four-page blocks and the line size, rows
// apart on either side; bytes not named keep their sentinel.
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

#include "engines/shm/span_copy.hpp"

namespace mstar::kv::shm {
namespace {

constexpr std::byte kSentinel{0xA5};

void check(const StridedSpan& s, bool streaming, const StridedSpan* next = nullptr) {
  const std::uint64_t src_size = s.remote_offset + (s.rows - 1) * s.remote_stride + s.length;
  const std::uint64_t dst_size = s.local_offset + (s.rows - 1) * s.local_stride + s.length + 64;
  std::vector<std::byte> src(src_size), dst(dst_size, kSentinel), want(dst_size, kSentinel);
  for (std::uint64_t i = 0; i < src_size; ++i) src[i] = std::byte(i * 131 + 7);
  for (std::uint64_t r = 0; r < s.rows; ++r) {
    for (std::uint64_t b = 0; b < s.length; ++b) {
      want[s.local_offset + r * s.local_stride + b] =
          src[s.remote_offset + r * s.remote_stride + b];
    }
  }
  copy_span(dst.data(), src.data(), s, streaming, next);
  stream_fence();
  std::uint64_t bad = 0;
  for (std::uint64_t i = 0; i < dst_size; ++i) bad += dst[i] != want[i];
  EXPECT_EQ(bad, 0u) << "span local " << s.local_offset << " remote " << s.remote_offset
                     << " length " << s.length << " rows " << s.rows << " strides "
                     << s.local_stride << "/" << s.remote_stride
                     << (streaming ? " streaming" : " cached");
}

TEST(SpanCopy, ContiguousRunsAtEveryAlignmentAndLength) {
  for (bool streaming : {false, true}) {
    for (std::uint64_t length :
         {1u, 63u, 64u, 65u, 4095u, 16383u, 16384u, 16385u, 20000u, 65536u + 64u, 131072u + 17u}) {
      for (std::uint64_t local : {0u, 1u, 16u, 63u, 64u}) {
        for (std::uint64_t remote : {0u, 3u, 64u}) check({local, remote, length}, streaming);
      }
    }
  }
}

TEST(SpanCopy, RowsApartOnEitherSide) {
  std::mt19937 rng(5);
  for (bool streaming : {false, true}) {
    for (std::uint64_t length : {64u, 128u, 200u, 256u, 512u, 1024u}) {
      // NHD <- HND (rows apart locally), a head split (rows apart remotely),
      // both, and unaligned local rows (cached stores then).
      const std::uint64_t strides[][2] = {
          {2048, length}, {length, 2048}, {4096, 1024 + length}, {length + 8, length}};
      for (const auto& st : strides) {
        for (std::uint64_t rows : {2u, 9u, 33u}) {
          const std::uint64_t local = (rng() % 4) * 64 + (st[0] % 64 != 0 ? 8 : 0);
          check({local, rng() % 100, length, rows, st[0], st[1]}, streaming);
          // Prefetching on into a next span (rows apart on the remote side)
          // changes no byte, wherever that span lies.
          const StridedSpan next{0, length * 3, length, 40, length, 2048};
          check({local, rng() % 100, length, rows, st[0], st[1]}, streaming, &next);
        }
      }
    }
  }
}

}  // namespace
}  // namespace mstar::kv::shm
