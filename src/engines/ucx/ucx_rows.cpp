// Copyright mstar-kv authors.
#include "ucx_rows.hpp"

#include <algorithm>
#include <cstring>
#include <string>


#include "core/stream_copy.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv::ucx {

namespace {

// Rows prefetched ahead of the one copied, and at most how many bytes of
// each (a row gather of 1 KiB rows 2 KiB apart: 14-15 -> 16-17 GB/s with 4
// rows ahead in a microbenchmark; 8 no better).
constexpr std::uint64_t kRowsAhead = 4;
constexpr std::uint64_t kPrefetchRowBytes = 1024;
constexpr std::uint64_t kLine = 64;
// Row pieces shorter than this are memcpy'd even when streaming.
constexpr std::uint64_t kStreamMin = 256;


}  // namespace

void RowSource::seek(std::uint64_t offset) noexcept {
  span_ = 0;
  row_ = 0;
  in_row_ = 0;
  at_ = 0;
  while (span_ < count && at_ + spans[span_].bytes() <= offset) at_ += spans[span_++].bytes();
  if (span_ == count) return;
  const StridedSpan& s = spans[span_];
  const std::uint64_t into = offset - at_;
  const bool run = s.remote_stride == s.length;  // pack copies it as one row
  row_ = run ? 0 : into / s.length;
  in_row_ = run ? into : into % s.length;
  at_ = offset;
}

std::size_t RowSource::pack(std::uint64_t offset, std::byte* dest,
                            std::size_t max_length) noexcept {
  if (offset != at_) seek(offset);
  std::size_t n = 0;
  while (n < max_length && span_ < count) {
    const StridedSpan& s = spans[span_];
    const bool run = s.remote_stride == s.length;  // the rows are one run
    const std::uint64_t length = run ? s.bytes() : s.length;
    const std::uint64_t rows = run ? 1 : s.rows;
    const std::byte* p = base + s.remote_offset + row_ * s.remote_stride + in_row_;
    if (!run && in_row_ == 0) {
      const std::uint64_t a = row_ + kRowsAhead;
      const std::byte* q = a < rows                   ? base + s.remote_offset + a * s.remote_stride
                           : span_ + 1 < count        ? base + spans[span_ + 1].remote_offset
                                                      : nullptr;
      if (q != nullptr) {
        const std::uint64_t ahead = std::min(s.length, kPrefetchRowBytes);
        for (std::uint64_t b = 0; b < ahead; b += kLine) __builtin_prefetch(q + b, 0, 3);
      }
    }
    const std::uint64_t c = std::min<std::uint64_t>(length - in_row_, max_length - n);
    std::memcpy(dest + n, p, c);
    n += c;
    in_row_ += c;
    if (in_row_ == length) {
      in_row_ = 0;
      if (++row_ == rows) {
        row_ = 0;
        ++span_;
      }
    }
  }
  at_ = offset + n;
  return n;
}

void RowSink::seek(std::uint64_t offset) noexcept {
  span_ = 0;
  row_ = 0;
  in_row_ = 0;
  at_ = 0;
  while (span_ < count && at_ + spans[span_].bytes() <= offset) at_ += spans[span_++].bytes();
  if (span_ == count) return;
  const StridedSpan& s = spans[span_];
  const std::uint64_t into = offset - at_;
  const bool run = s.local_stride == s.length;
  row_ = run ? 0 : into / s.length;
  in_row_ = run ? into : into % s.length;
  at_ = offset;
}

void RowSink::unpack(std::uint64_t offset, const std::byte* src, std::size_t length) noexcept {
  if (offset != at_) seek(offset);
  std::size_t n = 0;
  bool streamed = false;
  while (n < length && span_ < count) {
    const StridedSpan& s = spans[span_];
    const bool run = s.local_stride == s.length || s.rows == 1;
    const std::uint64_t len = run ? s.bytes() : s.length;
    const std::uint64_t rows = run ? 1 : s.rows;
    std::byte* d = base + s.local_offset + row_ * s.local_stride + in_row_;
    const std::uint64_t c = std::min<std::uint64_t>(len - in_row_, length - n);
    if (stream && c >= kStreamMin) {
      detail::stream_copy(d, src + n, c);
      streamed = true;
    } else {
      std::memcpy(d, src + n, c);
    }
    n += c;
    in_row_ += c;
    if (in_row_ == len) {
      in_row_ = 0;
      if (++row_ == rows) {
        row_ = 0;
        ++span_;
      }
    }
  }
  if (streamed) detail::stream_fence();  // before UCX reports the receive done
  at_ = offset + n;
}

void RowDatatype::reset() noexcept {
  if (dt_ != 0) ucp_dt_destroy(std::exchange(dt_, 0));
}

RowDatatype RowDatatype::create_source() {
  static const ucp_generic_dt_ops_t ops = {
      // start_pack: the state is the RowSource itself.
      [](void*, const void* buffer, std::size_t) -> void* { return const_cast<void*>(buffer); },
      [](void*, void*, std::size_t) -> void* { return nullptr; },  // never received into
      [](void* state) -> std::size_t { return static_cast<RowSource*>(state)->bytes; },
      [](void* state, std::size_t offset, void* dest, std::size_t max_length) -> std::size_t {
        return static_cast<RowSource*>(state)->pack(offset, static_cast<std::byte*>(dest),
                                                    max_length);
      },
      [](void*, std::size_t, const void*, std::size_t) -> ucs_status_t {
        return UCS_ERR_UNSUPPORTED;
      },
      [](void*) {},
  };
  return make(ops);
}

RowDatatype RowDatatype::create_sink() {
  static const ucp_generic_dt_ops_t ops = {
      [](void*, const void*, std::size_t) -> void* { return nullptr; },  // never sent from
      // start_unpack: the state is the RowSink itself.
      [](void*, void* buffer, std::size_t) -> void* { return buffer; },
      [](void* state) -> std::size_t { return static_cast<RowSink*>(state)->bytes; },
      [](void*, std::size_t, void*, std::size_t) -> std::size_t { return 0; },
      [](void* state, std::size_t offset, const void* src, std::size_t length) -> ucs_status_t {
        auto* sink = static_cast<RowSink*>(state);
        if (offset > sink->bytes || length > sink->bytes - offset) return UCS_ERR_MESSAGE_TRUNCATED;
        sink->unpack(offset, static_cast<const std::byte*>(src), length);
        return UCS_OK;
      },
      [](void*) {},
  };
  return make(ops);
}

RowDatatype RowDatatype::make(const ucp_generic_dt_ops_t& ops) {
  RowDatatype d;
  const ucs_status_t st = ucp_dt_create_generic(&ops, nullptr, &d.dt_);
  if (st != UCS_OK) {
    throw Error(StatusCode::kUnavailable,
                std::string("ucp_dt_create_generic: ") + ucs_status_string(st));
  }
  return d;
}

}  // namespace mstar::kv::ucx
