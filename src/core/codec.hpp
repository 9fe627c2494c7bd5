// Copyright mstar-kv authors.
//
// Byte codec for descriptors (private to the library and its engines).
//
// Frame: "MSKV" | u16 version | u16 kind | u32 payload length | payload |
// u32 CRC-32C of everything before it. Integers are little-endian.
// ByteReader never reads past its span: every getter checks first and throws
// Error(kCorruptDescriptor) naming the field and the bytes missing.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mstar/kv/core/layout.hpp"

namespace mstar::kv::codec {

inline constexpr std::uint16_t kVersion = 1;

// Frame kinds. Engines own the payload of their transfer infos; these kinds
// only tag top-level frames.
enum class FrameKind : std::uint16_t {
  kTransferInfo = 1,
  kSequenceInfo = 2,
  kRequestInfo = 3,
};

std::uint32_t crc32c(std::span<const std::uint8_t> bytes) noexcept;

class ByteWriter {
 public:
  void u8(std::uint8_t v) { out_.push_back(v); }
  void u16(std::uint16_t v);
  void u32(std::uint32_t v);
  void u64(std::uint64_t v);
  void boolean(bool v) { u8(v ? 1 : 0); }
  // u32 length, then the bytes.
  void bytes(std::span<const std::uint8_t> v);
  void str(std::string_view v);
  void layout(const KVLayout& l);

  std::vector<std::uint8_t>& data() noexcept { return out_; }
  std::vector<std::uint8_t> take() { return std::move(out_); }

 private:
  std::vector<std::uint8_t> out_;
};

class ByteReader {
 public:
  // `what` names the object being decoded in error messages.
  ByteReader(std::span<const std::uint8_t> in, std::string_view what) : in_(in), what_(what) {}

  std::uint8_t u8(std::string_view field);
  std::uint16_t u16(std::string_view field);
  std::uint32_t u32(std::string_view field);
  std::uint64_t u64(std::string_view field);
  // A u32 in [lo, hi]; else fails "<what> <value> out of range [lo, hi]".
  std::uint32_t u32_in(std::string_view field, std::string_view what, std::uint32_t lo,
                       std::uint32_t hi);
  bool boolean(std::string_view field);
  // Length-prefixed; throws when the length exceeds max_len or the input.
  std::span<const std::uint8_t> bytes(std::string_view field, std::size_t max_len);
  std::string str(std::string_view field, std::size_t max_len);
  // Decodes and validates (KVLayout::validate) a layout.
  KVLayout layout(std::string_view field);

  std::size_t remaining() const noexcept { return in_.size() - pos_; }
  // Whether the next byte is `v` (false at the end); reads nothing.
  bool next_is(std::uint8_t v) const noexcept { return pos_ < in_.size() && in_[pos_] == v; }
  // Throws unless every byte was consumed.
  void expect_end() const;
  [[noreturn]] void fail(std::string_view field, const std::string& why) const;

 private:
  std::span<const std::uint8_t> take(std::string_view field, std::size_t n);

  std::span<const std::uint8_t> in_;
  std::size_t pos_ = 0;
  std::string what_;
};

std::vector<std::uint8_t> encode_frame(FrameKind kind, std::span<const std::uint8_t> payload);
// Checks magic, version, kind, length and CRC; returns the payload.
std::span<const std::uint8_t> decode_frame(std::span<const std::uint8_t> bytes, FrameKind kind,
                                           std::string_view what);

}  // namespace mstar::kv::codec
