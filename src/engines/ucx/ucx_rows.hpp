// Copyright mstar-kv authors.
//
// Gathered replies on the wire (kReqGather, ucx_wire.hpp) through UCP
// generic datatypes, fragment by fragment: the owner packs a strided
// message's rows straight from its registered pages (RowSource, with the
// rows ahead prefetched: rows a few hundred bytes to a few KiB long, apart on
// the owner's side, cost the owner's progress thread a third more per byte
// through an iov), and the reader unpacks every gathered reply into its
// rows (RowSink, with non-temporal stores in large reads).
#pragma once

#include <ucp/api/ucp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/core/regions.hpp"

namespace mstar::kv::ucx {

// A position in the rows of strided spans on one side (kLocal: their
// local offsets and strides; else the remote ones), and the walk from it:
// walk(base, spans, count, offset, n, piece) visits bytes [offset, offset +
// n) of the rows in order (fewer at the end), calling piece(p, done, c, s,
// row) for each run of c bytes at p, `done` bytes into the walk, in span s,
// row `row` (a span whose rows touch on this side is one row). UCX moves a
// message in order: the cursor continues; any other offset is found from
// the start.
template <bool kLocal>
class RowCursor {
 public:
  template <typename Byte, typename Piece>
  std::size_t walk(const RegionMap& map, const StridedSpan* spans, std::size_t count,
                   std::uint64_t offset, std::size_t n, Piece&& piece) noexcept {
    if (offset != at_) seek(spans, count, offset);
    std::size_t done = 0;
    while (done < n && span_ < count) {
      const StridedSpan& s = spans[span_];
      const bool run = one_run(s);
      const std::uint64_t length = run ? s.bytes() : s.length;
      const std::uint64_t c = std::min<std::uint64_t>(length - in_row_, n - done);
      // A span's rows lie in one region (planner.hpp): its first byte maps it.
      piece(map.pointer<Byte>(start(s)) + row_ * stride(s) + in_row_, done, c, s, row_);
      done += c;
      in_row_ += c;
      if (in_row_ == length) {
        in_row_ = 0;
        if (++row_ == (run ? 1 : s.rows)) {
          row_ = 0;
          ++span_;
        }
      }
    }
    at_ = offset + done;
    return done;
  }

  static std::uint64_t start(const StridedSpan& s) noexcept {
    return kLocal ? s.local_offset : s.remote_offset;
  }
  static std::uint64_t stride(const StridedSpan& s) noexcept {
    return kLocal ? s.local_stride : s.remote_stride;
  }
  static bool one_run(const StridedSpan& s) noexcept {
    return s.rows == 1 || stride(s) == s.length;
  }

 private:
  void seek(const StridedSpan* spans, std::size_t count, std::uint64_t offset) noexcept {
    span_ = 0;
    row_ = 0;
    in_row_ = 0;
    at_ = 0;
    while (span_ < count && at_ + spans[span_].bytes() <= offset) at_ += spans[span_++].bytes();
    if (span_ == count) return;
    const StridedSpan& s = spans[span_];
    const std::uint64_t into = offset - at_;
    row_ = one_run(s) ? 0 : into / s.length;
    in_row_ = one_run(s) ? into : into % s.length;
    at_ = offset;
  }

  std::size_t span_ = 0;
  std::uint64_t row_ = 0;
  std::uint64_t in_row_ = 0;
  std::uint64_t at_ = 0;
};

// The remote side's rows of spans[0, count) in order: what one gathered
// message carries. The spans were checked against the region; they and the
// pages must outlive the send.
struct RowSource {
  RowSource() = default;
  RowSource(RegionMap m, const StridedSpan* s, std::size_t n, std::uint64_t total) noexcept
      : map(std::move(m)), spans(s), count(n), bytes(total) {}
  RowSource(const std::byte* b, const StridedSpan* s, std::size_t n, std::uint64_t total) noexcept
      : RowSource(RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(b)), s, n, total) {}

  RegionMap map;  // the owner's cache: remote offsets -> its pages
  const StridedSpan* spans = nullptr;
  std::size_t count = 0;
  std::uint64_t bytes = 0;  // of every row of every span

  // Copies bytes [offset, offset + max_length) of the rows (fewer at the
  // end) to dest; returns how many.
  std::size_t pack(std::uint64_t offset, std::byte* dest, std::size_t max_length) noexcept;

 private:
  RowCursor<false> cursor_;
};

// The local side's rows of spans[0, count) in order: where one gathered
// message lands on the reader. With `stream` (a large read), rows in whole
// cache lines are written with non-temporal stores (no read of the
// destination first).
struct RowSink {
  RowSink() = default;
  RowSink(RegionMap m, const StridedSpan* s, std::size_t n, std::uint64_t total,
          bool streaming) noexcept
      : map(std::move(m)), spans(s), count(n), bytes(total), stream(streaming) {}
  RowSink(std::byte* b, const StridedSpan* s, std::size_t n, std::uint64_t total,
          bool streaming) noexcept
      : RowSink(RegionMap::contiguous(reinterpret_cast<std::uintptr_t>(b)), s, n, total,
                streaming) {}

  RegionMap map;  // the reader's cache: local offsets -> its pages
  const StridedSpan* spans = nullptr;
  std::size_t count = 0;
  std::uint64_t bytes = 0;
  bool stream = false;

  // Writes src[0, length) as bytes [offset, offset + length) of the rows
  // (never past them: the datatype checks the fragment against `bytes`).
  void unpack(std::uint64_t offset, const std::byte* src, std::size_t length) noexcept;

 private:
  RowCursor<true> cursor_;
};

// A UCP generic datatype whose buffer is one RowSource (pack) or one
// RowSink (unpack), count 1.
class RowDatatype {
 public:
  RowDatatype() = default;
  RowDatatype(RowDatatype&& o) noexcept : dt_(std::exchange(o.dt_, 0)) {}
  RowDatatype& operator=(RowDatatype&& o) noexcept {
    if (this != &o) {
      reset();
      dt_ = std::exchange(o.dt_, 0);
    }
    return *this;
  }
  RowDatatype(const RowDatatype&) = delete;
  RowDatatype& operator=(const RowDatatype&) = delete;
  ~RowDatatype() { reset(); }

  // Throws Error(kUnavailable) when UCX refuses to make it.
  static RowDatatype create_source();  // sends from RowSources
  static RowDatatype create_sink();    // receives into RowSinks
  ucp_datatype_t get() const noexcept { return dt_; }

 private:
  static RowDatatype make(const ucp_generic_dt_ops_t& ops);
  void reset() noexcept;
  ucp_datatype_t dt_ = 0;
};

}  // namespace mstar::kv::ucx
