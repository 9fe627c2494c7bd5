// Copyright mstar-kv authors.
//
// The rows of strided spans as the ucx engine moves them (ucx_rows.hpp):
// the owner's RowSource packs exactly the named rows in order, whatever
// the fragment sizes UCX asks for and wherever it starts; the reader's
// RowSink writes exactly the named rows, in any fragment order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "ucx/ucx_rows.hpp"

namespace mstar::kv::ucx {
namespace {

std::vector<std::byte> region(std::size_t n) {
  std::vector<std::byte> r(n);
  for (std::size_t i = 0; i < n; ++i) r[i] = static_cast<std::byte>((i * 131 + 17) % 251);
  return r;
}

std::uint64_t total_bytes(const std::vector<StridedSpan>& spans) {
  std::uint64_t n = 0;
  for (const StridedSpan& s : spans) n += s.bytes();
  return n;
}

// The rows by a plain loop: the reference.
std::vector<std::byte> expected(const std::vector<std::byte>& base,
                                const std::vector<StridedSpan>& spans) {
  std::vector<std::byte> out;
  for (const StridedSpan& s : spans) {
    for (std::uint64_t r = 0; r < s.rows; ++r) {
      const std::byte* p = base.data() + s.remote_offset + r * s.remote_stride;
      out.insert(out.end(), p, p + s.length);
    }
  }
  return out;
}

// Head-split rows (apart), NHD <- HND rows (one run on this side), a single
// row, odd lengths and strides.
const std::vector<StridedSpan> kSpans = {
    {0, 0, 1024, 16, 1024, 2048}, {0, 40000, 256, 16, 2048, 256}, {0, 9000, 100, 1, 0, 0},
    {0, 20000, 37, 9, 37, 101},   {0, 70000, 64, 3, 64, 4096},
};

TEST(UcxRows, PacksTheNamedRowsInOrderForAnyFragmentSize) {
  const auto base = region(96 * 1024);
  const auto want = expected(base, kSpans);
  const std::uint64_t bytes = total_bytes(kSpans);
  ASSERT_EQ(bytes, want.size());
  for (const std::size_t frag : {std::size_t{1}, std::size_t{7}, std::size_t{64}, std::size_t{1000},
                                 std::size_t{4096}, want.size()}) {
    RowSource src(base.data(), kSpans.data(), kSpans.size(), bytes);
    std::vector<std::byte> got(want.size() + 16, std::byte{0xEE});
    std::uint64_t at = 0;
    while (at < want.size()) {
      const std::size_t n = src.pack(at, got.data() + at, frag);
      ASSERT_GT(n, 0u) << "fragment " << frag << " stalled at " << at;
      ASSERT_LE(n, frag);
      at += n;
    }
    EXPECT_EQ(src.pack(at, got.data() + at, frag), 0u) << "packed past the end";
    EXPECT_TRUE(std::equal(want.begin(), want.end(), got.begin())) << "fragment " << frag;
    for (std::size_t i = want.size(); i < got.size(); ++i) {
      ASSERT_EQ(got[i], std::byte{0xEE}) << "wrote past the end";
    }
  }
}

TEST(UcxRows, PacksFromAnyOffsetAlsoBackwards) {
  const auto base = region(96 * 1024);
  const auto want = expected(base, kSpans);
  RowSource src(base.data(), kSpans.data(), kSpans.size(), want.size());
  std::mt19937_64 rng(7);
  for (int i = 0; i < 500; ++i) {
    const std::uint64_t off = rng() % want.size();
    const std::size_t max = 1 + rng() % 3000;
    std::vector<std::byte> got(max);
    const std::size_t n = src.pack(off, got.data(), max);
    ASSERT_EQ(n, std::min<std::uint64_t>(max, want.size() - off)) << "offset " << off;
    ASSERT_TRUE(std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(n),
                           want.begin() + static_cast<std::ptrdiff_t>(off)))
        << "offset " << off << ", " << max << " bytes";
  }
}

// The reader's side, rows that do not overlap: apart (starting mid-line),
// one run of rows, a single row in the gaps of the first, odd lengths and
// strides, rows of whole pages.
std::vector<StridedSpan> local_rows() {
  return {{3, 0, 1024, 16, 2048, 0}, {40003, 0, 256, 16, 256, 0}, {1030, 0, 100, 1, 0, 0},
          {50003, 0, 37, 9, 101, 0}, {60003, 0, 64, 3, 4096, 0},  {90000, 0, 4096, 2, 4096, 0}};
}

// What the rows should hold after receiving `msg`, and the sentinel
// everywhere else.
std::vector<std::byte> landed(std::size_t size, const std::vector<StridedSpan>& spans,
                              const std::vector<std::byte>& msg) {
  std::vector<std::byte> out(size, std::byte{0x5A});
  std::size_t at = 0;
  for (const StridedSpan& s : spans) {
    for (std::uint64_t r = 0; r < s.rows; ++r) {
      std::copy_n(msg.begin() + static_cast<std::ptrdiff_t>(at), s.length,
                  out.begin() + static_cast<std::ptrdiff_t>(s.local_offset + r * s.local_stride));
      at += s.length;
    }
  }
  return out;
}

// A message for the local rows and what the memory should hold after it.
struct SinkCase {
  std::vector<StridedSpan> spans = local_rows();
  std::uint64_t bytes = total_bytes(spans);
  std::vector<std::byte> msg = region(bytes);
  std::vector<std::byte> want = landed(128 * 1024, spans, msg);
};

TEST(UcxRows, ASinkWritesTheRowsAndNothingElseStreamingOrNot) {
  const SinkCase c;
  const auto& [spans, bytes, msg, want] = c;
  for (const bool stream : {false, true}) {
    for (const std::size_t frag :
         {std::size_t{1}, std::size_t{100}, std::size_t{4096}, std::size_t{65536}, msg.size()}) {
      std::vector<std::byte> mem(128 * 1024, std::byte{0x5A});
      RowSink sink(mem.data(), spans.data(), spans.size(), bytes, stream);
      for (std::size_t at = 0; at < msg.size(); at += frag) {
        const std::size_t n = std::min(frag, msg.size() - at);
        sink.unpack(at, msg.data() + at, n);
      }
      EXPECT_TRUE(mem == want) << (stream ? "streaming" : "cached") << ", fragments of " << frag;
    }
  }
}

TEST(UcxRows, ASinkTakesFragmentsInAnyOrder) {
  const SinkCase c;
  const auto& [spans, bytes, msg, want] = c;
  std::vector<std::size_t> starts;
  for (std::size_t at = 0; at < msg.size(); at += 777) starts.push_back(at);
  std::mt19937_64 rng(3);
  std::shuffle(starts.begin(), starts.end(), rng);
  std::vector<std::byte> mem(128 * 1024, std::byte{0x5A});
  RowSink sink(mem.data(), spans.data(), spans.size(), bytes, true);
  for (const std::size_t at : starts) {
    sink.unpack(at, msg.data() + at, std::min<std::size_t>(777, msg.size() - at));
  }
  EXPECT_TRUE(mem == want);
}

}  // namespace
}  // namespace mstar::kv::ucx
