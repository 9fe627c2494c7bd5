// Copyright mstar-kv authors.
//
// Strided read requests (kReqStrided, ucx_wire.hpp) as untrusted input: a
// raw UCP client names rows with strides; the owner serves exactly those
// rows, gathered, and refuses every span that names no bytes, too many rows
// or any byte outside its region (offsets and strides chosen to overflow),
// before it sends anything.
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "engines/ucx/raw_client.hpp"
#include "mstar/kv/engines/ucx.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::ucx {
namespace {

using namespace std::chrono_literals;
using testing::RawClient;
using testing::Received;

std::uint8_t pattern(std::uint64_t i) { return static_cast<std::uint8_t>((i * 7 + 3) % 251); }

class UcxStridedWire : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto b = built_engines();
    if (std::find(b.begin(), b.end(), "ucx") == b.end()) GTEST_SKIP() << "ucx engine not built";
    const KVLayout l = testing::make_layout(2, 8, 16, 1, 64);
    cache_ = split() ? KVCache::create_host_layers(l) : make_kv_cache(l, MemoryKind::kHost);
    for (std::uint64_t i = 0; i < cache_->size_bytes(); ++i) {
      *reinterpret_cast<std::uint8_t*>(cache_->at(i)) = pattern(i);  // by layout offset
    }
    owner_ = testing::tcp_ucx_owner(cache_, {}, &port_);
    ASSERT_TRUE(owner_) << "no free port";
    generation_ = UcxKVTransferInfo::decode(owner_->get_kv_transfer_info()).generation;
    client_ = std::make_unique<RawClient>("127.0.0.1", port_);
    HelloHdr h{};
    h.conn_id = 5;
    client_->send(kAmHello, &h, sizeof h);
    ASSERT_TRUE(client_->wait_for(kAmHelloReply, 5s)) << "no hello reply";
  }

  // The owner's cache is one region per layer (UcxStridedWireLayers).
  virtual bool split() const { return false; }

  // Sends one strided request (gathered, as the engine sends it unless
  // `flags` says otherwise) and waits for its answer.
  void send(const std::vector<WireStrided>& spans, std::uint64_t flags = kReqGather | kReqStrided) {
    ReadReqHdr r{};
    r.batch_id = ++batch_;
    r.generation = generation_;
    r.nspans = spans.size();
    r.flags = flags;
    client_->send(kAmReadReq, &r, sizeof r, spans.data(), spans.size() * sizeof(WireStrided));
  }
  // The refusal of the last request: its code and message.
  std::pair<std::uint32_t, std::string> refusal() {
    const auto end = std::chrono::steady_clock::now() + 5s;
    while (std::chrono::steady_clock::now() < end) {
      client_->wait_for(kAmReadErr, 50ms);
      for (const Received& r : client_->got()) {
        if (r.id != kAmReadErr) continue;
        ErrHdr e;
        std::memcpy(&e, r.header.data(), sizeof e);
        if (e.batch_id == batch_) return {e.code, std::string(r.data.begin(), r.data.end())};
      }
    }
    ADD_FAILURE() << "request " << batch_ << " was not refused";
    return {0, ""};
  }

  std::shared_ptr<KVCache> cache_;
  std::unique_ptr<KVTransferManager> owner_;
  std::unique_ptr<RawClient> client_;
  std::uint16_t port_ = 0;
  std::uint64_t generation_ = 0;
  std::uint64_t batch_ = 0;
};

TEST_F(UcxStridedWire, ServesExactlyTheNamedRowsGathered) {
  // 5 rows of 48 bytes 1000 apart, then one contiguous span of 100 bytes.
  send({{4096, 48, 0, 5, 1000, 48}, {64, 100, 240, 1, 0, 0}});
  ASSERT_TRUE(client_->wait_for(kAmGatherData, 5s)) << "nothing served";
  const Received& got = client_->first(kAmGatherData);
  GatherHdr g;
  ASSERT_EQ(got.header.size(), sizeof g);
  std::memcpy(&g, got.header.data(), sizeof g);
  EXPECT_EQ(g.first, 0u);
  EXPECT_EQ(g.count, 2u) << "a gathered reply counts whole strided spans";
  ASSERT_EQ(g.length, 5u * 48 + 100);
  ASSERT_EQ(got.data.size(), g.length);
  std::vector<std::uint8_t> want;
  for (std::uint64_t r = 0; r < 5; ++r) {
    for (std::uint64_t b = 0; b < 48; ++b) want.push_back(pattern(4096 + r * 1000 + b));
  }
  for (std::uint64_t b = 0; b < 100; ++b) want.push_back(pattern(64 + b));
  EXPECT_TRUE(got.data == want) << "the gathered bytes are not the named rows";
  EXPECT_FALSE(client_->got_any(kAmReadErr));
}

TEST_F(UcxStridedWire, MessagesHoldWholeSpansUpToTheRowLimit) {
  // 2000 + 2000 rows fit one message (at most kGatherMaxSpans rows); the
  // third span starts the next: a strided span is never cut across messages.
  static_assert(kGatherMaxSpans == 4096);
  const std::vector<WireStrided> spans = {
      {0, 8, 0, 2000, 16, 8}, {8, 8, 16000, 2000, 16, 8}, {0, 8, 32000, 2000, 16, 8}};
  send(spans);
  std::vector<std::pair<GatherHdr, std::vector<std::uint8_t>>> msgs;
  const auto end = std::chrono::steady_clock::now() + 5s;
  while (msgs.size() < 2 && std::chrono::steady_clock::now() < end) {
    client_->wait_for(kAmGatherData, 50ms);
    msgs.clear();
    for (const Received& r : client_->got()) {
      if (r.id != kAmGatherData) continue;
      GatherHdr g;
      std::memcpy(&g, r.header.data(), sizeof g);
      if (g.batch_id == batch_) msgs.emplace_back(g, r.data);
    }
  }
  ASSERT_EQ(msgs.size(), 2u) << "expected two gathered messages";
  const std::uint64_t first[] = {0, 2};
  const std::uint64_t count[] = {2, 1};
  for (std::size_t m = 0; m < 2; ++m) {
    const auto& [g, data] = msgs[m];
    EXPECT_EQ(g.first, first[m]);
    ASSERT_EQ(g.count, count[m]);
    ASSERT_EQ(g.length, count[m] * 2000 * 8);
    ASSERT_EQ(data.size(), g.length);  // eager: under 32 KiB
    std::vector<std::uint8_t> want;
    for (std::uint64_t k = g.first; k < g.first + g.count; ++k) {
      for (std::uint64_t r = 0; r < 2000; ++r) {
        for (std::uint64_t b = 0; b < 8; ++b)
          want.push_back(pattern(spans[k].remote_offset + r * 16 + b));
      }
    }
    EXPECT_TRUE(data == want) << "message " << m << " is not its spans' rows";
  }
  EXPECT_FALSE(client_->got_any(kAmReadErr));
}

TEST_F(UcxStridedWire, SpansOutsideTheRegionOrOfNoBytesAreRefusedBeforeAnyByte) {
  const std::uint64_t size = cache_->size_bytes();
  const std::uint64_t big = ~std::uint64_t{0};
  struct Case {
    WireStrided span;
    StatusCode code;
    const char* says;
  };
  const std::vector<Case> cases = {
      // The last row ends one byte past the region.
      {{size - 2 * 64, 64, 0, 3, 64, 64},
       StatusCode::kPermissionDenied,
       "outside the registered region"},
      // A stride that wraps around 2^64 back into the region.
      {{0, 64, 0, 3, big / 2 + 1, 64},
       StatusCode::kPermissionDenied,
       "outside the registered region"},
      {{0, 64, 0, 2, big - 63, 64}, StatusCode::kPermissionDenied, "outside the registered region"},
      // Offset + length overflowing.
      {{big - 10, 64, 0, 1, 0, 0}, StatusCode::kPermissionDenied, "outside the registered region"},
      // No rows, no bytes, more rows than a request may name.
      {{0, 64, 0, 0, 64, 64}, StatusCode::kInvalidArgument, "names no bytes"},
      {{0, 0, 0, 4, 64, 64}, StatusCode::kInvalidArgument, "names no bytes"},
      {{0, 1, 0, std::uint64_t{1} << 40, 0, 1}, StatusCode::kInvalidArgument, "rows in all"},
  };
  for (const Case& c : cases) {
    // A good span first: nothing of a request goes out unless all of it is good.
    send({{0, 64, 0, 2, 128, 64}, c.span});
    const auto [code, message] = refusal();
    EXPECT_EQ(code, static_cast<std::uint32_t>(c.code)) << message;
    EXPECT_NE(message.find("strided span 1"), std::string::npos) << message;
    EXPECT_NE(message.find(c.says), std::string::npos) << message;
  }
  client_->wait_for(kAmGatherData, 200ms);
  EXPECT_FALSE(client_->got_any(kAmGatherData)) << "a refused request was served";
  EXPECT_FALSE(client_->got_any(kAmReadData)) << "a refused request was served";
}

TEST_F(UcxStridedWire, MalformedStridedRequestsAreRefused) {
  // Strided spans only come gathered.
  send({{0, 64, 0, 2, 128, 64}}, kReqStrided);
  auto [code, message] = refusal();
  EXPECT_EQ(code, static_cast<std::uint32_t>(StatusCode::kInvalidArgument)) << message;
  // A body that is not a whole number of strided spans.
  ReadReqHdr r{};
  r.batch_id = ++batch_;
  r.generation = generation_;
  r.nspans = 2;
  r.flags = kReqGather | kReqStrided;
  const std::vector<WireSpan> flat(2, WireSpan{0, 64, 0});  // WireSpan's size, not WireStrided's
  client_->send(kAmReadReq, &r, sizeof r, flat.data(), flat.size() * sizeof(WireSpan));
  std::tie(code, message) = refusal();
  EXPECT_EQ(code, static_cast<std::uint32_t>(StatusCode::kInvalidArgument)) << message;
  EXPECT_NE(message.find("malformed"), std::string::npos) << message;
  client_->wait_for(kAmGatherData, 200ms);
  EXPECT_FALSE(client_->got_any(kAmGatherData));
}

// An owner whose cache is one region per layer: rows are served from each
// layer's own region, and a span or row run that crosses a layer boundary
// (the planner never makes one) is refused before any byte goes out.
class UcxStridedWireLayers : public UcxStridedWire {
 protected:
  bool split() const override { return true; }
};

TEST_F(UcxStridedWireLayers, ServesEachLayersRowsAndRefusesSpansAcrossLayers) {
  const std::uint64_t lb = cache_->layout().layer_bytes();
  ASSERT_TRUE(cache_->split());
  // Three rows in layer 1, then the last 64 bytes of layer 0.
  send({{lb + 100, 48, 0, 3, 1000, 48}, {lb - 64, 64, 144, 1, 0, 0}});
  ASSERT_TRUE(client_->wait_for(kAmGatherData, 5s)) << "nothing served";
  const Received& got = client_->first(kAmGatherData);
  std::vector<std::uint8_t> want;
  for (std::uint64_t r = 0; r < 3; ++r) {
    for (std::uint64_t b = 0; b < 48; ++b) want.push_back(pattern(lb + 100 + r * 1000 + b));
  }
  for (std::uint64_t b = 0; b < 64; ++b) want.push_back(pattern(lb - 64 + b));
  EXPECT_TRUE(got.data == want) << "the gathered bytes are not the named rows";
  // Rows that run from layer 0 into layer 1, and one row across the boundary.
  for (const WireStrided& bad :
       {WireStrided{lb - 1000, 48, 0, 3, 600, 48}, WireStrided{lb - 32, 64, 0, 1, 0, 0}}) {
    send({{0, 64, 0, 2, 128, 64}, bad});
    const auto [code, message] = refusal();
    EXPECT_EQ(code, static_cast<std::uint32_t>(StatusCode::kInvalidArgument)) << message;
    EXPECT_NE(message.find("strided span 1"), std::string::npos) << message;
    EXPECT_NE(message.find("crosses a layer boundary"), std::string::npos) << message;
  }
  // The same for a plain (not strided) request.
  ReadReqHdr r{};
  r.batch_id = ++batch_;
  r.generation = generation_;
  r.nspans = 1;
  const WireSpan across{lb - 32, 64, 0};
  client_->send(kAmReadReq, &r, sizeof r, &across, sizeof across);
  const auto [code, message] = refusal();
  EXPECT_EQ(code, static_cast<std::uint32_t>(StatusCode::kInvalidArgument)) << message;
  EXPECT_NE(message.find("span 0"), std::string::npos) << message;
  EXPECT_NE(message.find("crosses a layer boundary"), std::string::npos) << message;
  client_->wait_for(kAmReadData, 200ms);
  EXPECT_FALSE(client_->got_any(kAmReadData)) << "a refused request was served";
}

}  // namespace
}  // namespace mstar::kv::ucx
