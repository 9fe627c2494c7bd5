// Copyright mstar-kv authors.
//
// The shm engine between real processes: shm_peer owns a shared cache in its
// own process and this test process reads it.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <dirent.h>
#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "common/peer.hpp"
#include "common/wire.hpp"
#include "engines/shm/shm_mapping.hpp"  // the engine's own mapping
#include "engines/shm/span_copy.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using testing::small_layout;

using namespace std::chrono_literals;
using testing::Child;
using testing::small_layout;

constexpr std::byte kSentinel{0xA5};
constexpr std::uint64_t kSeed = 4242;

// A shm_peer owning a cache with one sequence filled with the pattern.
struct Owner : testing::Peer {
  Owner(const KVLayout& l, std::uint64_t tokens, std::uint64_t scatter = 5)
      : Peer({SHM_PEER_PATH, "--layout", testing::layout_arg(l), "--tokens", std::to_string(tokens),
              "--seed", std::to_string(kSeed), "--scatter", std::to_string(scatter)}),
        seq(sequence()) {}
  SequenceInfo next_sequence() { return read_sequence(); }
  SequenceInfo seq;
};

std::shared_ptr<KVCache> sentinel_cache(const KVLayout& l) {
  auto c = make_kv_cache(l, MemoryKind::kHost);
  std::memset(c->base(), static_cast<int>(kSentinel), l.total_bytes());
  return c;
}

std::unique_ptr<KVTransferManager> shm_manager(std::shared_ptr<KVCache> cache,
                                               std::chrono::milliseconds timeout = 5000ms,
                                               std::uint32_t workers = 3) {
  EngineOptions o;
  o.max_workers = workers;
  o.timeout = timeout;
  return std::make_unique<KVTransferManager>(TransferEngineInfo{"test", "", "shm", o},
                                             std::move(cache));
}

std::vector<std::uint32_t> spread_pages(std::size_t n, std::uint32_t num_pages,
                                        std::uint32_t first = 3) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<std::uint32_t>((first + i * 7) % num_pages);
  return v;
}

bool all_sentinel(const KVCache& c) {
  const std::byte* p = c.base();
  return std::all_of(p, p + c.size_bytes(), [](std::byte b) { return b == kSentinel; });
}

// Every byte outside the destination spans still holds the sentinel.
std::uint64_t bytes_written_outside(const KVCache& local, const KVLayout& remote,
                                    const std::vector<KVReadInfo>& reads) {
  std::vector<std::uint8_t> named(local.size_bytes(), 0);
  for (const CopySpan& s : plan_copies(local.layout(), remote, reads).spans) {
    std::fill_n(named.begin() + static_cast<std::ptrdiff_t>(s.local_offset), s.length, 1);
  }
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < named.size(); ++i) n += !named[i] && local.base()[i] != kSentinel;
  return n;
}

StatusCode code_of_read(KVTransferManager& m, const SequenceInfo& seq, const KVTransferInfo& info,
                        std::uint64_t tokens, std::string* what = nullptr) {
  try {
    auto f = m.start_async_retrieve(0, tokens, spread_pages(seq.page_indices.size(), 64),
                                    seq.page_indices, info);
    if (!f) return StatusCode::kOk;
    f->wait_for(10s);
    if (what) *what = f->status().message();
    return f->status().code();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
}

// ---- data -------------------------------------------------------------------

TEST(ShmEngine, FullPullFromAnotherProcessMovesEveryByteAndNothingElse) {
  const KVLayout l = small_layout();
  Owner owner(l, 300);  // the last page holds 12 of 16 tokens
  auto cache = sentinel_cache(l);
  auto m = shm_manager(cache);
  const auto lp = spread_pages(owner.seq.page_indices.size(), 64);
  const auto bytes =
      m->sync_retrieve(0, 300, lp, owner.seq.page_indices, owner.seq.kv_transfer_info);
  EXPECT_EQ(bytes, 300u * l.token_bytes() * 2 * l.num_layers);
  auto v = verify_pattern(*cache, kSeed, lp, 0, 300);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  EXPECT_EQ(v.blocks_checked, 19u * 4 * 2);
  EXPECT_EQ(bytes_written_outside(*cache, l, plan_reads(l, 0, 300, lp, owner.seq.page_indices)),
            0u);
}

TEST(ShmEngine, PartialPagesInBothInPageOrders) {
  for (auto lpo : {PageOrder::kNHD, PageOrder::kHND}) {
    for (auto rpo : {PageOrder::kNHD, PageOrder::kHND}) {
      const KVLayout remote = small_layout(CacheOrder::kLayerMajor, rpo);
      const KVLayout local = small_layout(CacheOrder::kLayerMajor, lpo);
      Owner owner(remote, 90);  // 5 full pages + 10 tokens
      auto cache = sentinel_cache(local);
      auto m = shm_manager(cache);
      const auto lp = spread_pages(6, 64);
      m->sync_retrieve(7, 90, lp, owner.seq.page_indices, owner.seq.kv_transfer_info);
      auto v = verify_pattern(*cache, kSeed, lp, 7, 90);
      EXPECT_TRUE(v.ok()) << to_string(lpo) << " <- " << to_string(rpo) << ": " << v.first_mismatch;
      EXPECT_EQ(bytes_written_outside(*cache, remote,
                                      plan_reads(local, 7, 90, lp, owner.seq.page_indices)),
                0u)
          << to_string(lpo) << " <- " << to_string(rpo);
    }
  }
}

// A pull of `tokens` tokens in both remote in-page orders into a page-major
// NHD cache of 1200 pages, `times` times: byte-exact, nothing else written,
// and every pull's byte count passed to `check_bytes`.
template <typename CheckBytes>
void pull_in_both_orders(std::uint64_t tokens, int times, CheckBytes check_bytes) {
  for (auto rpo : {PageOrder::kNHD, PageOrder::kHND}) {
    const KVLayout remote = small_layout(CacheOrder::kLayerMajor, rpo, 1200);
    const KVLayout local = small_layout(CacheOrder::kPageMajor, PageOrder::kNHD, 1200);
    Owner owner(remote, tokens);
    auto cache = sentinel_cache(local);
    auto m = shm_manager(cache);
    const auto lp = spread_pages(owner.seq.page_indices.size(), 1200);
    for (int i = 0; i < times; ++i) {
      check_bytes(
          m->sync_retrieve(0, tokens, lp, owner.seq.page_indices, owner.seq.kv_transfer_info));
    }
    auto v = verify_pattern(*cache, kSeed, lp, 0, tokens);
    EXPECT_TRUE(v.ok()) << to_string(rpo) << ": " << v.first_mismatch;
    EXPECT_EQ(bytes_written_outside(*cache, remote,
                                    plan_reads(local, 0, tokens, lp, owner.seq.page_indices)),
              0u)
        << to_string(rpo);
  }
}

// Reads of at least kStreamBytes copy with streaming stores and prefetching
// (span_copy.hpp): byte-exact too, in the plain and the NHD <- HND layout,
// a partial last page, nothing else written.
TEST(ShmEngine, PullsLargeEnoughToStreamAreByteExact) {
  pull_in_both_orders(1100 * 16 + 5, 1, [](std::uint64_t bytes) {
    ASSERT_GE(bytes, shm::kStreamBytes) << "too small to stream";
  });
}

// Reads over kInlineCopyBytes and up to kHelpCopyBytes: the calling thread
// copies pieces beside the workers. Byte-exact, nothing else written, in
// both in-page orders, the future resolving with every byte, three times on
// one engine.
TEST(ShmEngine, PullsTheCallerHelpsCopyAreByteExact) {
  const KVLayout l = small_layout(CacheOrder::kPageMajor, PageOrder::kNHD, 1200);
  const std::uint64_t per_token = l.token_bytes() * 2 * l.num_layers;
  pull_in_both_orders((4u << 20) / per_token + 7, 3, [](std::uint64_t bytes) {  // ~4 MiB
    ASSERT_GT(bytes, ShmKVTransferEngine::kInlineCopyBytes);
    ASSERT_LE(bytes, ShmKVTransferEngine::kHelpCopyBytes);
  });
}

// A read of kPiecewiseReads KVReadInfo or more between caches of one
// geometry is planned run by run on the workers: byte-exact with a prefix
// hit mid-page and a partial last page, in every cache order, nothing else
// written, the timing naming the spans before coalescing; 1-token pages
// (the calling thread helps: 2 MiB) and 16-token ones (streamed: 33 MB).
TEST(ShmEngine, ManyReadsArePlannedOnTheWorkersByteExact) {
  struct Case {
    std::uint32_t page_size, pages;
    std::uint64_t tokens;
  };
  for (const Case c : {Case{1, 2048, 1100}, Case{16, 1100, 1030 * 16 + 5}}) {
    const KVLayout remote = testing::make_layout(4, c.pages, c.page_size, 2, 64);
    Owner owner(remote, c.tokens);
    for (auto co : {CacheOrder::kLayerMajor, CacheOrder::kPageMajor, CacheOrder::kLayerPage}) {
      const KVLayout local =
          testing::make_layout(4, c.pages, c.page_size, 2, 64, DType::kBFloat16, co);
      auto cache = sentinel_cache(local);
      auto m = shm_manager(cache);
      const auto lp = spread_pages(owner.seq.page_indices.size(), c.pages);
      const auto reads = plan_reads(local, 7, c.tokens, lp, owner.seq.page_indices);
      ASSERT_GE(reads.size(), ShmKVTransferEngine::kPiecewiseReads);
      auto f = m->start_async_retrieve(7, c.tokens, lp, owner.seq.page_indices,
                                       owner.seq.kv_transfer_info);
      ASSERT_TRUE(f.has_value());
      EXPECT_EQ(f->get(), (c.tokens - 7) * local.token_bytes() * 2 * local.num_layers);
      EXPECT_EQ(f->timing().copies, plan_copies(local, remote, reads).uncoalesced_spans);
      auto v = verify_pattern(*cache, kSeed, lp, 7, c.tokens);
      EXPECT_TRUE(v.ok()) << c.page_size << "-token pages, " << to_string(co) << ": "
                          << v.first_mismatch;
      EXPECT_EQ(bytes_written_outside(*cache, remote, reads), 0u)
          << c.page_size << "-token pages, " << to_string(co);
    }
  }
}

// ... and every one of its reads is checked before any byte moves: a bad
// last read refuses the whole read, naming it, with nothing written.
TEST(ShmEngine, ManyReadsAreAllCheckedBeforeAnyByteMoves) {
  const KVLayout l = testing::make_layout(4, 2048, 1, 2, 64);
  Owner owner(l, 1100);
  auto cache = sentinel_cache(l);
  ShmKVTransferEngine engine(cache);
  const auto reads = plan_reads(l, 0, 1100, spread_pages(1100, 2048), owner.seq.page_indices);
  ASSERT_GE(reads.size(), ShmKVTransferEngine::kPiecewiseReads);
  const std::string last = "read_info[" + std::to_string(reads.size() - 1) + "]";
  struct Bad {
    const char* says;
    void (*mutate)(std::vector<KVReadInfo>&);
  };
  const Bad cases[] = {
      {"duplicate destination",
       [](auto& r) {
         r.back().local_page_idx = r.front().local_page_idx;
         r.back().layer_idx = r.front().layer_idx;
       }},
      {"remote page", [](auto& r) { r.back().remote_page_idx = 2048; }},
      {"local page", [](auto& r) { r.back().local_page_idx = -1; }},
      {"token range", [](auto& r) { r.back().token_end = 2; }},
      {"layer", [](auto& r) { r.back().layer_idx = 4; }},
  };
  for (const Bad& b : cases) {
    auto bad = reads;
    b.mutate(bad);
    try {
      (void)engine.read_batched_async(owner.seq.kv_transfer_info, bad);
      ADD_FAILURE() << b.says << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
      EXPECT_NE(std::string(e.what()).find(last), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << e.what();
    }
  }
  EXPECT_TRUE(all_sentinel(*cache)) << "a refused read wrote local bytes";
}

// ---- descriptors that must not be read --------------------------------------

class ShmRejects : public ::testing::Test {
 protected:
  void SetUp() override {
    owner_ = std::make_unique<Owner>(l_, 64);
    cache_ = sentinel_cache(l_);
    m_ = shm_manager(cache_);
    good_ = ShmKVTransferInfo::decode(owner_->seq.kv_transfer_info);
  }
  void TearDown() override {
    EXPECT_TRUE(all_sentinel(*cache_)) << "a rejected read wrote local bytes";
  }
  // A read through `bad` fails with `code`, its message naming `needle`.
  void expect_refused(const ShmKVTransferInfo& bad, StatusCode code, const std::string& needle) {
    std::string what;
    EXPECT_EQ(read_with(bad, &what), code) << what;
    EXPECT_NE(what.find(needle), std::string::npos) << what;
  }
  StatusCode read_with(const ShmKVTransferInfo& info, std::string* what = nullptr) {
    return code_of_read(*m_, owner_->seq, info.encode(), 64, what);
  }

  KVLayout l_ = small_layout();
  std::unique_ptr<Owner> owner_;
  std::shared_ptr<KVCache> cache_;
  std::unique_ptr<KVTransferManager> m_;
  ShmKVTransferInfo good_;
};

TEST_F(ShmRejects, CacheOfADeadOwner) {
  owner_->child().write_line("quit");
  ASSERT_EQ(owner_->child().wait_for(10s), 0);
  std::string what;
  EXPECT_EQ(read_with(good_, &what), StatusCode::kNotFound) << what;
  EXPECT_NE(what.find("no longer exists"), std::string::npos) << what;
}

TEST_F(ShmRejects, CacheFreedAndReallocatedByALiveOwner) {
  // A first read maps and caches the old generation.
  auto scratch = sentinel_cache(l_);
  auto m2 = shm_manager(scratch);
  m2->sync_retrieve(0, 64, spread_pages(4, 64), owner_->seq.page_indices,
                    owner_->seq.kv_transfer_info);
  owner_->child().write_line("regen");
  const SequenceInfo fresh = owner_->next_sequence();
  std::string what;
  const StatusCode c1 = read_with(good_, &what);
  EXPECT_TRUE(c1 == StatusCode::kStaleDescriptor || c1 == StatusCode::kNotFound)
      << to_string(c1) << ": " << what;
  const StatusCode c2 = code_of_read(*m2, owner_->seq, good_.encode(), 64, &what);
  EXPECT_TRUE(c2 == StatusCode::kStaleDescriptor || c2 == StatusCode::kNotFound)
      << "cached mapping of a freed cache was used: " << to_string(c2) << ": " << what;
  // The new generation reads fine (and replaces the cached one).
  auto ok = sentinel_cache(l_);
  auto m3 = shm_manager(ok);
  const auto lp = spread_pages(4, 64);
  m3->sync_retrieve(0, 64, lp, fresh.page_indices, fresh.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*ok, kSeed, lp, 0, 64).ok());
}

TEST_F(ShmRejects, StaleGeneration) {
  ShmKVTransferInfo bad = good_;
  bad.nonce ^= 1;
  expect_refused(bad, StatusCode::kStaleDescriptor, "generation");
}

TEST_F(ShmRejects, RestartedOwnerPid) {
  ShmKVTransferInfo bad = good_;
  bad.start_time += 1;
  expect_refused(bad, StatusCode::kStaleDescriptor, "restarted");
}

TEST_F(ShmRejects, AnotherUsersCache) {
  ShmKVTransferInfo bad = good_;
  bad.uid += 1;
  expect_refused(bad, StatusCode::kPermissionDenied, "same user");
  // Also when a mapping of the genuine descriptor is already cached.
  auto scratch = sentinel_cache(l_);
  auto m2 = shm_manager(scratch);
  m2->sync_retrieve(0, 64, spread_pages(4, 64), owner_->seq.page_indices,
                    owner_->seq.kv_transfer_info);
  EXPECT_EQ(code_of_read(*m2, owner_->seq, bad.encode(), 64), StatusCode::kPermissionDenied);
}

TEST_F(ShmRejects, AnotherUserCannotOpenItEvenWithAForgedUid) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to start a reader as another user";
  // A reader running as nobody rewrites the descriptor's uid to its own: the
  // kernel's access check on /proc/<pid>/fd must still refuse it.
  Child other({SHM_PEER_PATH, "--reader", "--as-uid", "65534", "--layout", testing::layout_arg(l_),
               "--seed", std::to_string(kSeed)});
  other.write_line("tryopen " + testing::to_hex(owner_->seq.encode()));
  const std::string line = other.read_line();
  EXPECT_EQ(line.rfind("CODE " + std::string(to_string(StatusCode::kPermissionDenied)), 0), 0u)
      << line;
}

TEST_F(ShmRejects, FdThatIsNotASharedCache) {
  for (std::uint32_t fd : {0u, 1u, 2u, 999u}) {
    ShmKVTransferInfo bad = good_;
    bad.fd = fd;
    std::string what;
    const StatusCode c = read_with(bad, &what);
    EXPECT_TRUE(c == StatusCode::kStaleDescriptor || c == StatusCode::kNotFound)
        << "fd " << fd << ": " << to_string(c) << ": " << what;
  }
}

TEST_F(ShmRejects, SizeLargerThanTheMemory) {
  ShmKVTransferInfo bad = good_;
  bad.size += 4096;
  std::string what;
  EXPECT_EQ(read_with(bad, &what), StatusCode::kStaleDescriptor) << what;
}

TEST_F(ShmRejects, IncompatibleLayout) {
  KVLayout other = l_;
  other.head_dim = 32;
  auto cache = sentinel_cache(other);
  auto m = shm_manager(cache);
  std::string what;
  EXPECT_EQ(code_of_read(*m, owner_->seq, owner_->seq.kv_transfer_info, 64, &what),
            StatusCode::kIncompatibleLayout)
      << what;
  EXPECT_NE(what.find("head_dim"), std::string::npos) << what;
  EXPECT_TRUE(all_sentinel(*cache));
}

// /proc/<tid>/fd of one of the owner's threads opens the owner's very
// memory; a descriptor naming such a tid is not what the owner published
// (found by a bit flip of the pid that landed on a thread).
TEST_F(ShmRejects, APidThatIsOneOfTheOwnersThreads) {
  std::uint32_t tid = 0;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + std::to_string(good_.pid) + "/task")) {
    const auto t = static_cast<std::uint32_t>(std::stoul(e.path().filename().string()));
    if (t != good_.pid) tid = t;
  }
  ASSERT_NE(tid, 0u) << "the owner runs no thread besides its main one";
  ShmKVTransferInfo bad = good_;
  bad.pid = tid;
  expect_refused(bad, StatusCode::kStaleDescriptor, "names a thread of process");
}

TEST_F(ShmRejects, CorruptOrForeignBytes) {
  const KVTransferInfo info = owner_->seq.kv_transfer_info;
  for (std::size_t n = 0; n < info.payload.size(); ++n) {
    KVTransferInfo bad = info;
    bad.payload.resize(n);
    EXPECT_EQ(code_of_read(*m_, owner_->seq, bad, 64), StatusCode::kCorruptDescriptor)
        << "payload truncated to " << n;
  }
  KVTransferInfo longer = info;
  longer.payload.push_back(0);
  EXPECT_EQ(code_of_read(*m_, owner_->seq, longer, 64), StatusCode::kCorruptDescriptor);
  // Every single-bit flip either fails to decode or is rejected by a check;
  // none may read another cache or crash.
  for (std::size_t i = 0; i < info.payload.size(); ++i) {
    KVTransferInfo bad = info;
    bad.payload[i] ^= 0x10;
    const StatusCode c = code_of_read(*m_, owner_->seq, bad, 64);
    EXPECT_NE(c, StatusCode::kOk) << "flipped payload byte " << i << " was read";
  }
  // Flipped bytes of the SequenceInfo frame fail its checksum.
  auto bytes = owner_->seq.encode();
  for (std::size_t i = 0; i < bytes.size(); i += 7) {
    auto bad = bytes;
    bad[i] ^= 0x01;
    EXPECT_THROW(SequenceInfo::decode(bad), Error) << "byte " << i;
  }
  KVTransferInfo foreign = info;
  foreign.engine = "ucx";
  EXPECT_EQ(code_of_read(*m_, owner_->seq, foreign, 64), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of_read(*m_, owner_->seq, KVTransferInfo{}, 64), StatusCode::kInvalidArgument);
}

// ---- faults -------------------------------------------------------------------

TEST(ShmEngine, OwnerKilledDuringReadsNeverCrashesHangsOrLies) {
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 1024);  // 32 MiB
  Owner owner(l, 1024 * 16, 0);
  auto cache = make_kv_cache(l, MemoryKind::kHost);
  auto m = shm_manager(cache, 5000ms, 1);
  std::vector<std::uint32_t> lp(1024);
  for (std::uint32_t i = 0; i < 1024; ++i) lp[i] = i;
  const auto& seq = owner.seq;
  std::atomic<bool> killed{false};
  std::jthread killer([&] {             // joined on every way out of the test
    std::this_thread::sleep_for(30ms);  // a few reads in
    killed = true;                      // before the kill: a read may fail from now on
    owner.child().kill_now();
  });
  const auto t0 = std::chrono::steady_clock::now();
  int failed = 0;
  while (std::chrono::steady_clock::now() - t0 < 20s) {
    std::optional<TransferFuture> f;
    try {
      f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
    } catch (const Error& e) {
      EXPECT_TRUE(killed) << "rejected before the kill: " << e.what();
      EXPECT_EQ(e.code(), StatusCode::kNotFound) << e.what();
      ++failed;
      break;
    }
    ASSERT_TRUE(f->wait_for(10s)) << "a read did not resolve";
    if (f->status().is_ok()) {
      // Completed, maybe after the owner died: then every byte must be right.
      auto v = verify_pattern(*cache, kSeed, lp, 0, seq.num_tokens);
      ASSERT_TRUE(v.ok()) << "success reported with wrong bytes: " << v.first_mismatch;
    } else {
      EXPECT_TRUE(killed) << "failed before the kill: " << f->status().to_string();
      ++failed;
      break;
    }
  }
  killer.join();
  EXPECT_EQ(failed, 1) << "reads of a dead owner's descriptor must fail";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 20s);
}

// What every engine does at shutdown is the conformance suite's; here, that
// the peers' caches are unmapped once the reads in flight resolved.
TEST(ShmEngine, ShutdownUnmapsEveryPeersCache) {
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 512);  // 16 MiB
  Owner owner(l, 512 * 16);
  auto cache = make_kv_cache(l, MemoryKind::kHost);
  auto m = shm_manager(cache, 20000ms, 2);
  const auto lp = spread_pages(512, 512);
  auto f =
      m->start_async_retrieve(0, 512 * 16, lp, owner.seq.page_indices, owner.seq.kv_transfer_info);
  auto& engine = static_cast<ShmKVTransferEngine&>(m->engine());
  EXPECT_EQ(engine.cached_mappings(), 1u);
  m->cleanup();
  ASSERT_TRUE(f->ready()) << "cleanup() returned with a read unresolved";
  EXPECT_EQ(engine.cached_mappings(), 0u);
  m->cleanup();  // idempotent
}

std::set<std::string> dir_entries(const char* path) {
  std::set<std::string> out;
  if (DIR* d = ::opendir(path)) {
    while (dirent* e = ::readdir(d)) out.insert(e->d_name);
    ::closedir(d);
  }
  return out;
}

// The mappings of a process that are backed by a named file under /dev/shm,
// and whether it maps the anonymous cache memfd.
struct MapsView {
  bool has_memfd = false;
  std::vector<std::string> dev_shm;
};
MapsView maps_of(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  MapsView v;
  for (std::string line; std::getline(maps, line);) {
    v.has_memfd |= line.find("/memfd:mstar-kv-cache (deleted)") != std::string::npos;
    if (line.find("/dev/shm/") != std::string::npos) v.dev_shm.push_back(line);
  }
  return v;
}

TEST(ShmEngine, NoFileLeftAfterKill9OfEitherSide) {
  const auto before = dir_entries("/dev/shm");
  const KVLayout l = small_layout(CacheOrder::kLayerMajor, PageOrder::kNHD, 256);
  for (const bool kill_owner_first : {true, false}) {
    Owner owner(l, 256 * 16);
    Child reader({SHM_PEER_PATH, "--reader", "--layout", testing::layout_arg(l), "--seed",
                  std::to_string(kSeed)});
    reader.write_line("pullloop " + testing::to_hex(owner.seq.encode()));
    ASSERT_EQ(reader.read_line(), "LOOPING");
    // Both sides hold the cache only as an anonymous memfd: no name in any
    // file system, so there is nothing to clean up after kill -9.
    for (pid_t pid : {owner.child().pid(), reader.pid()}) {
      const MapsView v = maps_of(pid);
      EXPECT_TRUE(v.has_memfd) << "pid " << pid << " does not map the cache memfd";
      EXPECT_TRUE(v.dev_shm.empty()) << "pid " << pid << " maps " << v.dev_shm.front();
    }
    if (kill_owner_first) {
      owner.child().kill_now();
      reader.kill_now();
    } else {
      reader.kill_now();
      owner.child().kill_now();
    }
    // Other tests running at the same time may create their own files here;
    // none may be ours.
    for (const auto& name : dir_entries("/dev/shm")) {
      if (before.count(name) == 0) {
        EXPECT_EQ(name.find("mstar"), std::string::npos) << "left behind: /dev/shm/" << name;
      }
    }
  }
}

// ---- the memory itself ------------------------------------------------------

TEST(ShmMemory, SharedCacheIsSealedAndDescribed) {
  const KVLayout l = small_layout();
  auto cache = make_kv_cache(l, MemoryKind::kSharedHost);
  EXPECT_EQ(cache->memory_kind(), MemoryKind::kSharedHost);
  ShmKVTransferEngine engine(cache);
  const auto info = engine.shm_info();
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->pid, static_cast<std::uint32_t>(::getpid()));
  EXPECT_EQ(info->uid, static_cast<std::uint32_t>(::geteuid()));
  EXPECT_EQ(info->layout, l);
  EXPECT_EQ(info->size, l.total_bytes());
  EXPECT_NE(info->nonce, 0u);
  EXPECT_EQ(ShmKVTransferInfo::decode(engine.get_kv_transfer_info()), *info);
  // The size can never shrink: a reader's mapping can never SIGBUS.
  const int fd = static_cast<int>(info->fd);
  const int seals = ::fcntl(fd, F_GET_SEALS);
  EXPECT_NE(seals & F_SEAL_SHRINK, 0);
  EXPECT_NE(seals & F_SEAL_SEAL, 0);
  EXPECT_NE(::ftruncate(fd, 4096), 0);
  // Two caches never share a nonce.
  auto other = make_kv_cache(l, MemoryKind::kSharedHost);
  ShmKVTransferEngine e2(other);
  EXPECT_NE(e2.shm_info()->nonce, info->nonce);
}

TEST(ShmMemory, ReaderMappingIsReadOnly) {
  const KVLayout l = small_layout();
  Owner owner(l, 64);
  ShmMapping mapping = ShmMapping::open(ShmKVTransferInfo::decode(owner.seq.kv_transfer_info));
  EXPECT_TRUE(mapping.check_owner().is_ok());
  // The file was opened O_RDONLY: the mapping cannot be made writable.
  void* page = const_cast<std::byte*>(mapping.data()) - ShmMapping::kHeaderBytes;
  EXPECT_NE(::mprotect(page, 4096, PROT_READ | PROT_WRITE), 0);
  EXPECT_EQ(errno, EACCES);
  EXPECT_TRUE(mapping.check_owner().is_ok());
  owner.child().kill_now();
  const Status s = mapping.check_owner();
  EXPECT_EQ(s.code(), StatusCode::kNotFound) << s.to_string();
}

// A private cache publishes a cross-memory attach descriptor (cma tests:
// shm_cma_test.cpp): its one region, tables and anchor.
TEST(ShmMemory, PrivateCachePublishesItsRegionForCrossMemoryAttach) {
  auto cache = make_kv_cache(small_layout(), MemoryKind::kHost);
  ShmKVTransferEngine engine(cache);
  ASSERT_FALSE(engine.get_kv_transfer_info().empty());
  const auto info = engine.shm_info();
  ASSERT_TRUE(info.has_value());
  EXPECT_EQ(info->access, ShmKVTransferInfo::Access::kCma);
  EXPECT_EQ(info->pid, static_cast<std::uint32_t>(::getpid()));
  ASSERT_EQ(info->regions.size(), 1u);
  EXPECT_EQ(info->regions[0], reinterpret_cast<std::uintptr_t>(cache->base()));
  EXPECT_EQ(info->epochs_addr, reinterpret_cast<std::uintptr_t>(cache->epochs().words()));
  EXPECT_EQ(ShmKVTransferInfo::decode(info->encode()), *info);
  // Nothing to read still validates the descriptor (engine.hpp): the empty
  // (local-only) one is no shm descriptor; a shared cache's is.
  EXPECT_THROW(engine.read_batched_async(KVTransferInfo{}, {}), Error);
  ShmKVTransferEngine owner(make_kv_cache(small_layout(), MemoryKind::kSharedHost));
  EXPECT_FALSE(engine.read_batched_async(owner.get_kv_transfer_info(), {}).has_value());
  EXPECT_THROW(ShmKVTransferEngine(cache, ShmEngineOptions{0, 1000ms}), Error);
  EXPECT_THROW(ShmKVTransferEngine(nullptr), Error);
}

// Found by an adopter: timeout = 0 ms was accepted by shm (large reads then
// failed at once) and refused by cuda_ipc: one rule, >= 1 ms, for all.
// The constructor every engine has, (cache, TransferEngineInfo), parses the
// options as make_engine does: a misspelt shm_ key is refused by name.
TEST(ShmEngine, TheFactoryShapeParsesTheOptionsAsMakeEngineDoes) {
  auto c = make_kv_cache(testing::make_layout(1, 4, 16, 1, 8), MemoryKind::kSharedHost);
  TransferEngineInfo info{"me", "", "shm", {}};
  info.options.extra = {{"shm_wrokers", "2"}};
  const std::string direct = testing::expect_error([&] { ShmKVTransferEngine e(c, info); },
                                                   StatusCode::kInvalidArgument, {"shm_wrokers"});
  const std::string made = testing::expect_error([&] { make_engine(info, c); },
                                                 StatusCode::kInvalidArgument, {"shm_wrokers"});
  EXPECT_EQ(direct, made);
  info.options.extra.clear();
  info.options.timeout = std::chrono::milliseconds(250);
  ShmKVTransferEngine e(c, info);
  EXPECT_FALSE(e.get_kv_transfer_info().empty());
}

TEST(ShmEngine, ZeroTimeoutIsRefusedAsByEveryEngine) {
  const KVLayout l = testing::make_layout(1, 4, 16, 1, 8);
  auto c = make_kv_cache(l, MemoryKind::kSharedHost);
  TransferEngineInfo info{"me", "", "shm", {}};
  info.options.timeout = std::chrono::milliseconds(0);
  testing::expect_error([&] { KVTransferManager m(info, c); }, StatusCode::kInvalidArgument,
                        {"timeout 0 ms out of range [1"});
  info.options.timeout = std::chrono::milliseconds(1);
  EXPECT_NO_THROW(KVTransferManager(info, c));
}

}  // namespace
}  // namespace mstar::kv
