// Copyright mstar-kv authors.
//
// The shm engine's byte copies: one (strided) span from the owner's mapped
// cache into the local one, in one of two modes.
//   cached     memcpy per row: for reads that a cache keeps (small jobs, and
//              every read copied inline).
//   streaming  for jobs far larger than what caches keep (CopyPool decides,
//              kStreamBytes): contiguous runs of 16 KiB and more are copied
//              four pages at a time with non-temporal stores (no read of
//              the destination before it is written, four DRAM streams in
//              flight: what glibc's memcpy does for one large copy, but not
//              for the many 32-128 KiB blocks of a scattered page table,
//              measured 0.6 of a contiguous memcpy with memcpy per block);
//              strided rows prefetch the rows ahead of the one copied.
//              A thread that streamed calls stream_fence() before it
//              publishes that the bytes are there.
// Elsewhere than x86-64 streaming copies are cached copies.
#pragma once

#include <cstddef>
#include <cstdint>

#include "mstar/kv/core/planner.hpp"
#include "util/stream_copy.hpp"

namespace mstar::kv::shm {

// Jobs of at least this many bytes stream (core/stream_copy.hpp).
inline constexpr std::uint64_t kStreamBytes = detail::kStreamReadBytes;

// Copies one span's rows from r (where its first remote row is in this
// process) to d (its first local row); the rows follow at the span's
// strides. Streaming, `next` (the span copied after this one, if any, its
// first remote row at next_rows) lets the rows prefetched ahead run on into
// it.
void copy_span_at(std::byte* d, const std::byte* r, const StridedSpan& s, bool streaming,
                  const std::byte* next_rows, const StridedSpan* next) noexcept;

// The same from src + remote offsets to dst + local offsets (one region on
// each side).
inline void copy_span(std::byte* dst, const std::byte* src, const StridedSpan& s,
                      bool streaming = false, const StridedSpan* next = nullptr) noexcept {
  copy_span_at(dst + s.local_offset, src + s.remote_offset, s, streaming,
               next != nullptr ? src + next->remote_offset : nullptr, next);
}

// Orders the streaming stores of this thread before its later stores (an
// sfence on x86-64; nothing elsewhere).
void stream_fence() noexcept;

}  // namespace mstar::kv::shm
