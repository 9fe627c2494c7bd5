// Copyright mstar-kv authors.
//
// Replies on a reader's data endpoint (kReqReplyOnData, ucx_wire.hpp) as
// untrusted input: a raw UCP client on the control endpoint asks for them
// without having bound a data endpoint, and tries to bind the control
// endpoint itself. The owner refuses the read before it sends any byte and
// binds nothing; the same request asking for replies where it came is
// served, so the refusal is the binding's alone.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include "common/layouts.hpp"
#include "engines/ucx/raw_client.hpp"
#include "mstar/kv/engines/ucx.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::ucx {
namespace {

using namespace std::chrono_literals;
using testing::RawClient;
using testing::Received;

TEST(UcxBind, RepliesOnADataEndpointNeedOneTheConnectionBound) {
  const auto b = built_engines();
  if (std::find(b.begin(), b.end(), "ucx") == b.end()) GTEST_SKIP() << "ucx engine not built";
  auto cache = make_kv_cache(testing::make_layout(2, 8, 16, 1, 64), MemoryKind::kHost);
  std::memset(cache->base(), 0x5a, cache->size_bytes());
  std::uint16_t port = 0;
  auto owner = testing::tcp_ucx_owner(cache, {}, &port);
  ASSERT_TRUE(owner) << "no free port";
  const std::uint64_t generation =
      UcxKVTransferInfo::decode(owner->get_kv_transfer_info()).generation;

  RawClient c("127.0.0.1", port);
  const HelloHdr hr = c.hello(4);
  ASSERT_NE(hr.ticket, 0u) << "every connection gets a ticket";

  // The control endpoint is no data endpoint: binding it binds nothing.
  const BindHdr bind{hr.conn_id, hr.ticket};
  c.send(kAmBind, &bind, sizeof bind);
  c.wait_for(kAmBound, 300ms);
  EXPECT_FALSE(c.got_any(kAmBound)) << "the owner bound its listener endpoint";

  auto read = [&](std::uint64_t id, std::uint64_t flags) {
    const WireSpan span{0, 64, 0};
    const ReadReqHdr r{id, generation, 1, flags, 0, 0, hr.ticket};
    c.send(kAmReadReq, &r, sizeof r, &span, sizeof span);
  };
  read(1, kReqEagerOnly | kReqReplyOnData);
  ASSERT_TRUE(c.wait_for(kAmReadErr, 5s)) << "a read for replies on no bound endpoint";
  ErrHdr e{};
  std::memcpy(&e, c.first(kAmReadErr).header.data(), sizeof e);
  EXPECT_EQ(e.batch_id, 1u);
  EXPECT_EQ(e.code, static_cast<std::uint32_t>(StatusCode::kInvalidArgument));
  const std::string why(c.first(kAmReadErr).data.begin(), c.first(kAmReadErr).data.end());
  EXPECT_NE(why.find("did not bind"), std::string::npos) << why;
  c.wait_for(kAmReadData, 200ms);
  EXPECT_FALSE(c.got_any(kAmReadData)) << "the refused read was served";
  EXPECT_EQ(owner->engine().served_stats().reads, 0u);

  read(2, kReqEagerOnly);
  ASSERT_TRUE(c.wait_for(kAmReadData, 5s)) << "the same read, replies on the control endpoint";
  const Received& got = c.first(kAmReadData);
  ASSERT_EQ(got.data.size(), 64u);
  for (std::uint8_t byte : got.data) ASSERT_EQ(byte, 0x5a);
}

}  // namespace
}  // namespace mstar::kv::ucx
