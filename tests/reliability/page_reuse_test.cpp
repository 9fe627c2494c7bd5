// Copyright mstar-kv authors.
//
// Never the wrong KV: a reader pulls a sequence while its owner (a real
// peer process) frees it, reallocates the very same pages to the next
// request and rewrites them with that request's pattern, thousands of
// times. Every read must either verify as the sequence it asked for or fail
// with kStaleDescriptor; a read that succeeds with other bytes is the bug
// this test exists for. Then: a lease that expires, and the late pull.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>

#include "common/layouts.hpp"
#include "common/peer_process.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::PeerProcess;
using testing::PeerSpec;

struct ReuseCase {
  std::string label;
  std::string engine;
  std::map<std::string, std::string> env;
  std::map<std::string, std::string> extra;
  std::uint32_t layers = 2;
  std::uint32_t heads = 2;
  std::string skip_reason;  // non-empty: cannot run here
};

void PrintTo(const ReuseCase& c, std::ostream* os) { *os << c.label; }

bool built(const std::string& name) {
  const auto b = built_engines();
  return std::find(b.begin(), b.end(), name) != b.end();
}

// 8 pages of 16 tokens, every one of them in the sequence, so the next
// request always gets the same pages.
KVLayout reuse_layout(const ReuseCase& c) {
  return testing::make_layout(c.layers, 8, 16, c.heads, 128);
}
constexpr std::uint64_t kTokens = 8 * 16;
constexpr std::uint64_t kSeed = 500;

class PageReuse : public ::testing::TestWithParam<ReuseCase> {
 protected:
  void SetUp() override {
    if (!GetParam().skip_reason.empty()) GTEST_SKIP() << GetParam().skip_reason;
    if (!built(GetParam().engine))
      GTEST_SKIP() << "engine '" << GetParam().engine << "' is not built";
    for (const auto& [k, v] : GetParam().env) ::setenv(k.c_str(), v.c_str(), 1);
  }
  PeerSpec spec(long long lease_ms = -1) const {
    PeerSpec s;
    s.engine = GetParam().engine;
    s.layout = reuse_layout(GetParam());
    s.tokens = kTokens;
    s.seed = kSeed;
    s.scatter_seed = 0;
    s.env = GetParam().env;
    s.extra = GetParam().extra;
    s.lease_ms = lease_ms;
    return s;
  }
  std::unique_ptr<KVTransferManager> reader(std::shared_ptr<KVCache> cache) const {
    EngineOptions o;
    o.timeout = 5000ms;
    o.extra = GetParam().extra;
    return std::make_unique<KVTransferManager>(
        TransferEngineInfo{"reader", "", GetParam().engine, o}, std::move(cache));
  }
};

// The outcome of one pull: the status (OK or the error), whether thrown
// before any byte moved or through the future.
Status pull(KVTransferManager& m, const SequenceInfo& seq, std::span<const std::uint32_t> local) {
  try {
    auto f =
        m.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info);
    if (!f) return Status(StatusCode::kInternal, "no future");
    f->get();
    return Status::ok();
  } catch (const Error& e) {
    return e.status();
  }
}

std::uint64_t seed_of(const SequenceInfo& s) { return kSeed + (s.seq_id == 1 ? 0 : s.seq_id); }

TEST_P(PageReuse, EveryReadVerifiesAsItsSequenceOrFailsStale) {
  PeerProcess peer(spec());
  auto cache = make_kv_cache(reuse_layout(GetParam()), MemoryKind::kHost);
  auto m = reader(cache);
  std::vector<std::uint32_t> local = testing::iota_pages(8);
  std::mt19937_64 rng(42);
  std::uint64_t ok = 0, stale = 0, stale_old = 0, wrong = 0, iterations = 0;
  std::string first_wrong;
  // The owner's delay adapts so that about half the pulls lose the race:
  // longer after a stale read, shorter after a verified one.
  double max_delay_us = 50;
  SequenceInfo old;
  const auto start = std::chrono::steady_clock::now();
  const auto budget = 3s;
  for (; iterations < 20000 && std::chrono::steady_clock::now() - start < budget; ++iterations) {
    const SequenceInfo cur = peer.sequence();
    const auto delay = std::uniform_int_distribution<long>(0, static_cast<long>(max_delay_us))(rng);
    peer.send("next " + std::to_string(delay));  // the owner frees and reuses after `delay`
    const Status st = pull(*m, cur, local);
    if (st.is_ok()) {
      max_delay_us = std::max(1.0, max_delay_us * 0.9);
      const VerifyResult v = verify_pattern(*cache, seed_of(cur), local, 0, cur.num_tokens);
      if (v.ok()) {
        ++ok;
      } else {
        ++wrong;
        if (first_wrong.empty()) first_wrong = v.first_mismatch;
      }
    } else if (st.code() == StatusCode::kStaleDescriptor) {
      ++stale;
      max_delay_us = std::min(1e5, max_delay_us * 1.1);
    } else {
      ADD_FAILURE() << "iteration " << iterations << ": " << st.to_string();
      break;
    }
    // Now and then a pull of a sequence freed long ago: always stale.
    if (iterations % 16 == 15 && old.seq_id != 0) {
      const Status so = pull(*m, old, local);
      EXPECT_EQ(so.code(), StatusCode::kStaleDescriptor) << so.to_string();
      if (so.code() == StatusCode::kStaleDescriptor) ++stale_old;
    }
    old = cur;
    peer.read_sequence();
  }
  std::cout << "[ reuse    ] " << GetParam().label << ": " << iterations << " pulls, " << ok
            << " verified, " << stale << " stale, " << stale_old
            << " stale pulls of freed sequences, wrong-sequence reads: " << wrong
            << ", owner delay up to " << static_cast<int>(max_delay_us) << " us" << std::endl;
  EXPECT_EQ(wrong, 0u) << first_wrong;
  EXPECT_GE(iterations, 100u);  // thousands when the machine is not loaded
  // Both outcomes happened: the race was really run.
  EXPECT_GT(ok, 0u);
  EXPECT_GT(stale, 0u);
  peer.quit();
}

TEST_P(PageReuse, ExpiredLeaseFreesTheSequenceAndALatePullFailsStale) {
  PeerProcess peer(spec(/*lease_ms=*/200));
  auto cache = make_kv_cache(reuse_layout(GetParam()), MemoryKind::kHost);
  auto m = reader(cache);
  std::vector<std::uint32_t> local = testing::iota_pages(8);
  const SequenceInfo seq = peer.sequence();
  const auto now_ms =
      static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count());
  EXPECT_GT(seq.lease_expiry_ms, now_ms - 5000);
  EXPECT_LE(seq.lease_expiry_ms, now_ms + 200);
  // Within the lease: the pull verifies.
  ASSERT_TRUE(pull(*m, seq, local).is_ok());
  EXPECT_TRUE(verify_pattern(*cache, kSeed, local, 0, kTokens).ok());
  std::this_thread::sleep_for(300ms);
  peer.send("expire");
  EXPECT_EQ(peer.read_line(), "EXPIRED 1");
  const Status late = pull(*m, seq, local);
  EXPECT_EQ(late.code(), StatusCode::kStaleDescriptor) << late.to_string();
  EXPECT_NE(late.message().find("changed owner"), std::string::npos) << late.message();
  peer.quit();
}

TEST_P(PageReuse, DoneNoticeFreesTheSequenceOverTheEnginesChannel) {
  PeerProcess peer(spec());
  auto cache = make_kv_cache(reuse_layout(GetParam()), MemoryKind::kHost);
  auto m = reader(cache);
  std::vector<std::uint32_t> local = testing::iota_pages(8);
  const SequenceInfo seq = peer.sequence();
  ASSERT_TRUE(pull(*m, seq, local).is_ok());
  if (GetParam().engine != "ucx") {
    // No channel back to the owner: the caller is told to use its own.
    try {
      m->notify_done(seq);
      FAIL() << "notify_done over " << GetParam().engine << " did not throw";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kNotSupported);
      EXPECT_NE(std::string(e.what()).find("side channel"), std::string::npos) << e.what();
    }
    return;
  }
  // A done notice with another epoch (a forged or late one) frees nothing.
  SequenceInfo forged = seq;
  forged.kv_transfer_info.epoch ^= 1;
  m->notify_done(forged);
  m->notify_done(seq);
  // The notice is asynchronous: the owner frees the pages soon after.
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  Status late;
  do {
    std::this_thread::sleep_for(5ms);
    late = pull(*m, seq, local);
  } while (late.is_ok() && std::chrono::steady_clock::now() < deadline);
  EXPECT_EQ(late.code(), StatusCode::kStaleDescriptor) << late.to_string();
  peer.send("contains");
  EXPECT_EQ(peer.read_line(), "CONTAINS 0");
  // Done, not expired: nothing is left for the lease to reap.
  peer.send("expire");
  EXPECT_EQ(peer.read_line(), "EXPIRED 0");
  peer.quit();
}

std::vector<ReuseCase> reuse_cases() {
  const std::map<std::string, std::string> tcp = {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"}};
  // Mooncake's C library (one-sided reads; the reader fetches the owner's
  // registered epoch words before and after).
  ReuseCase mc{"mooncake", "mooncake", {}, {}, 2, 1, ""};
  const char* lib = std::getenv("MSTAR_KV_MOONCAKE_LIB");
  if (lib == nullptr || *lib == '\0') {
    mc.skip_reason =
        "MSTAR_KV_MOONCAKE_LIB is not set: no Mooncake library with the C API here "
        "(the wheel's engine is covered by python/tests/test_leases.py)";
  } else if (void* h = ::dlopen(lib, RTLD_NOW | RTLD_LOCAL); h == nullptr) {
    mc.skip_reason = std::string("cannot load MSTAR_KV_MOONCAKE_LIB: ") + ::dlerror();
  } else {
    ::dlclose(h);
    mc.extra["mooncake_lib"] = lib;
  }
  return {
      mc,
      // 64 KiB reads: the shm engine copies them inline.
      {"shm_inline", "shm", {}, {}, 2, 1, ""},
      // 1.25 MiB: its worker pool copies them.
      {"shm_pool", "shm", {}, {}, 5, 4, ""},
      // Owner-served active messages (checked by the owner before and after).
      {"ucx_am", "ucx", tcp, {{"ucx_mode", "am"}}, 2, 1, ""},
      // One-sided gets (the owner checks before and after the gets); over
      // tcp they are emulated, which an owner allows only when asked.
      {"ucx_get", "ucx", tcp, {{"ucx_mode", "get"}, {"ucx_emulated_gets", "on"}}, 2, 1, ""},
  };
}

INSTANTIATE_TEST_SUITE_P(Engines, PageReuse, ::testing::ValuesIn(reuse_cases()),
                         [](const auto& param_info) { return param_info.param.label; });

}  // namespace
}  // namespace mstar::kv
