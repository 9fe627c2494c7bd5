// Copyright mstar-kv authors.
//
// The ucx engine's data path under process death, with real processes: an
// owner killed (-9) while a large gathered message (rows of a layout
// change, one iov message per group on both sides) is on its way fails the
// read in bounded time and nothing lands afterwards; a reader killed (-9)
// while the owner sends it such messages leaves the owner serving the next
// reader.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <thread>

#include "common/expectations.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "ucx_fixture.hpp"

namespace mstar::kv::ucx_test {
namespace {

class UcxDataPath : public UcxFixture {
 protected:
  // 128-byte rows on both sides (page-major HND owner, layer-major NHD
  // reader): every read is gathered, in groups big enough for rendezvous.
  static constexpr std::uint32_t kPages = 2048;  // 64 MiB
  static KVLayout owner_layout() { return layout(kPages, CacheOrder::kPageMajor, PageOrder::kHND); }
  static KVLayout reader_layout() { return layout(kPages); }

  // Waits until some byte of `c` left the sentinel (a reply landed), up to
  // `limit`; checks one byte in 512 so that polling stays cheap. It reads
  // while UCX's progress thread writes replies into the same bytes, on
  // purpose: relaxed atomic loads, so the concurrency is declared (a byte
  // seen early or late only moves the moment this returns).
  static bool wait_first_bytes(const KVCache& c, std::chrono::milliseconds limit) {
    const auto end = std::chrono::steady_clock::now() + limit;
    const std::byte* p = c.base();
    while (std::chrono::steady_clock::now() < end) {
      for (std::size_t i = 0; i < c.size_bytes(); i += 512) {
        if (__atomic_load_n(p + i, __ATOMIC_RELAXED) != kSentinel) return true;
      }
      std::this_thread::sleep_for(200us);
    }
    return false;
  }

  std::vector<TransferFuture> start_pulls(KVTransferManager& m, const SequenceInfo& seq, int n) {
    const auto lp = iota_pages(seq.page_indices.size());
    std::vector<TransferFuture> fs;
    for (int i = 0; i < n; ++i) {
      fs.push_back(
          *m.start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info));
    }
    return fs;
  }
};

TEST_P(UcxDataPath, OwnerKilledMidGatheredMessageFailsTheReadInTimeAndNothingLandsAfter) {
  if (!GetParam().no_kill.empty()) GTEST_SKIP() << GetParam().no_kill;
  PeerProcess doomed(spec(owner_layout(), kPages * 16));
  PeerProcess other(spec(layout(64), 64));
  auto cache = local_cache(reader_layout());
  auto m = manager(cache, 3000ms);
  const auto& seq = doomed.sequence();
  auto fs = start_pulls(*m, seq, 4);
  ASSERT_TRUE(wait_first_bytes(*cache, 20s)) << "no reply landed";
  const auto t0 = std::chrono::steady_clock::now();
  const bool mid = std::any_of(fs.begin(), fs.end(), [](TransferFuture& f) { return !f.ready(); });
  doomed.kill_now();
  ASSERT_TRUE(mid) << "every pull finished before the owner was killed";
  const bool any_failed = any_failed_after_peer_death(fs);
  EXPECT_TRUE(any_failed) << "a pull in flight when its owner died succeeded";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3000ms + 2s);
  // Nothing may land once the reads resolved.
  testing::expect_quiet(*cache, 300ms);
  // The same engine still pulls from a live owner.
  const auto lp = iota_pages(4);
  m->sync_retrieve(0, 64, lp, other.sequence().page_indices, other.sequence().kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, lp, 0, 64).ok());
}

// The doomed reader is a forked child: this process has no UCX state yet
// when it forks (each test runs in its own process under ctest), so the
// child starts its engine from scratch.
TEST_P(UcxDataPath, ReaderKilledWhileTheOwnerSendsLeavesTheOwnerServingTheNext) {
  PeerProcess owner(spec(owner_layout(), kPages * 16));
  const SequenceInfo seq = owner.sequence();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t reader = ::fork();
  ASSERT_GE(reader, 0);
  if (reader == 0) {  // the doomed reader: pulls, reports the first bytes, waits
    ::close(ready[0]);
    char verdict = 'n';
    try {
      // Four reads, each through its own manager into its own cache: a
      // reply landing in every cache means the owner received every request
      // whole, so the reader dies while the owner sends, not while it still
      // sends its own 12 MiB span lists. (A reader killed in the middle of
      // writing a request into the owner's shared-memory FIFO can leave it
      // stuck for every other sender: UCX 1.13's mm transport, see
      // bench/README.md "UCX over shared memory: a dead sender".)
      std::vector<std::shared_ptr<KVCache>> caches;
      std::vector<std::unique_ptr<KVTransferManager>> ms;
      std::vector<TransferFuture> fs;
      for (int i = 0; i < 4; ++i) {
        caches.push_back(local_cache(reader_layout()));
        ms.push_back(manager(caches.back(), 20000ms));
        auto more = start_pulls(*ms.back(), seq, 1);
        fs.insert(fs.end(), more.begin(), more.end());
      }
      bool all = true;
      for (const auto& c : caches) all = wait_first_bytes(*c, 20s) && all;
      if (all) verdict = 'y';
      (void)!::write(ready[1], &verdict, 1);
      for (;;) ::pause();
    } catch (...) {
      (void)!::write(ready[1], &verdict, 1);
    }
    ::_exit(1);
  }
  ::close(ready[1]);
  pollfd pfd{ready[0], POLLIN, 0};
  char verdict = 0;
  const bool answered = ::poll(&pfd, 1, 30000) == 1 && ::read(ready[0], &verdict, 1) == 1;
  ::close(ready[0]);
  ::kill(reader, SIGKILL);
  int status = 0;
  ::waitpid(reader, &status, 0);
  ASSERT_TRUE(answered) << "the reader process did not report";
  ASSERT_EQ(verdict, 'y') << "the reader process saw no reply land";
  // The owner, which was sending into the dead reader, serves a new one:
  // every byte, in bounded time, twice (its state for the dead reader is gone).
  for (int round = 0; round < 2; ++round) {
    auto cache = local_cache(reader_layout());
    auto m = manager(cache, 20000ms);
    const auto lp = iota_pages(seq.page_indices.size());
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info),
              reader_layout().total_bytes());
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
    const auto v = verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens);
    EXPECT_TRUE(v.ok()) << "round " << round << ": " << v.first_mismatch;
  }
  EXPECT_EQ(::kill(owner.pid(), 0), 0) << "the owner died with its reader";
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxDataPath, ucx_cases(), case_name);

}  // namespace
}  // namespace mstar::kv::ucx_test
