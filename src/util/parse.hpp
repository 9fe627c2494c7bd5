// Copyright mstar-kv authors.
//
// The one parser of numbers given as text: engine options
// (EngineOptions::extra), the CLI's flags, the serve control plane's
// metadata. Errors name what was parsed, the text and the range.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>

namespace mstar::kv::util {

// An unsigned integer in [lo, hi]: decimal, or 0x-prefixed hex. Throws
// Error(code) naming `what`, the text and the range for anything else
// (empty, a sign, trailing characters, out of range).
std::uint64_t parse_u64(std::string_view text, std::string_view what, std::uint64_t lo = 0,
                        std::uint64_t hi = std::numeric_limits<std::uint64_t>::max());

// A finite number in [lo, hi]; throws Error(kInvalidArgument) as above.
double parse_f64(std::string_view text, std::string_view what,
                 double lo = -std::numeric_limits<double>::max(),
                 double hi = std::numeric_limits<double>::max());

}  // namespace mstar::kv::util
