// Copyright mstar-kv authors.
//
// The ucx engine's challenge-response over a shared secret (the wire is in
// ucx_wire.hpp). Mutual: the owner proves the secret before the reader
// does, so a reader holding a token never takes KV from an owner that
// cannot prove it; the secret itself never crosses the wire, only HMACs
// over fresh nonces from both sides under distinct labels (a proof from one
// role is never valid for the other, and no proof is valid twice).
//
// What it does not give: confidentiality or integrity of the data that
// follows (KV bytes cross in clear, as in every UCX transport); the ticket
// that authorises later requests travels in clear too, so an eavesdropper
// on the path could replay it while the connection lives. Use it on
// networks where peers are not trusted to know the secret but the path is
// not tapped; tunnel otherwise.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "ucx_wire.hpp"

namespace mstar::kv::ucx {

using Nonce = std::array<std::uint8_t, kNonceBytes>;
using Mac = std::array<std::uint8_t, kMacBytes>;

Nonce new_nonce();
// A random non-zero ticket.
std::uint64_t new_ticket();
// HMAC(secret, "mstar-kv/ucx/owner" | nonce_r | nonce_o).
Mac owner_proof(const std::string& secret, const Nonce& nonce_r, const Nonce& nonce_o);
// HMAC(secret, "mstar-kv/ucx/reader" | nonce_o | nonce_r).
Mac reader_proof(const std::string& secret, const Nonce& nonce_r, const Nonce& nonce_o);
// Constant-time.
bool proof_matches(const Mac& expected, const std::uint8_t (&got)[kMacBytes]);

}  // namespace mstar::kv::ucx
