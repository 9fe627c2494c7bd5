// Copyright mstar-kv authors.
#include "ucx_rows.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "core/row_prefetch.hpp"
#include "mstar/kv/util/status.hpp"
#include "util/stream_copy.hpp"

namespace mstar::kv::ucx {

namespace {

// Rows prefetched ahead of the one copied, and at most how many bytes of
// each (a row gather of 1 KiB rows 2 KiB apart: 14-15 -> 16-17 GB/s with 4
// rows ahead in a microbenchmark; 8 no better).
constexpr std::uint64_t kRowsAhead = 4;
constexpr std::uint64_t kPrefetchRowBytes = 1024;
// Row pieces shorter than this are memcpy'd even when streaming.
constexpr std::uint64_t kStreamMin = 256;

}  // namespace

std::size_t RowSource::pack(std::uint64_t offset, std::byte* dest,
                            std::size_t max_length) noexcept {
  return cursor_.walk<const std::byte>(
      map, spans, count, offset, max_length,
      [&](const std::byte* p, std::size_t done, std::uint64_t c, const StridedSpan& s,
          std::uint64_t row) {
        // At a row's start, the rows ahead (on into the next span).
        const std::byte* first = map.pointer<const std::byte>(s.remote_offset);
        if (p == first + row * s.remote_stride && !RowCursor<false>::one_run(s)) {
          const StridedSpan* next = &s + 1 < spans + count ? &s + 1 : nullptr;
          const std::byte* next_first =
              next != nullptr ? map.pointer<const std::byte>(next->remote_offset) : nullptr;
          prefetch_bytes<3>(row_ahead(p, s, row, kRowsAhead, next_first, next),
                            std::min(s.length, kPrefetchRowBytes));
        }
        std::memcpy(dest + done, p, c);
      });
}

void RowSink::unpack(std::uint64_t offset, const std::byte* src, std::size_t length) noexcept {
  bool streamed = false;
  cursor_.walk<std::byte>(
      map, spans, count, offset, length,
      [&](std::byte* p, std::size_t done, std::uint64_t c, const StridedSpan&, std::uint64_t) {
        if (stream && c >= kStreamMin) {
          detail::stream_copy(p, src + done, c);
          streamed = true;
        } else {
          std::memcpy(p, src + done, c);
        }
      });
  if (streamed) detail::stream_fence();  // before UCX reports the receive done
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
