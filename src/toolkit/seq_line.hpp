// Copyright mstar-kv authors.
//
// How processes of the tools and tests hand each other a SequenceInfo on a
// text line: "SEQ <its encoded bytes as lowercase hex>". One codec for the
// soak's prefill processes, the bench and every multi-process test.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mstar/kv/core/descriptor.hpp"

namespace mstar::kv::toolkit {

std::string to_hex(std::span<const std::uint8_t> bytes);
// Throws Error(kCorruptDescriptor) on an odd length or a non-hex digit,
// naming it.
std::vector<std::uint8_t> from_hex(std::string_view hex);

// "SEQ <hex>" for `seq`.
std::string seq_line(const SequenceInfo& seq);
// The sequence of a "SEQ <hex>" line; nullopt for any other line. Throws
// Error (bad hex, SequenceInfo::decode's errors) for a SEQ line that does
// not decode.
std::optional<SequenceInfo> parse_seq_line(std::string_view line);

}  // namespace mstar::kv::toolkit
