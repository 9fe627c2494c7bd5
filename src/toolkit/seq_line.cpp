// Copyright mstar-kv authors.
#include "toolkit/seq_line.hpp"

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::toolkit {

namespace {
constexpr std::string_view kSeqPrefix = "SEQ ";
}  // namespace

std::string to_hex(std::span<const std::uint8_t> bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (std::uint8_t b : bytes) {
    out.push_back(kDigits[b >> 4]);
    out.push_back(kDigits[b & 15]);
  }
  return out;
}

std::vector<std::uint8_t> from_hex(std::string_view hex) {
  auto nibble = [&](std::size_t at) -> int {
    const char c = hex[at];
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw Error(StatusCode::kCorruptDescriptor,
                "bad hex digit '" + std::string(1, c) + "' at " + std::to_string(at));
  };
  if (hex.size() % 2 != 0) {
    throw Error(StatusCode::kCorruptDescriptor, "odd hex length " + std::to_string(hex.size()));
  }
  std::vector<std::uint8_t> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::uint8_t>(nibble(2 * i) << 4 | nibble(2 * i + 1));
  }
  return out;
}

std::string seq_line(const SequenceInfo& seq) {
  return std::string(kSeqPrefix) + to_hex(seq.encode());
}

std::optional<SequenceInfo> parse_seq_line(std::string_view line) {
  if (line.substr(0, kSeqPrefix.size()) != kSeqPrefix) return std::nullopt;
  return SequenceInfo::decode(from_hex(line.substr(kSeqPrefix.size())));
}

}  // namespace mstar::kv::toolkit
