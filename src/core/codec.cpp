// Copyright mstar-kv authors.
#include "codec.hpp"

#include <array>
#include <string>

#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::codec {

namespace {

constexpr std::array<std::uint8_t, 4> kMagic = {'M', 'S', 'K', 'V'};
constexpr std::size_t kHeaderBytes = 4 + 2 + 2 + 4;
constexpr std::size_t kTrailerBytes = 4;

constexpr std::array<std::uint32_t, 256> make_crc_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    table[i] = c;
  }
  return table;
}
constexpr auto kCrcTable = make_crc_table();

}  // namespace

std::uint32_t crc32c(std::span<const std::uint8_t> bytes) noexcept {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::uint8_t b : bytes) c = kCrcTable[(c ^ b) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

void ByteWriter::u16(std::uint16_t v) {
  for (int i = 0; i < 2; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void ByteWriter::u32(std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void ByteWriter::u64(std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out_.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
}
void ByteWriter::bytes(std::span<const std::uint8_t> v) {
  u32(static_cast<std::uint32_t>(v.size()));
  out_.insert(out_.end(), v.begin(), v.end());
}
void ByteWriter::str(std::string_view v) {
  u32(static_cast<std::uint32_t>(v.size()));
  out_.insert(out_.end(), v.begin(), v.end());
}
void ByteWriter::layout(const KVLayout& l) {
  u32(l.num_layers);
  u32(l.num_pages);
  u32(l.page_size);
  u32(l.num_kv_heads);
  u32(l.head_dim);
  u8(static_cast<std::uint8_t>(l.dtype));
  boolean(l.has_v);
  u8(static_cast<std::uint8_t>(l.cache_order));
  u8(static_cast<std::uint8_t>(l.page_order));
  u32(l.total_kv_heads);
  u32(l.first_kv_head);
}

void ByteReader::fail(std::string_view field, const std::string& why) const {
  throw Error(StatusCode::kCorruptDescriptor, what_ + " field '" + std::string(field) +
                                                  "' at byte " + std::to_string(pos_) + ": " + why);
}

std::span<const std::uint8_t> ByteReader::take(std::string_view field, std::size_t n) {
  if (n > remaining()) {
    fail(field, "truncated: need " + std::to_string(n) + " bytes, " + std::to_string(remaining()) +
                    " left");
  }
  auto out = in_.subspan(pos_, n);
  pos_ += n;
  return out;
}

std::uint8_t ByteReader::u8(std::string_view field) { return take(field, 1)[0]; }

std::uint16_t ByteReader::u16(std::string_view field) {
  auto b = take(field, 2);
  return static_cast<std::uint16_t>(b[0] | (b[1] << 8));
}

std::uint32_t ByteReader::u32(std::string_view field) {
  auto b = take(field, 4);
  std::uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | b[static_cast<std::size_t>(i)];
  return v;
}

std::uint32_t ByteReader::u32_in(std::string_view field, std::string_view what, std::uint32_t lo,
                                 std::uint32_t hi) {
  const std::uint32_t v = u32(field);
  if (v < lo || v > hi) {
    fail(field, std::string(what) + " " + std::to_string(v) + " out of range [" +
                    std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v;
}

std::uint64_t ByteReader::u64(std::string_view field) {
  auto b = take(field, 8);
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | b[static_cast<std::size_t>(i)];
  return v;
}

bool ByteReader::boolean(std::string_view field) {
  const std::uint8_t v = u8(field);
  if (v > 1) fail(field, "boolean byte " + std::to_string(v) + " not 0 or 1");
  return v == 1;
}

std::span<const std::uint8_t> ByteReader::bytes(std::string_view field, std::size_t max_len) {
  const std::uint32_t n = u32(field);
  if (n > max_len) {
    fail(field, "length " + std::to_string(n) + " exceeds limit " + std::to_string(max_len));
  }
  return take(field, n);
}

std::string ByteReader::str(std::string_view field, std::size_t max_len) {
  auto b = bytes(field, max_len);
  return std::string(b.begin(), b.end());
}

KVLayout ByteReader::layout(std::string_view field) {
  KVLayout l;
  l.num_layers = u32(field);
  l.num_pages = u32(field);
  l.page_size = u32(field);
  l.num_kv_heads = u32(field);
  l.head_dim = u32(field);
  const std::uint8_t dtype = u8(field);
  if (dtype > static_cast<std::uint8_t>(DType::kFloat8E5M2)) {
    fail(field, "dtype " + std::to_string(dtype) + " out of range [0, 4]");
  }
  l.dtype = static_cast<DType>(dtype);
  l.has_v = boolean(field);
  const std::uint8_t co = u8(field);
  const std::uint8_t po = u8(field);
  // Descriptors from before layer_page (2) hold 0 or 1 and decode as they
  // did; a build without layer_page refuses a 2 here, by name.
  if (co > kMaxCacheOrder) {
    fail(field, "cache_order " + std::to_string(co) + " out of range [0, " +
                    std::to_string(kMaxCacheOrder) + "] (layer, page, layer_page)");
  }
  if (po > kMaxPageOrder) {
    fail(field, "page_order " + std::to_string(po) + " out of range [0, " +
                    std::to_string(kMaxPageOrder) + "] (nhd, hnd)");
  }
  l.cache_order = static_cast<CacheOrder>(co);
  l.page_order = static_cast<PageOrder>(po);
  l.total_kv_heads = u32(field);
  l.first_kv_head = u32(field);
  try {
    l.validate();
  } catch (const Error& e) {
    fail(field, e.status().message());
  }
  return l;
}

void ByteReader::expect_end() const {
  if (remaining() != 0) {
    throw Error(StatusCode::kCorruptDescriptor,
                what_ + ": " + std::to_string(remaining()) + " unexpected trailing bytes");
  }
}

std::vector<std::uint8_t> encode_frame(FrameKind kind, std::span<const std::uint8_t> payload) {
  ByteWriter w;
  for (auto m : kMagic) w.u8(m);
  w.u16(kVersion);
  w.u16(static_cast<std::uint16_t>(kind));
  w.u32(static_cast<std::uint32_t>(payload.size()));
  w.data().insert(w.data().end(), payload.begin(), payload.end());
  w.u32(crc32c(w.data()));
  return w.take();
}

std::span<const std::uint8_t> decode_frame(std::span<const std::uint8_t> bytes, FrameKind kind,
                                           std::string_view what) {
  const std::string name(what);
  if (bytes.size() > DescriptorLimits::kMaxFrameBytes) {
    throw Error(StatusCode::kCorruptDescriptor,
                name + ": " + std::to_string(bytes.size()) + " bytes exceed the limit of " +
                    std::to_string(DescriptorLimits::kMaxFrameBytes));
  }
  if (bytes.size() < kHeaderBytes + kTrailerBytes) {
    throw Error(StatusCode::kCorruptDescriptor, name + ": truncated, " +
                                                    std::to_string(bytes.size()) +
                                                    " bytes is less than the minimum frame of " +
                                                    std::to_string(kHeaderBytes + kTrailerBytes));
  }
  ByteReader r(bytes, what);
  for (auto m : kMagic) {
    if (r.u8("magic") != m) r.fail("magic", "not an mstar-kv descriptor");
  }
  const std::uint16_t version = r.u16("version");
  if (version != kVersion) {
    r.fail("version", "unsupported version " + std::to_string(version) +
                          ", this build reads version " + std::to_string(kVersion));
  }
  const std::uint16_t got_kind = r.u16("kind");
  if (got_kind != static_cast<std::uint16_t>(kind)) {
    r.fail("kind", "frame kind " + std::to_string(got_kind) + ", expected " +
                       std::to_string(static_cast<int>(kind)));
  }
  const std::uint32_t len = r.u32("length");
  if (len != bytes.size() - kHeaderBytes - kTrailerBytes) {
    r.fail("length", "payload length " + std::to_string(len) + " does not match the " +
                         std::to_string(bytes.size() - kHeaderBytes - kTrailerBytes) +
                         " bytes present");
  }
  const std::uint32_t want = crc32c(bytes.first(kHeaderBytes + len));
  const auto crc_bytes = bytes.subspan(kHeaderBytes + len, 4);
  std::uint32_t got = 0;
  for (int i = 3; i >= 0; --i) got = (got << 8) | crc_bytes[static_cast<std::size_t>(i)];
  if (got != want) {
    throw Error(StatusCode::kCorruptDescriptor, name + ": checksum mismatch (stored " +
                                                    std::to_string(got) + ", computed " +
                                                    std::to_string(want) + ")");
  }
  return bytes.subspan(kHeaderBytes, len);
}

}  // namespace mstar::kv::codec
