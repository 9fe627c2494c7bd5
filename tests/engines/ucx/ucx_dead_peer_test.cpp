// Copyright mstar-kv authors.
//
// How fast a reader learns that its owner is gone, with real owner
// processes: every read of a dead owner fails long before the transfer
// timeout (30 s here), and nothing lands.
//
// A SIGKILLed process keeps its sockets open until the kernel has torn it
// down, which for a large process on a loaded host took from 0.1 s to more
// than 30 s (vLLM engines in the e2e tests): until then neither TCP nor UCX
// can see it die, and a read asked of it meanwhile was answered only by the
// transfer timeout. A stopped owner (SIGSTOP) is that state, held: its
// sockets are open and nothing answers. The reader's peer timeout
// (ucx_peer_timeout_ms) fails such reads; an owner that is only slow
// answers its pings and is waited for.
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "mstar/kv/testing/pattern.hpp"
#include "ucx_fixture.hpp"

namespace mstar::kv::ucx_test {
namespace {

constexpr auto kTransferTimeout = 30000ms;

// SIGSTOPs `pid` and waits until every one of its threads is stopped: a
// signal takes effect when each thread next enters the kernel, and a read
// asked before that could still be served.
void stop(pid_t pid) {
  ASSERT_EQ(::kill(pid, SIGSTOP), 0);
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  const auto end = std::chrono::steady_clock::now() + 10s;
  for (;;) {
    bool all = true;
    for (const auto& t : std::filesystem::directory_iterator(tasks)) {
      std::ifstream in(t.path() / "stat");
      std::string line;
      std::getline(in, line);
      const auto paren = line.rfind(')');
      if (paren == std::string::npos || line.size() < paren + 3 || line[paren + 2] != 'T') {
        all = false;
      }
    }
    if (all) return;
    ASSERT_LT(std::chrono::steady_clock::now(), end) << "pid " << pid << " did not stop";
    std::this_thread::sleep_for(1ms);
  }
}

class UcxDeadPeer : public UcxFixture {
 protected:
  void SetUp() override {
    UcxFixture::SetUp();
    if (IsSkipped()) return;
    if (!GetParam().no_kill.empty()) GTEST_SKIP() << GetParam().no_kill;
  }

  // Starts a read of the whole sequence into `lp`; the time it took to
  // fail (or a test failure if it succeeded or did not resolve in 20 s).
  static std::chrono::milliseconds time_to_failure(KVTransferManager& m, const SequenceInfo& seq,
                                                   const std::vector<std::uint32_t>& lp,
                                                   const std::function<void()>& after_post = {}) {
    const auto t0 = std::chrono::steady_clock::now();
    try {
      auto f =
          m.start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
      if (after_post) after_post();
      EXPECT_TRUE(f.has_value());
      if (!f) return 0ms;
      EXPECT_TRUE(f->wait_for(20s)) << "the read of a dead owner did not resolve in 20 s";
      EXPECT_FALSE(f->ready() && f->status().is_ok()) << "a dead owner's read succeeded";
      if (f->ready()) {
        EXPECT_EQ(f->status().code(), StatusCode::kPeerFailure) << f->status().to_string();
      }
    } catch (const Error& e) {  // a reconnect to the dead owner, refused
      EXPECT_EQ(e.code(), StatusCode::kPeerFailure) << e.what();
      if (after_post) after_post();
    }
    return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                                 t0);
  }
};

// The owner is stopped (as a killed process still exiting is) before the
// read asks: the read fails within the peer timeout, not the transfer
// timeout, and nothing lands; then it dies for good.
TEST_P(UcxDeadPeer, ReadOfAStoppedOwnerFailsWithinThePeerTimeout) {
  const KVLayout l = layout(64);
  auto cache = local_cache(l);
  auto m = manager(cache, kTransferTimeout, {{"ucx_peer_timeout_ms", "1000"}});
  for (int round = 0; round < 2; ++round) {
    PeerProcess owner(spec(l, 64 * 16));
    const auto& seq = owner.sequence();
    const auto lp = iota_pages(seq.page_indices.size());
    m->connect(seq.kv_transfer_info);  // the connection is up and idle, as a decode's is
    std::memset(cache->base(), static_cast<int>(kSentinel), cache->size_bytes());
    ASSERT_NO_FATAL_FAILURE(stop(owner.pid()));
    const auto took = time_to_failure(*m, seq, lp);
    EXPECT_GE(took, 900ms) << "failed before the owner was silent for the peer timeout";
    EXPECT_LT(took, 5000ms) << "waited for the transfer timeout, not the peer timeout";
    EXPECT_TRUE(untouched(*cache)) << "bytes landed from a stopped owner";
    owner.kill_now();
  }
}

// An owner killed (and reaped) while the reader holds an idle connection
// to it, and one killed right after a read asked (stopped first, so the
// request is in its socket when it dies): each read fails at once, every
// round.
TEST_P(UcxDeadPeer, ReadOfAKilledOwnerFailsAtOnceEveryTime) {
  const KVLayout l = layout(64);
  auto cache = local_cache(l);
  auto m = manager(cache, kTransferTimeout);
  std::chrono::milliseconds worst{0};
  for (int round = 0; round < 10; ++round) {
    PeerProcess owner(spec(l, 64 * 16));
    const auto& seq = owner.sequence();
    const auto lp = iota_pages(seq.page_indices.size());
    m->connect(seq.kv_transfer_info);
    std::memset(cache->base(), static_cast<int>(kSentinel), cache->size_bytes());
    std::chrono::milliseconds took;
    if (round % 2 == 0) {
      owner.kill_now();
      took = time_to_failure(*m, seq, lp);
    } else {
      ASSERT_NO_FATAL_FAILURE(stop(owner.pid()));
      took = time_to_failure(*m, seq, lp, [&] {
        std::this_thread::sleep_for(20ms);
        owner.kill_now();
      });
    }
    worst = std::max(worst, took);
    EXPECT_TRUE(untouched(*cache)) << "round " << round << ": bytes landed from a dead owner";
  }
  EXPECT_LT(worst, 2000ms) << "a dead owner's read waited";
}

// An owner that pauses for longer than a ping round but less than the peer
// timeout is alive: it answers the pings once it runs again and the read
// completes with the right bytes.
TEST_P(UcxDeadPeer, AnOwnerThatPausesLessThanThePeerTimeoutIsWaitedFor) {
  const KVLayout l = layout(64);
  auto cache = local_cache(l);
  auto m = manager(cache, kTransferTimeout, {{"ucx_peer_timeout_ms", "4000"}});
  PeerProcess owner(spec(l, 64 * 16));
  const auto& seq = owner.sequence();
  const auto lp = iota_pages(seq.page_indices.size());
  m->connect(seq.kv_transfer_info);
  ASSERT_NO_FATAL_FAILURE(stop(owner.pid()));
  auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(f.has_value());
  std::this_thread::sleep_for(1500ms);  // more than a ping round (1 s), less than 4 s
  ASSERT_EQ(::kill(owner.pid(), SIGCONT), 0);
  ASSERT_TRUE(f->wait_for(20s));
  ASSERT_TRUE(f->status().is_ok()) << f->status().to_string();
  EXPECT_TRUE(verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens).ok());
}

TEST(UcxPeerTimeout, ABadValueIsRefusedNamingTheLimit) {
  if (!ucx_built()) GTEST_SKIP() << "ucx engine not built";
  const KVLayout l = layout(64);
  for (const char* bad : {"50", "-1", "ten", "3600001"}) {
    EngineOptions o;
    o.extra = {{"ucx_peer_timeout_ms", bad}};
    try {
      KVTransferManager m(TransferEngineInfo{"decode", "", "ucx", o},
                          make_kv_cache(l, MemoryKind::kHost));
      ADD_FAILURE() << "ucx_peer_timeout_ms=" << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find("ucx_peer_timeout_ms"), std::string::npos) << e.what();
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxDeadPeer, ucx_cases(), case_name);

}  // namespace
}  // namespace mstar::kv::ucx_test
