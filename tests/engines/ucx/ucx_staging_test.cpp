// Copyright mstar-kv authors.
//
// Staging (ucx_staging=on, the path of device caches, here over host caches
// with memcpy as the copier): an owner and a reader of this process, each
// with its own UCX worker, over tcp on loopback. Every pairing of a staged
// and a direct side moves every byte where the read asked and nothing
// else, for plain spans (a scattered pull, a prefix hit) and strided ones
// (a change of in-page order), over eager and rendezvous replies; the
// owner counts what it staged. Options that cannot serve a staged cache are
// refused by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/layouts.hpp"
#include "engines/ucx/ucx_fixture.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::ucx_test {
namespace {

using namespace std::chrono_literals;

constexpr std::byte kSentinel{0xA5};
constexpr std::uint64_t kSeed = 4242;

struct StagingCase {
  bool owner_staged = false;
  bool reader_staged = false;
  std::string proto;  // the owner's ucx_am_proto
};

class UcxStaging : public ::testing::TestWithParam<StagingCase> {
 protected:
  void SetUp() override {
    if (!ucx_test::ucx_built()) GTEST_SKIP() << "ucx engine not built";
    ucx_test::use_loopback_tcp();
    ::unsetenv("MSTAR_KV_UCX_STAGING");
  }

  static std::unique_ptr<KVTransferManager> manager(const std::string& name,
                                                    std::shared_ptr<KVCache> cache, bool staged,
                                                    const std::string& proto = "") {
    EngineOptions o;
    o.timeout = 20000ms;
    o.extra["ucx_staging"] = staged ? "on" : "off";
    if (!proto.empty()) o.extra["ucx_am_proto"] = proto;
    return std::make_unique<KVTransferManager>(TransferEngineInfo{name, "", "ucx", o},
                                               std::move(cache));
  }
};

TEST_P(UcxStaging, EveryPairingMovesEveryByteWhereAskedAndNothingElse) {
  const StagingCase c = GetParam();
  const KVLayout remote = testing::small_layout(512);  // 16 MiB, 4 KiB blocks
  auto owner_cache = make_kv_cache(remote, MemoryKind::kHost);
  std::vector<std::uint32_t> rp(200);
  for (std::uint32_t i = 0; i < rp.size(); ++i) rp[i] = (i * 37 + 11) % 512;
  const std::uint64_t tokens = rp.size() * remote.page_size - 5;  // a partial last page
  fill_pattern(*owner_cache, kSeed, rp, 0, tokens);
  auto owner = manager("prefill", owner_cache, c.owner_staged, c.proto);
  const KVTransferInfo info = owner->get_kv_transfer_info();

  std::uint64_t expected_staged = 0;
  for (const PageOrder po : {PageOrder::kNHD, PageOrder::kHND}) {
    SCOPED_TRACE("reader " + std::string(to_string(po)));
    const KVLayout local = testing::small_layout(512, CacheOrder::kLayerMajor, po);
    auto cache = make_kv_cache(local, MemoryKind::kHost);
    testing::fill_bytes(*cache, kSentinel);
    std::vector<std::uint32_t> lp(rp.size());
    for (std::uint32_t i = 0; i < lp.size(); ++i) lp[i] = (i * 101 + 3) % 512;
    auto reader = manager("decode", cache, c.reader_staged);
    // A prefix hit first (tokens [40, end)), then the prefix.
    const std::uint64_t tail = reader->sync_retrieve(40, tokens, lp, rp, info);
    const auto reads = plan_reads(local, remote, 40, tokens, lp, rp);
    EXPECT_EQ(testing::bytes_written_outside(*cache, remote, reads, kSentinel), 0u);
    EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 40, tokens).ok());
    const std::uint64_t head = reader->sync_retrieve(0, 40, lp, rp, info);
    const auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, tokens);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
    expected_staged += tail + head;
  }
  const ServedStats served = owner->stats().served;
  EXPECT_EQ(served.bytes, expected_staged);
  EXPECT_EQ(served.staged_bytes, c.owner_staged ? served.bytes : 0u) << "the owner's staged bytes";
}

// A reader killed mid-read is the reader's business; a stopped read is
// ours: cancelled and timed-out staged reads resolve, and a later read of
// the same engine moves every byte.
TEST_P(UcxStaging, ACancelledStagedReadResolvesAndTheNextReadIsWhole) {
  const StagingCase c = GetParam();
  const KVLayout l = testing::small_layout(1024);  // 32 MiB
  auto owner_cache = make_kv_cache(l, MemoryKind::kHost);
  std::vector<std::uint32_t> pages(1024);
  for (std::uint32_t i = 0; i < pages.size(); ++i) pages[i] = (i * 7 + 5) % 1024;
  const std::uint64_t tokens = pages.size() * l.page_size;
  fill_pattern(*owner_cache, kSeed, pages, 0, tokens);
  auto owner = manager("prefill", owner_cache, c.owner_staged, c.proto);
  auto cache = make_kv_cache(l, MemoryKind::kHost);
  auto reader = manager("decode", cache, c.reader_staged);
  const KVTransferInfo info = owner->get_kv_transfer_info();
  for (int i = 0; i < 5; ++i) {
    auto f = reader->start_async_retrieve(0, tokens, pages, pages, info);
    ASSERT_TRUE(f.has_value());
    f->cancel();
    ASSERT_TRUE(f->wait_for(10s)) << "a cancelled read did not resolve";
    EXPECT_TRUE(f->status().is_ok() || f->status().code() == StatusCode::kCancelled)
        << f->status().to_string();
  }
  testing::fill_bytes(*cache, kSentinel);
  EXPECT_EQ(reader->sync_retrieve(0, tokens, pages, pages, info), l.total_bytes());
  const auto v = testing::verify_pattern_any(*cache, kSeed, pages, 0, tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

INSTANTIATE_TEST_SUITE_P(Pairings, UcxStaging,
                         ::testing::Values(StagingCase{true, true, ""},
                                           StagingCase{true, false, ""},
                                           StagingCase{false, true, ""},
                                           StagingCase{true, true, "eager"},
                                           StagingCase{true, true, "rndv"}),
                         [](const auto& p) {
                           return std::string(p.param.owner_staged ? "staged" : "direct") +
                                  "_owner_" + (p.param.reader_staged ? "staged" : "direct") +
                                  "_reader" + (p.param.proto.empty() ? "" : "_" + p.param.proto);
                         });

TEST(UcxStagingOptions, ABadValueOrAGetReaderIsRefusedByName) {
  const auto b = built_engines();
  if (std::find(b.begin(), b.end(), "ucx") == b.end()) GTEST_SKIP() << "ucx engine not built";
  auto cache = make_kv_cache(testing::small_layout(8), MemoryKind::kHost);
  auto make = [&](std::map<std::string, std::string> extra) {
    EngineOptions o;
    o.extra = std::move(extra);
    return KVTransferManager(TransferEngineInfo{"x", "", "ucx", o}, cache);
  };
  try {
    make({{"ucx_staging", "sometimes"}});
    FAIL() << "ucx_staging=sometimes was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("ucx_staging 'sometimes'"), std::string::npos) << e.what();
  }
  try {
    make({{"ucx_staging", "on"}, {"ucx_mode", "get"}});
    FAIL() << "ucx_mode=get with staging was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("ucx_mode=get cannot fill a staged cache"),
              std::string::npos)
        << e.what();
  }
  ::setenv("MSTAR_KV_UCX_STAGING", "never", 1);
  try {
    make({});
    FAIL() << "MSTAR_KV_UCX_STAGING=never was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("MSTAR_KV_UCX_STAGING 'never'"), std::string::npos)
        << e.what();
  }
  ::unsetenv("MSTAR_KV_UCX_STAGING");
}

}  // namespace
}  // namespace mstar::kv::ucx_test
