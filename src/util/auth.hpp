// Copyright mstar-kv authors.
//
// Peer authentication primitives (internal): HMAC-SHA-256 (RFC 2104 over
// FIPS 180-4), a constant-time comparison, and random bytes from the
// kernel. Engines use them for challenge-response over a shared secret
// (EngineOptions.extra["auth_token"]), so the secret never crosses the wire;
// the HTTP control plane compares bearer tokens with constant_time_equal.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>

namespace mstar::kv::auth {

using Digest = std::array<std::uint8_t, 32>;

// The EngineOptions.extra key that holds the shared secret.
inline constexpr const char* kTokenKey = "auth_token";

Digest sha256(std::span<const std::uint8_t> data);
Digest hmac_sha256(std::span<const std::uint8_t> key, std::span<const std::uint8_t> msg);

// True when a and b are equal; the time taken depends only on the lengths.
bool constant_time_equal(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b);
bool constant_time_equal(const std::string& a, const std::string& b);

// Fills `out` from getrandom(2); throws Error(kInternal) if the kernel fails.
void random_bytes(std::span<std::uint8_t> out);

// The secret in extra["auth_token"], "" when absent. Throws
// Error(kInvalidArgument) for a token shorter than kMinTokenBytes (a guessable
// secret defeats the handshake).
inline constexpr std::size_t kMinTokenBytes = 16;
std::string token_from(const std::map<std::string, std::string>& extra);

}  // namespace mstar::kv::auth
