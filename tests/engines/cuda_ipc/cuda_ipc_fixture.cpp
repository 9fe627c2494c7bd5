// Copyright mstar-kv authors.
#include "cuda_ipc_fixture.hpp"

#include <iostream>

#include "common/cache_probe.hpp"
#include "common/expectations.hpp"
#include "common/geometry_pulls.hpp"

namespace mstar::kv::cuda_test {

using namespace std::chrono_literals;

void DeviceTest::SetUp() {
  const std::string why = testing::no_device_reason();
  if (!why.empty()) {
    if (testing::gpu_required()) FAIL() << "MSTAR_KV_REQUIRE_GPU=1 but " << why;
    GTEST_SKIP() << "no CUDA device visible: " << why;
  }
}

OwnerSpec DeviceTest::spec(const KVLayout& l, std::uint64_t tokens) {
  OwnerSpec s;
  s.layout = l;
  s.tokens = tokens;
  s.seed = kSeed;
  return s;
}

std::shared_ptr<KVCache> DeviceTest::local_cache(const KVLayout& l) {
  auto c = make_kv_cache(l, MemoryKind::kDevice, 0);
  testing::fill_bytes(*c, kSentinel);
  return c;
}

void DeviceTest::expect_only_named_bytes_written(const KVCache& local, const KVLayout& remote,
                                                 std::span<const KVReadInfo> reads) {
  testing::expect_only_named_bytes_written(local, remote, reads, kSentinel);
}

KVLayout many_copies_layout() {
  KVLayout l = testing::small_layout();
  l.num_layers = 32;
  l.num_pages = 1024;
  return l;
}

std::vector<std::uint32_t> scattered_pages(std::size_t n) {
  std::vector<std::uint32_t> lp(n);
  for (std::size_t i = 0; i < n; ++i) lp[i] = static_cast<std::uint32_t>((i * 7) % 1024);
  return lp;
}

void expect_cancel_and_timeout_drain(const std::string& what, const MakeManager& make) {
  const KVLayout l = many_copies_layout();
  OwnerProcess owner(DeviceTest::spec(l, 1024 * 16));
  const auto& seq = owner.sequence();
  const auto lp = scattered_pages(seq.page_indices.size());
  for (const bool cancel : {true, false}) {
    SCOPED_TRACE(cancel ? "cancel" : "1 ms timeout");
    auto cache = DeviceTest::local_cache(l);
    auto m = make(cache, cancel ? 20000ms : 1ms);
    auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
    ASSERT_TRUE(f.has_value());
    if (cancel) f->cancel();
    ASSERT_TRUE(f->wait_for(30s));
    const StatusCode c = f->status().code();
    std::cout << "[ INFO     ] " << what << ", " << (cancel ? "cancel" : "1 ms timeout") << ": "
              << f->status().to_string() << std::endl;
    if (c == StatusCode::kOk) {
      auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, seq.num_tokens);
      EXPECT_TRUE(v.ok()) << v.first_mismatch;
    } else {
      EXPECT_EQ(c, cancel ? StatusCode::kCancelled : StatusCode::kTimeout)
          << f->status().to_string();
      testing::expect_quiet(*cache, 50ms);
    }
  }
}

}  // namespace mstar::kv::cuda_test
