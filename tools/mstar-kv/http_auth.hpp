// Copyright mstar-kv authors.
//
// The shared secret of `mstar-kv serve` / `pull` (--token-file) and the checks
// around it. The comparison and the minimum length are the library's
// (src/util/auth.hpp), the same the UCX handshake uses.
#pragma once

#include <string>
#include <string_view>

#include "util/auth.hpp"

namespace mstar::kv::cli {

// The least a token may hold, in bytes (after the trailing newline is cut).
inline constexpr std::size_t kMinTokenBytes = auth::kMinTokenBytes;

// Reads the secret from `path`: the whole file less trailing "\n" / "\r\n".
// Throws Error (kInvalidArgument) naming the file when it cannot be read, is
// shorter than kMinTokenBytes, or holds a space or control character (the
// token travels in an HTTP header).
std::string read_token_file(const std::string& path);

// True when a == b; the time taken depends on the lengths only, never on
// where the two differ (auth::constant_time_equal).
bool constant_time_equal(std::string_view a, std::string_view b);

// True for an address only this host can reach: 127.0.0.0/8, ::1,
// "localhost". Anything else, names included, counts as reachable by others.
bool is_loopback_host(const std::string& host);

}  // namespace mstar::kv::cli
