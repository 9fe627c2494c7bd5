// Copyright mstar-kv authors.
#include "span_copy.hpp"

#include <algorithm>
#include <cstring>

#include "core/row_prefetch.hpp"
#include "util/stream_copy.hpp"

namespace mstar::kv::shm {

namespace {

constexpr std::uint64_t kPage = 4096;
constexpr std::uint64_t kLine = 64;
// Strided rows: how many rows ahead of the copied one are prefetched, and
// how many bytes of each (measured on rows of 256 bytes 2 KiB apart, the
// TP 1 -> 8 head split: 8 rows ahead 1.3x, 16 and more slower again; on
// into the next span: +5% more).
constexpr std::uint64_t kRowsAhead = 8;
constexpr std::uint64_t kPrefetchRowBytes = 512;

#if MSTAR_KV_STREAMING_STORES
using detail::stream_line;
#endif

// Rows one by one. kPrefetch: the rows ahead on the remote side are
// prefetched (rows apart there). kStream: rows whose lines are whole on the
// local side are written with non-temporal stores, apart there (NHD <- HND:
// a row is a few lines of a page that other rows fill later, and a cached
// store would first read the line) or not (a head split: the rows of a large
// read would only evict the cache; TP 1 -> 8 of Llama-3-70B 7.8 -> 9.1 GB/s).
template <std::uint64_t kLength, bool kPrefetch, bool kStream>
void copy_rows(std::byte* d, const std::byte* r, const StridedSpan& s, const std::byte* next_rows,
               const StridedSpan* next) noexcept {
  const std::uint64_t length = kLength != 0 ? kLength : s.length;
  const std::uint64_t ahead_bytes = std::min(length, kPrefetchRowBytes);
  for (std::uint64_t i = 0; i < s.rows; ++i, d += s.local_stride, r += s.remote_stride) {
    if (kPrefetch) {
      prefetch_bytes<2>(row_ahead(r, s, i, kRowsAhead, next_rows, next), ahead_bytes);
    }
#if MSTAR_KV_STREAMING_STORES
    if (kStream) {
      for (std::uint64_t b = 0; b < length; b += kLine) stream_line(d + b, r + b);
      continue;
    }
#endif
    std::memcpy(d, r, length);
  }
}

template <std::uint64_t kLength>
void copy_rows(std::byte* d, const std::byte* r, const StridedSpan& s, bool prefetch, bool stream,
               const std::byte* next_rows, const StridedSpan* next) noexcept {
  if (stream) {
    if (prefetch) {
      copy_rows<kLength, true, true>(d, r, s, next_rows, next);
    } else {
      copy_rows<kLength, false, true>(d, r, s, next_rows, next);
    }
  } else if (prefetch) {
    copy_rows<kLength, true, false>(d, r, s, next_rows, next);
  } else {
    copy_rows<kLength, false, false>(d, r, s, next_rows, next);
  }
}

}  // namespace

void copy_span_at(std::byte* d, const std::byte* r, const StridedSpan& s, bool streaming,
                  const std::byte* next_rows, const StridedSpan* next) noexcept {
  if (s.rows == 1) {
#if MSTAR_KV_STREAMING_STORES
    if (streaming && s.length >= 4 * kPage) {
      detail::stream_copy_pages(d, r, s.length);
      return;
    }
#endif
    std::memcpy(d, r, s.length);
    return;
  }
  // Streaming: rows apart on the remote side prefetch ahead, rows in whole
  // lines on the local side are stored non-temporally. The common row
  // lengths of KV heads (64-256 bytes of head_dim) as constants: the
  // compiler unrolls them into a few vector moves.
  const bool prefetch = streaming && s.remote_stride != s.length;
  // The rows ahead run on into the next span when it is strided the same way.
  if (next != nullptr && (next->rows == 1 || next->remote_stride == next->length)) next = nullptr;
  if (next == nullptr) next_rows = nullptr;
  bool stream = false;
#if MSTAR_KV_STREAMING_STORES
  stream = streaming && s.length % kLine == 0 && s.local_stride % kLine == 0 &&
           (reinterpret_cast<std::uintptr_t>(d) & (kLine - 1)) == 0;
#endif
  switch (s.length) {
    case 128:
      copy_rows<128>(d, r, s, prefetch, stream, next_rows, next);
      return;
    case 256:
      copy_rows<256>(d, r, s, prefetch, stream, next_rows, next);
      return;
    default:
      copy_rows<0>(d, r, s, prefetch, stream, next_rows, next);
  }
}

void stream_fence() noexcept { detail::stream_fence(); }

}  // namespace mstar::kv::shm
