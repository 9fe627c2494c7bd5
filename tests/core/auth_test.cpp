// Copyright mstar-kv authors.
// Known-answer tests of the authentication primitives: SHA-256 (FIPS 180-4
// examples), HMAC-SHA-256 (RFC 4231 test cases 1, 2, 6, 7), the constant-time
// comparison, random bytes and the auth_token option.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mstar/kv/util/status.hpp"
#include "util/auth.hpp"

namespace mstar::kv::auth {
namespace {

std::span<const std::uint8_t> bytes(const std::string& s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

std::string hex(const Digest& d) {
  static const char* k = "0123456789abcdef";
  std::string out;
  for (std::uint8_t b : d) {
    out += k[b >> 4];
    out += k[b & 15];
  }
  return out;
}

TEST(Auth, Sha256KnownAnswers) {
  EXPECT_EQ(hex(sha256(bytes(""))),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(hex(sha256(bytes("abc"))),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  // Two blocks: the 448-bit message of FIPS 180-4's example.
  EXPECT_EQ(hex(sha256(bytes("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"))),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  // A million 'a': many blocks, length bits beyond one byte.
  EXPECT_EQ(hex(sha256(bytes(std::string(1000000, 'a')))),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Auth, HmacSha256Rfc4231) {
  // Test case 1.
  EXPECT_EQ(hex(hmac_sha256(bytes(std::string(20, '\x0b')), bytes("Hi There"))),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  // Test case 2: a key shorter than the block.
  EXPECT_EQ(hex(hmac_sha256(bytes("Jefe"), bytes("what do ya want for nothing?"))),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  // Test case 6: a key longer than the block (hashed first).
  EXPECT_EQ(hex(hmac_sha256(bytes(std::string(131, '\xaa')),
                            bytes("Test Using Larger Than Block-Size Key - Hash Key First"))),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  // Test case 7: both long.
  EXPECT_EQ(
      hex(hmac_sha256(bytes(std::string(131, '\xaa')),
                      bytes("This is a test using a larger than block-size key and a larger than "
                            "block-size data. The key needs to be hashed before being used by the "
                            "HMAC algorithm."))),
      "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST(Auth, ConstantTimeEqual) {
  EXPECT_TRUE(
      constant_time_equal(std::string("secret-token-0123"), std::string("secret-token-0123")));
  EXPECT_FALSE(
      constant_time_equal(std::string("secret-token-0123"), std::string("secret-token-0124")));
  EXPECT_FALSE(
      constant_time_equal(std::string("Xecret-token-0123"), std::string("secret-token-0123")));
  EXPECT_FALSE(constant_time_equal(std::string("secret"), std::string("secret-token-0123")));
  EXPECT_FALSE(constant_time_equal(std::string(""), std::string("x")));
  EXPECT_TRUE(constant_time_equal(std::string(""), std::string("")));
}

TEST(Auth, RandomBytesDiffer) {
  std::vector<std::uint8_t> a(32), b(32);
  random_bytes(a);
  random_bytes(b);
  EXPECT_NE(a, b);
  EXPECT_NE(a, std::vector<std::uint8_t>(32, 0));
}

TEST(Auth, TokenFromExtra) {
  EXPECT_EQ(token_from({}), "");
  EXPECT_EQ(token_from({{"shm_workers", "2"}}), "");
  EXPECT_EQ(token_from({{kTokenKey, "0123456789abcdef"}}), "0123456789abcdef");
  try {
    token_from({{kTokenKey, "qzxqz"}});
    FAIL() << "a 5-byte token was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("16"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("qzxqz"), std::string::npos)
        << "the error must not echo the secret: " << e.what();
  }
}

}  // namespace
}  // namespace mstar::kv::auth
