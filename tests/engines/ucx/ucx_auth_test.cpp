// Copyright mstar-kv authors.
//
// An attacker speaking the ucx engine's wire format (ucx_wire.hpp) with raw
// UCP calls to an owner that has an auth_token: it never learns the region
// (address, remote key, worker address) and is served no byte, whether it
// skips the handshake, answers the challenge with a wrong proof, or sends
// read requests with guessed tickets.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "engines/ucx/raw_client.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::ucx {
namespace {

using namespace std::chrono_literals;
using testing::RawClient;
using testing::Received;

class UcxAuth : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto b = built_engines();
    if (std::find(b.begin(), b.end(), "ucx") == b.end()) GTEST_SKIP() << "ucx engine not built";
    const KVLayout l = testing::make_layout(2, 8, 16, 1, 64);
    cache_ = make_kv_cache(l, MemoryKind::kHost);
    std::memset(cache_->base(), 0x3c, cache_->size_bytes());
    EngineOptions o;
    o.extra = {{"auth_token", "the-owners-secret-0123"}};
    owner_ = testing::tcp_ucx_owner(cache_, o, &port_);
    ASSERT_TRUE(owner_) << "no free port";
  }

  HelloHdr hello() const {
    HelloHdr h{};
    h.conn_id = 7;
    h.flags = kHelloHasToken;
    std::memset(h.nonce, 0x11, kNonceBytes);
    return h;
  }
  // What a served read request for the first 64 bytes of the cache looks like.
  void send_read(RawClient& c, std::uint64_t ticket) {
    ReadReqHdr r{};
    r.batch_id = 1;
    r.generation = 0;  // unknown to the attacker; the ticket is checked first
    r.nspans = 1;
    r.ticket = ticket;
    const WireSpan span{0, 64, 0};
    c.send(kAmReadReq, &r, sizeof r, &span, sizeof span);
  }
  // Nothing that arrived carries the region or any byte of the cache.
  void expect_nothing_leaked(const RawClient& c) {
    EXPECT_FALSE(c.got_any(kAmReadData)) << "the owner served bytes";
    for (const Received& r : c.got()) {
      if (r.id != kAmHelloReply) continue;
      ASSERT_EQ(r.header.size(), sizeof(HelloHdr));
      HelloHdr h;
      std::memcpy(&h, r.header.data(), sizeof h);
      EXPECT_NE(h.code, 0u) << "the owner described its region to an unauthenticated reader";
      EXPECT_EQ(h.ticket, 0u);
    }
  }

  std::shared_ptr<KVCache> cache_;
  std::unique_ptr<KVTransferManager> owner_;
  std::uint16_t port_ = 0;
};

TEST_F(UcxAuth, ReadRequestsWithoutTheHandshakeAreRefused) {
  RawClient c("127.0.0.1", port_);
  for (std::uint64_t ticket : {std::uint64_t{0}, std::uint64_t{1}, ~std::uint64_t{0}}) {
    send_read(c, ticket);
  }
  ASSERT_TRUE(c.wait_for(kAmReadErr, 5s)) << "no answer to a read request";
  ErrHdr e;
  ASSERT_EQ(c.first(kAmReadErr).header.size(), sizeof e);
  std::memcpy(&e, c.first(kAmReadErr).header.data(), sizeof e);
  EXPECT_EQ(e.code, static_cast<std::uint32_t>(StatusCode::kPermissionDenied));
  c.wait_for(kAmReadData, 200ms);
  expect_nothing_leaked(c);
}

TEST_F(UcxAuth, HelloGetsAChallengeNotTheRegion) {
  RawClient c("127.0.0.1", port_);
  const HelloHdr h = hello();
  c.send(kAmHello, &h, sizeof h);
  ASSERT_TRUE(c.wait_for(kAmChallenge, 5s));
  EXPECT_EQ(c.first(kAmChallenge).header.size(), sizeof(ChallengeHdr));
  c.wait_for(kAmHelloReply, 200ms);
  expect_nothing_leaked(c);
  EXPECT_FALSE(c.got_any(kAmHelloReply)) << "the region was sent before any proof";
}

TEST_F(UcxAuth, AWrongProofIsRefusedOnceAndForAll) {
  RawClient c("127.0.0.1", port_);
  const HelloHdr h = hello();
  c.send(kAmHello, &h, sizeof h);
  ASSERT_TRUE(c.wait_for(kAmChallenge, 5s));
  AuthHdr a{};
  a.conn_id = h.conn_id;
  std::memset(a.mac, 0x42, kMacBytes);  // not HMAC(secret, ...)
  c.send(kAmAuth, &a, sizeof a);
  ASSERT_TRUE(c.wait_for(kAmHelloReply, 5s));
  HelloHdr reply;
  std::memcpy(&reply, c.first(kAmHelloReply).header.data(), sizeof reply);
  EXPECT_EQ(reply.code, static_cast<std::uint32_t>(StatusCode::kPermissionDenied));
  const std::string why(c.first(kAmHelloReply).data.begin(), c.first(kAmHelloReply).data.end());
  EXPECT_NE(why.find("proof"), std::string::npos) << why;
  // A second hello or proof on the same connection gets nothing: one try each.
  const std::size_t before = c.got().size();
  c.send(kAmHello, &h, sizeof h);
  c.send(kAmAuth, &a, sizeof a);
  c.wait_for(kAmMaxId + 1, 300ms);  // no such id: just progress a while
  EXPECT_EQ(c.got().size(), before);
  send_read(c, 0);
  ASSERT_TRUE(c.wait_for(kAmReadErr, 5s));
  expect_nothing_leaked(c);
}

}  // namespace
}  // namespace mstar::kv::ucx
