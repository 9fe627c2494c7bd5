// Copyright mstar-kv authors.
//
// The owner's endpoint lifetime: a reader that goes away with
// reads in flight must never take the owner down, and what the owner still
// had to send it must never reach anyone else.
//
// UCX destroys a force-closed endpoint inside ucp_ep_close_nbx, may still
// complete its sends as successful afterwards, and hands the same address
// to the next endpoint it makes. The owner used to keep the bare ucp_ep_h in
// a read's queue and verdict: a completion that came after the close sent
// the read's next replies, or its verdict, on that address: on a freed
// endpoint (SIGSEGV in ucp_am_send_nbx, 2 runs in 25 of the issue's
// reproducer) or on the next reader's endpoint. Here the window is hit every
// time: the owner runs with the test seam that holds its continuations
// (UcxTestAccess::hold, ucx_test_access.hpp) until the first reader's connection
// closed and a second reader connected, then releases them. The second
// reader (a raw UCP client) must receive nothing but its hello reply; the
// owner counts the replies it dropped, and a real reader then pulls every
// byte. Without the fix the second reader receives the first one's replies
// (or the owner dies).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/layouts.hpp"
#include "engines/ucx/raw_client.hpp"
#include "engines/ucx/ucx_backend.hpp"
#include "engines/ucx/ucx_core.hpp"
#include "engines/ucx/ucx_fixture.hpp"
#include "engines/ucx/ucx_test_access.hpp"
#include "mstar/kv/engines/ucx.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "rma/rma_engine.hpp"

namespace mstar::kv::ucx {
namespace {

using namespace std::chrono_literals;
using testing::RawClient;
using testing::Received;

constexpr std::uint64_t kSeed = 35;

struct HeldCase {
  const char* label;
  std::size_t spans;  // replies of the first reader's read
};
void PrintTo(const HeldCase& c, std::ostream* os) { *os << c.label; }

class UcxOwnerLifetime : public ::testing::TestWithParam<HeldCase> {
 protected:
  void SetUp() override {
    if (!ucx_test::ucx_built()) GTEST_SKIP() << "ucx engine not built";
    ucx_test::use_loopback_tcp();
    cache_ = make_kv_cache(testing::small_layout(64), MemoryKind::kHost);
    UcxOptions o;
    EngineOptions eo;
    eo.timeout = 5000ms;
    for (int attempt = 0; attempt < 40 && !owner_; ++attempt) {
      port_ = static_cast<std::uint16_t>(30000 + (::getpid() * 17 + attempt * 151) % 9000);
      try {
        auto backend =
            std::make_unique<UcxBackend>(cache_, "owner", "127.0.0.1:" + std::to_string(port_), o);
        backend_ = backend.get();
        owner_ = std::make_unique<rma::RmaKVTransferEngine>(cache_, std::move(backend), eo);
      } catch (const Error&) {
      }
    }
    ASSERT_TRUE(owner_) << "no free port";
    ASSERT_TRUE(UcxTestAccess::hold(*backend_, true));
    pool_ = std::make_unique<KVCachePool>(cache_, owner_->get_kv_transfer_info(), 0);
    const auto pages = pool_->allocate(1, 64 * 16);
    fill_pattern(*cache_, kSeed, pages, 0, 64 * 16);
    seq_ = pool_->publish(1);
  }

  // A raw reader's hello; the ticket of its connection.
  static std::uint64_t hello(RawClient& c) { return c.hello(9).ticket; }

  // Polls the owner's counters until `pred` holds (5 s at most).
  template <class Pred>
  bool wait_served(Pred pred) {
    const auto end = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < end) {
      if (pred(owner_->served_stats())) return true;
      std::this_thread::sleep_for(2ms);
    }
    return false;
  }

  std::shared_ptr<KVCache> cache_;
  UcxBackend* backend_ = nullptr;
  std::unique_ptr<rma::RmaKVTransferEngine> owner_;
  std::unique_ptr<KVCachePool> pool_;
  SequenceInfo seq_;
  std::uint16_t port_ = 0;
};

TEST_P(UcxOwnerLifetime, RepliesHeldPastTheReadersCloseReachNobodyAndAreCounted) {
  const std::size_t n = GetParam().spans;
  std::size_t first_replies = 0;
  {
    RawClient a("127.0.0.1", port_);
    const std::uint64_t ticket = hello(a);
    // n eager replies of 512 bytes each, with an epoch: a verdict at the end.
    std::vector<WireSpan> spans(n);
    for (std::size_t i = 0; i < n; ++i) spans[i] = {i * 512, 512, i * 512};
    const std::vector<std::uint32_t> pages = seq_.page_indices;
    std::vector<std::uint8_t> body(n * sizeof(WireSpan) + pages.size() * 4);
    std::memcpy(body.data(), spans.data(), n * sizeof(WireSpan));
    std::memcpy(body.data() + n * sizeof(WireSpan), pages.data(), pages.size() * 4);
    const ReadReqHdr r{1,
                       UcxKVTransferInfo::decode(owner_->get_kv_transfer_info()).generation,
                       n,
                       kReqEagerOnly,
                       seq_.kv_transfer_info.epoch,
                       pages.size(),
                       ticket};
    a.send(kAmReadReq, &r, sizeof r, body.data(), body.size());
    // The first window arrives; the owner holds what follows (the next
    // replies, or with few spans the verdict) until released.
    const std::size_t window = std::min(n, kSendWindow);
    const auto end = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < end) {
      a.wait_for(kAmReadFin, 20ms);
      first_replies = 0;
      for (const Received& m : a.got()) first_replies += m.id == kAmReadData;
      if (first_replies >= window) break;
    }
    ASSERT_EQ(first_replies, window) << "the first window did not arrive";
    EXPECT_FALSE(a.got_any(kAmReadFin)) << "the verdict was not held";
  }  // a closes its endpoint (forced) and its worker: the owner sees it go
  ASSERT_TRUE(wait_served([](const ServedStats& s) { return s.readers_gone == 1; }))
      << "the owner did not close the first reader's connection";

  // The next reader connects (UCX gives its endpoint the address the first
  // one's had), then the held continuations run.
  RawClient b("127.0.0.1", port_);
  hello(b);
  ASSERT_TRUE(UcxTestAccess::hold(*backend_, false));
  b.wait_for(kAmReadFin, 500ms);
  for (const Received& m : b.got()) {
    EXPECT_EQ(m.id, kAmHelloReply)
        << "the second reader received message " << m.id << " meant for the first one";
  }
  // Dropped and counted: the replies never posted and the verdict.
  const std::uint64_t want = n - first_replies + 1;
  EXPECT_TRUE(wait_served([want](const ServedStats& s) { return s.replies_dropped == want; }))
      << "replies_dropped " << owner_->served_stats().replies_dropped << ", want " << want;
  EXPECT_EQ(owner_->served_stats().reads, 0u);

  // The owner still serves: a real reader pulls every byte.
  auto local = make_kv_cache(testing::small_layout(64), MemoryKind::kHost);
  EngineOptions o;
  o.timeout = 5000ms;
  KVTransferManager m(TransferEngineInfo{"reader", "", "ucx", o}, local);
  const auto lp = testing::iota_pages(seq_.page_indices.size());
  EXPECT_EQ(m.sync_retrieve(0, seq_.num_tokens, lp, seq_.page_indices, seq_.kv_transfer_info),
            local->size_bytes());
  EXPECT_TRUE(verify_pattern(*local, kSeed, lp, 0, seq_.num_tokens).ok());
}

INSTANTIATE_TEST_SUITE_P(
    Held, UcxOwnerLifetime,
    ::testing::Values(HeldCase{"verdict", 8},          // every reply posted: the verdict held
                      HeldCase{"next_replies", 256}),  // the next window held
    [](const ::testing::TestParamInfo<HeldCase>& i) { return std::string(i.param.label); });

}  // namespace
}  // namespace mstar::kv::ucx
