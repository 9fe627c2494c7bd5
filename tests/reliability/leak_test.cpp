// Copyright mstar-kv authors.
//
// Nothing is left behind: real peer processes (shm; ucx over tcp and over
// shared memory) are read from and SIGKILLed mid-read, the engines shut
// down, and afterwards /dev/shm holds no new entry and this process no new
// file descriptor. Runs alone (RUN_SERIAL), since other tests create
// /dev/shm entries of their own.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <thread>

#include "common/engine_cases.hpp"
#include "common/layouts.hpp"
#include "common/peer_process.hpp"
#include "mstar/kv/kv.hpp"
#include "reliability/invariants.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::PeerProcess;
using testing::PeerSpec;

class NothingLeftBehind : public ::testing::TestWithParam<testing::EngineCase> {};

TEST_P(NothingLeftBehind, AfterPullsAndKilledPeers) {
  const testing::EngineCase& c = GetParam();
  if (!c.skip_reason.empty()) GTEST_SKIP() << c.skip_reason;
  for (const auto& [k, v] : c.env) ::setenv(k.c_str(), v.c_str(), 1);
  const KVLayout l = testing::small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 512);
  const auto before = testing::ResourceSnapshot::take();
  {
    auto cache = make_kv_cache(l, MemoryKind::kHost);
    EngineOptions o;
    o.timeout = 3000ms;
    auto engine = make_engine(TransferEngineInfo{"decode", "", c.traits.name, o}, cache);
    for (int round = 0; round < 3; ++round) {
      PeerSpec s;
      s.engine = c.traits.name;
      s.layout = l;
      s.tokens = 512 * 16;
      s.seed = 3 + static_cast<std::uint64_t>(round);
      s.env = c.env;
      PeerProcess peer(s);
      const auto& seq = peer.sequence();
      std::vector<std::uint32_t> lp(seq.page_indices.size());
      for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>(i);
      const auto reads = plan_reads(l, 0, seq.num_tokens, lp, seq.page_indices);
      // One full pull, then one cut short by SIGKILL.
      auto f = engine->read_batched_async(seq.kv_transfer_info, reads);
      ASSERT_TRUE(f && f->wait_for(10s));
      EXPECT_TRUE(f->status().is_ok()) << f->status().to_string();
      auto g = engine->read_batched_async(seq.kv_transfer_info, reads);
      std::this_thread::sleep_for(std::chrono::milliseconds(round));
      peer.kill_now();
      ASSERT_TRUE(g && g->wait_for(10s));
    }
    engine->shutdown();
  }
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(testing::ResourceSnapshot::take().leaks_since(before), "");
}

INSTANTIATE_TEST_SUITE_P(Engines, NothingLeftBehind,
                         ::testing::ValuesIn(testing::self_contained_cases()),
                         [](const ::testing::TestParamInfo<testing::EngineCase>& p) {
                           return p.param.label;
                         });

}  // namespace
}  // namespace mstar::kv
