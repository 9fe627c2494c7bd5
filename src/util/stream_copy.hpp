// Copyright mstar-kv authors.
//
// Copies with non-temporal stores, for reads far larger than the caches
// keep: the destination's lines are written without being read first, and
// the bytes do not evict what the caches hold. Used by the shm engine's
// copies (span_copy.hpp) and the ucx engine's gathered receives
// (ucx_rows.hpp). A thread that streamed calls stream_fence() before it
// publishes that the bytes are there. Elsewhere than x86-64 these are
// memcpy.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>
#include <xmmintrin.h>
#define MSTAR_KV_STREAMING_STORES 1
#endif

namespace mstar::kv::detail {

inline constexpr std::uint64_t kStreamLine = 64;
// Reads of at least this many bytes stream: far more than the caches keep
// (16 MiB: one layer of a 4096-token Llama-3-8B request, which a layer-wise
// stream reads on its own; bench/README.md).
inline constexpr std::uint64_t kStreamReadBytes = 16u << 20;

#if MSTAR_KV_STREAMING_STORES
// One cache line, d 64-byte aligned.
inline void stream_line(std::byte* d, const std::byte* s) noexcept {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 16));
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 32));
  const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 48));
  _mm_stream_si128(reinterpret_cast<__m128i*>(d), a);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 16), b);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 32), c);
  _mm_stream_si128(reinterpret_cast<__m128i*>(d + 48), e);
}
#endif

// Copies the bytes before d's next line boundary (at most n) with memcpy and
// advances past them: what stays is whole destination lines and a tail.
inline void copy_to_line(std::byte*& d, const std::byte*& s, std::uint64_t& n) noexcept {
  const std::uint64_t head = std::min<std::uint64_t>(
      n, (kStreamLine - (reinterpret_cast<std::uintptr_t>(d) & (kStreamLine - 1))) &
             (kStreamLine - 1));
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
}

// n bytes: the destination's whole lines with non-temporal stores, a
// partial first and last line with memcpy.
inline void stream_copy(std::byte* d, const std::byte* s, std::uint64_t n) noexcept {
#if MSTAR_KV_STREAMING_STORES
  copy_to_line(d, s, n);
  for (; n >= kStreamLine; d += kStreamLine, s += kStreamLine, n -= kStreamLine) {
    stream_line(d, s);
  }
#endif
  std::memcpy(d, s, n);
}

// n bytes with non-temporal stores, four pages at a time (four DRAM streams
// in flight, the source prefetched ahead: 15% faster than stream_copy over
// scattered 32 KiB blocks). The shm engine's large copies, and the copy
// baseline's (toolkit/span_copy.hpp), which must be the fastest there is.
inline void stream_copy_pages(std::byte* d, const std::byte* s, std::uint64_t n) noexcept {
#if MSTAR_KV_STREAMING_STORES
  constexpr std::uint64_t kPage = 4096;
  copy_to_line(d, s, n);
  for (; n >= 4 * kPage; d += 4 * kPage, s += 4 * kPage, n -= 4 * kPage) {
    for (std::uint64_t off = 0; off < kPage; off += kStreamLine) {
      for (std::uint64_t p = 0; p < 4; ++p) {
        _mm_prefetch(reinterpret_cast<const char*>(s + p * kPage + off + 4 * kStreamLine),
                     _MM_HINT_T0);
        stream_line(d + p * kPage + off, s + p * kPage + off);
      }
    }
  }
#endif
  stream_copy(d, s, n);  // the last lines, d aligned
}

// Orders this thread's streaming stores before its later stores.
inline void stream_fence() noexcept {
#if MSTAR_KV_STREAMING_STORES
  _mm_sfence();
#endif
}

}  // namespace mstar::kv::detail
