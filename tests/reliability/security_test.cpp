// Copyright mstar-kv authors.
//
// Security checks against real peer processes:
// * a shared cache can be opened by the same user only: another uid cannot
//   open the owner's memfd through /proc/<pid>/fd (the kernel refuses), and
//   a descriptor claiming another uid is refused before anything is mapped;
// * a remote can read only the memory registered for its cache: descriptors
//   whose region (size, layout, address) does not match what the owner
//   registered are rejected before any byte moves, and so are reads of pages
//   outside the remote cache.
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "common/peer_process.hpp"
#include "mstar/kv/kv.hpp"
#include "reliability/invariants.hpp"
#if MSTAR_KV_TEST_SHM
#include "mstar/kv/engines/shm.hpp"
#endif
#if MSTAR_KV_TEST_UCX
#include "common/layouts.hpp"
#include "mstar/kv/engines/ucx.hpp"
#endif

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::PeerProcess;
using testing::PeerSpec;

bool built(const std::string& name) {
  const auto b = built_engines();
  return std::find(b.begin(), b.end(), name) != b.end();
}

KVLayout layout() { return testing::make_layout(2, 32, 16, 2, 64); }

PeerSpec spec(const std::string& engine, std::map<std::string, std::string> env = {}) {
  PeerSpec s;
  s.engine = engine;
  s.layout = layout();
  s.tokens = 100;
  s.seed = 5;
  s.env = std::move(env);
  return s;
}

#if MSTAR_KV_TEST_SHM
constexpr uid_t kNobody = 65534;

// In a forked child that drops to uid/gid `nobody`, opens `path` (and maps
// it read-only if that worked). Returns the child's errno for the open, 0
// when it succeeded. Only async-signal-safe calls in the child.
int open_as_nobody(const std::string& path) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgroups(0, nullptr) != 0 || ::setgid(kNobody) != 0 || ::setuid(kNobody) != 0) {
      ::_exit(200);
    }
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) ::_exit(errno > 0 && errno < 200 ? errno : 199);
    void* p = ::mmap(nullptr, 4096, PROT_READ, MAP_SHARED, fd, 0);
    ::_exit(p == MAP_FAILED ? 198 : 0);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(Security, SharedCacheOfAnotherUserCannotBeOpened) {
  if (!built("shm")) GTEST_SKIP() << "the shm engine is not built";
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to act as another uid (setuid to nobody)";
  PeerProcess owner(spec("shm"));
  const auto info = ShmKVTransferInfo::decode(owner.sequence().kv_transfer_info);
  const std::string path = "/proc/" + std::to_string(info.pid) + "/fd/" + std::to_string(info.fd);
  // The same user (root here) can open it: the path is right.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path << ": " << std::strerror(errno);
  ::close(fd);
  // Another user cannot.
  const int err = open_as_nobody(path);
  ASSERT_NE(err, 200) << "could not drop to uid " << kNobody;
  EXPECT_TRUE(err == EACCES || err == EPERM)
      << "uid " << kNobody << " opening " << path << ": "
      << (err == 0 ? std::string("succeeded") : std::string(std::strerror(err)));
}

TEST(Security, SharedCacheDescriptorClaimingAnotherUidIsRefused) {
  if (!built("shm")) GTEST_SKIP() << "the shm engine is not built";
  PeerProcess owner(spec("shm"));
  auto info = ShmKVTransferInfo::decode(owner.sequence().kv_transfer_info);
  info.uid += 1;
  try {
    (void)map_shm_cache(info.encode());
    FAIL() << "a descriptor of uid " << info.uid << " was mapped";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kPermissionDenied) << e.what();
  }
}

#endif  // MSTAR_KV_TEST_SHM

class RegionChecks : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    engine_ = GetParam() == "ucx_tcp" ? "ucx" : GetParam();
    if (!built(engine_)) GTEST_SKIP() << "engine '" << engine_ << "' is not built";
    if (engine_ == "ucx") {
      env_ = {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"}};
      for (const auto& [k, v] : env_) ::setenv(k.c_str(), v.c_str(), 1);
    }
  }

  // Reads the whole sequence with `info` (a doctored descriptor) and expects
  // it refused before any byte moves.
  void expect_refused(const PeerProcess& owner, const KVTransferInfo& info, const std::string& what,
                      const KVLayout& claimed) {
    SCOPED_TRACE(what);
    const KVLayout l = layout();
    auto cache = make_kv_cache(l, MemoryKind::kHost);
    EngineOptions o;
    o.timeout = 3000ms;
    KVTransferManager m(TransferEngineInfo{"decode", "", engine_, o}, cache);
    const auto& seq = owner.sequence();
    std::vector<std::uint32_t> lp(seq.page_indices.size());
    for (std::size_t i = 0; i < lp.size(); ++i) lp[i] = static_cast<std::uint32_t>(i);
    testing::ReadChecker check(*cache, claimed,
                               plan_reads(l, 0, seq.num_tokens, lp, seq.page_indices));
    try {
      auto f = m.start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, info);
      ASSERT_TRUE(f.has_value());
      EXPECT_EQ(check.check(*f, 6s), "");
      EXPECT_FALSE(f->status().is_ok()) << what << " was read";
      EXPECT_TRUE(check.destination_untouched());
    } catch (const Error& e) {
      EXPECT_NE(e.code(), StatusCode::kOk);
      EXPECT_TRUE(check.destination_untouched()) << e.what();
    }
  }

  std::string engine_;
  std::map<std::string, std::string> env_;
};

TEST_P(RegionChecks, PagesOutsideTheRemoteCacheAreRefused) {
  PeerProcess owner(spec(engine_, env_));
  const KVLayout l = layout();
  auto cache = make_kv_cache(l, MemoryKind::kHost);
  auto engine = make_engine(TransferEngineInfo{"decode", "", engine_, {}}, cache);
  for (std::int64_t page : {std::int64_t{32}, std::int64_t{1} << 31, std::int64_t{-1}}) {
    std::vector<KVReadInfo> reads = {{0, 0, page, 0, 16}};
    try {
      engine->read_batched_async(owner.sequence().kv_transfer_info, reads);
      FAIL() << "remote page " << page << " accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
    }
  }
  engine->shutdown();
}

TEST_P(RegionChecks, DescriptorLargerThanTheRegisteredRegionIsRefused) {
  PeerProcess owner(spec(engine_, env_));
  const KVTransferInfo& real = owner.sequence().kv_transfer_info;
  KVLayout bigger = layout();
  bigger.num_pages *= 4;  // claims memory past the end of the owner's cache
#if MSTAR_KV_TEST_SHM
  if (engine_ == "shm") {
    auto info = ShmKVTransferInfo::decode(real);
    info.layout = bigger;
    info.size = bigger.total_bytes();
    expect_refused(owner, info.encode(), "shm descriptor claiming 4x the size", bigger);
  }
#endif
#if MSTAR_KV_TEST_UCX
  if (engine_ == "ucx") {
    auto info = UcxKVTransferInfo::decode(real);
    auto grown = info;
    grown.layout = bigger;
    grown.size = bigger.total_bytes();
    expect_refused(owner, grown.encode(), "ucx descriptor claiming 4x the size", bigger);
    auto moved = info;
    moved.data_ptr += 4096;  // same size, shifted past the region's end
    expect_refused(owner, moved.encode(), "ucx descriptor shifted by 4 KiB", layout());
    auto below = info;
    below.data_ptr -= 1u << 20;  // memory before the region
    expect_refused(owner, below.encode(), "ucx descriptor 1 MiB below the region", layout());
  }
#endif
}

INSTANTIATE_TEST_SUITE_P(Engines, RegionChecks, ::testing::Values("shm", "ucx_tcp"));

}  // namespace
}  // namespace mstar::kv
