// Copyright mstar-kv authors.
#include "ucx_auth.hpp"

#include <cstring>
#include <string_view>
#include <vector>

#include "util/auth.hpp"

namespace mstar::kv::ucx {

namespace {

Mac proof(const std::string& secret, std::string_view label, const Nonce& first,
          const Nonce& second) {
  std::vector<std::uint8_t> msg(label.begin(), label.end());
  msg.insert(msg.end(), first.begin(), first.end());
  msg.insert(msg.end(), second.begin(), second.end());
  const auth::Digest d =
      auth::hmac_sha256({reinterpret_cast<const std::uint8_t*>(secret.data()), secret.size()}, msg);
  Mac m;
  std::memcpy(m.data(), d.data(), m.size());
  return m;
}

}  // namespace

Nonce new_nonce() {
  Nonce n;
  auth::random_bytes(n);
  return n;
}

std::uint64_t new_ticket() {
  std::uint64_t t = 0;
  while (t == 0) {
    auth::random_bytes({reinterpret_cast<std::uint8_t*>(&t), sizeof t});
  }
  return t;
}

Mac owner_proof(const std::string& secret, const Nonce& nonce_r, const Nonce& nonce_o) {
  return proof(secret, "mstar-kv/ucx/owner", nonce_r, nonce_o);
}

Mac reader_proof(const std::string& secret, const Nonce& nonce_r, const Nonce& nonce_o) {
  return proof(secret, "mstar-kv/ucx/reader", nonce_o, nonce_r);
}

bool proof_matches(const Mac& expected, const std::uint8_t (&got)[kMacBytes]) {
  return auth::constant_time_equal(std::span<const std::uint8_t>(expected),
                                   std::span<const std::uint8_t>(got, kMacBytes));
}

}  // namespace mstar::kv::ucx
