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

#include "core/stream_copy.hpp"
#include "mstar/kv/planner.hpp"

namespace mstar::kv::shm {

// Jobs of at least this many bytes stream (core/stream_copy.hpp).
inline constexpr std::uint64_t kStreamBytes = detail::kStreamReadBytes;

// Copies one span's rows from src + remote offsets to dst + local offsets.
// Streaming, `next` (the span copied after this one, if any) lets the rows
// prefetched ahead run on into it.
void copy_span(std::byte* dst, const std::byte* src, const StridedSpan& s,
               bool streaming = false, const StridedSpan* next = nullptr) noexcept;

// Orders the streaming stores of this thread before its later stores (an
// sfence on x86-64; nothing elsewhere).
void stream_fence() noexcept;

}  // namespace mstar::kv::shm
