// Copyright mstar-kv authors.
//
// An attacker speaking the ucx engine's wire format (ucx_wire.hpp) with raw
// UCP calls to an owner that has an auth_token: it never learns the region
// (address, remote key, worker address) and is served no byte, whether it
// skips the handshake, answers the challenge with a wrong proof, or sends
// read requests with guessed tickets.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "mstar/kv/kv.hpp"
#include "engines/ucx/ucx_wire.hpp"

namespace mstar::kv::ucx {
namespace {

using namespace std::chrono_literals;

struct Received {
  unsigned id;
  std::vector<std::uint8_t> header;
  std::vector<std::uint8_t> data;
};

// A bare UCP client: one worker, one client/server endpoint, a handler that
// records every active message that arrives.
class RawClient {
 public:
  explicit RawClient(const std::string& host, std::uint16_t port) {
    ucp_config_t* config = nullptr;
    EXPECT_EQ(ucp_config_read(nullptr, nullptr, &config), UCS_OK);
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_AM;
    EXPECT_EQ(ucp_init(&params, config, &context_), UCS_OK);
    ucp_config_release(config);
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SINGLE;
    EXPECT_EQ(ucp_worker_create(context_, &wp, &worker_), UCS_OK);
    for (unsigned id = 1; id <= kAmMaxId; ++id) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      // One handler per id; the id is recovered from a per-id trampoline arg.
      ids_.push_back(std::make_unique<Tag>(Tag{this, id}));
      hp.arg = ids_.back().get();
      hp.cb = [](void* arg, const void* header, std::size_t hlen, void* data, std::size_t len,
                 const ucp_am_recv_param_t* param) -> ucs_status_t {
        auto* tag = static_cast<Tag*>(arg);
        Received r;
        r.id = tag->id;
        r.header.assign(static_cast<const std::uint8_t*>(header),
                        static_cast<const std::uint8_t*>(header) + hlen);
        if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) == 0 && data != nullptr) {
          r.data.assign(static_cast<std::uint8_t*>(data), static_cast<std::uint8_t*>(data) + len);
        } else {
          r.data.resize(len);
        }
        tag->self->got_.push_back(std::move(r));
        return UCS_OK;
      };
      EXPECT_EQ(ucp_worker_set_am_recv_handler(worker_, &hp), UCS_OK);
    }
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_port = htons(port);
    inet_pton(AF_INET, host.c_str(), &sa.sin_addr);
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                    UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
    ep.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
    ep.sockaddr.addr = reinterpret_cast<const sockaddr*>(&sa);
    ep.sockaddr.addrlen = sizeof sa;
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    EXPECT_EQ(ucp_ep_create(worker_, &ep, &ep_), UCS_OK);
  }
  ~RawClient() {
    if (ep_) {
      ucp_request_param_t rp{};
      rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      rp.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t sp = ucp_ep_close_nbx(ep_, &rp);
      while (UCS_PTR_IS_PTR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS) {
        ucp_worker_progress(worker_);
      }
      if (UCS_PTR_IS_PTR(sp)) ucp_request_free(sp);
    }
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
  }

  void send(unsigned id, const void* header, std::size_t hlen, const void* data = nullptr,
            std::size_t len = 0) {
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t sp = ucp_am_send_nbx(ep_, id, header, hlen, data, len, &rp);
    while (UCS_PTR_IS_PTR(sp) && ucp_request_check_status(sp) == UCS_INPROGRESS) {
      ucp_worker_progress(worker_);
    }
    if (UCS_PTR_IS_PTR(sp)) ucp_request_free(sp);
  }
  // Progresses until `id` arrives or `for_how_long` passed; everything that
  // arrived is in got().
  bool wait_for(unsigned id, std::chrono::milliseconds for_how_long) {
    const auto end = std::chrono::steady_clock::now() + for_how_long;
    while (std::chrono::steady_clock::now() < end) {
      ucp_worker_progress(worker_);
      for (const Received& r : got_) {
        if (r.id == id) return true;
      }
    }
    return false;
  }
  const std::vector<Received>& got() const { return got_; }
  bool got_any(unsigned id) const {
    for (const Received& r : got_) {
      if (r.id == id) return true;
    }
    return false;
  }
  const Received& first(unsigned id) const {
    for (const Received& r : got_) {
      if (r.id == id) return r;
    }
    throw std::runtime_error("no message " + std::to_string(id));
  }

 private:
  struct Tag {
    RawClient* self;
    unsigned id;
  };
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  ucp_ep_h ep_ = nullptr;
  std::vector<std::unique_ptr<Tag>> ids_;
  std::vector<Received> got_;
};

class UcxAuth : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto b = built_engines();
    if (std::find(b.begin(), b.end(), "ucx") == b.end()) GTEST_SKIP() << "ucx engine not built";
    ::setenv("UCX_TLS", "tcp", 1);
    ::setenv("UCX_NET_DEVICES", "lo", 1);
    const KVLayout l = testing::make_layout(2, 8, 16, 1, 64);
    cache_ = make_kv_cache(l, MemoryKind::kHost);
    std::memset(cache_->base(), 0x3c, cache_->size_bytes());
    EngineOptions o;
    o.extra = {{"auth_token", "the-owners-secret-0123"}};
    for (int attempt = 0; attempt < 40 && !owner_; ++attempt) {
      port_ = static_cast<std::uint16_t>(30000 + (::getpid() * 13 + attempt * 151) % 9000);
      try {
        owner_ = std::make_unique<KVTransferManager>(
            TransferEngineInfo{"owner", "127.0.0.1:" + std::to_string(port_), "ucx", o}, cache_);
      } catch (const Error&) {
      }
    }
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
