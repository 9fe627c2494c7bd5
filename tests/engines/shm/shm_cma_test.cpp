// Copyright mstar-kv authors.
//
// The shm engine serving a private cache (one region, or one per layer)
// through cross-memory attach, between real processes (shm_peer --private,
// --layers): byte-exact pulls into shared, private and layer-split caches;
// an owner killed mid-read; stale descriptors after the owner's engine or
// cache changed; forged descriptors refused by name before any byte moves;
// a reader the kernel forbids (seccomp, another user) told why. Every engine
// invariant besides is checked by the conformance and streaming suites'
// shm-cma and shm-cma-layers setups.
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstring>
#include <map>
#include <thread>

#include "common/cache_probe.hpp"
#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "common/peer.hpp"
#include "common/wire.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "shm_test_kit.hpp"
#include "toolkit/read_check.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::Child;
using testing::expect_error;
using testing::forged;
using testing::make_layout;
using testing::shm_manager;
using testing::spread_pages;

constexpr std::byte kSentinel{0xA5};
constexpr std::uint64_t kSeed = 4242;

// A shm_peer owning a private cache ("--private") or one of one region per
// layer ("--layers") with one sequence filled with the pattern.
struct PrivateOwner : testing::Peer {
  PrivateOwner(const KVLayout& l, std::uint64_t tokens, const char* memory = "--private")
      : Peer({SHM_PEER_PATH, memory, "--layout", testing::layout_arg(l), "--tokens",
              std::to_string(tokens), "--seed", std::to_string(kSeed), "--scatter", "5"}),
        seq(sequence()) {}
  SequenceInfo seq;
};

enum class ReaderCache { kShared, kPrivate, kLayers };

std::shared_ptr<KVCache> reader_cache(const KVLayout& l, ReaderCache kind) {
  std::shared_ptr<KVCache> c =
      kind == ReaderCache::kLayers
          ? KVCache::create_host_layers(l)
          : make_kv_cache(
                l, kind == ReaderCache::kShared ? MemoryKind::kSharedHost : MemoryKind::kHost);
  testing::fill_bytes(*c, kSentinel);
  return c;
}

// The start of a case: an owner of `tokens` tokens of small_layout() in a
// private cache, a reader's private cache, its manager and the local pages
// the sequence lands on, spread over that cache.
struct PrivatePull {
  explicit PrivatePull(std::uint64_t tokens)
      : owner(l, tokens),
        cache(reader_cache(l, ReaderCache::kPrivate)),
        m(shm_manager(cache)),
        pages(spread_pages(owner.seq.page_indices.size(), l.num_pages)) {}
  const KVLayout l = testing::small_layout();
  PrivateOwner owner;
  std::shared_ptr<KVCache> cache;
  std::unique_ptr<KVTransferManager> m;
  const std::vector<std::uint32_t> pages;
};

// The conformance suites' shm setups make the caches they name, and the
// owner's engine publishes what they hold.
TEST(ShmCma, TheLoopbackSetupsMakeTheCachesTheyName) {
  const EngineTraits shm = engine_traits("shm");
  const KVLayout l = testing::small_layout();
  std::map<std::string, std::size_t> regions;
  for (const LoopbackSetup& s : shm.loopback) {
    auto owner = make_loopback_cache(shm, s, l, /*owner=*/true);
    auto reader = make_loopback_cache(shm, s, l, /*owner=*/false);
    ShmKVTransferEngine engine(owner);
    const ShmKVTransferInfo info = *engine.shm_info();
    regions[s.name] = info.access == ShmKVTransferInfo::Access::kCma ? info.regions.size() : 0;
    EXPECT_EQ(reader->split(), s.layer_regions) << s.name;
    // A page-major cache cannot be split: one region.
    EXPECT_FALSE(
        make_loopback_cache(shm, s, testing::small_layout(CacheOrder::kPageMajor), true)->split());
  }
  EXPECT_EQ(regions,
            (std::map<std::string, std::size_t>{
                {"shm", 0}, {"shm-cma", 1}, {"shm-cma-layers", 4}, {"shm-mapped-layers", 4}}));
}

TEST(ShmCma, PrivateAndLayerSplitOwnersPullByteExactIntoEveryKindOfCache) {
  // 4 layers x 64 pages of 4 KiB blocks: both a small (inline) and a large
  // (worker pool) read.
  const KVLayout l = testing::small_layout();
  for (const char* memory : {"--private", "--layers"}) {
    SCOPED_TRACE(memory);
    PrivateOwner owner(l, 1000, memory);
    const ShmKVTransferInfo info = ShmKVTransferInfo::decode(owner.seq.kv_transfer_info);
    EXPECT_EQ(info.access, ShmKVTransferInfo::Access::kCma);
    EXPECT_EQ(info.regions.size(), std::string(memory) == "--layers" ? 4u : 1u);
    // Private memory has no file to map (what tools' baselines would do).
    expect_error([&] { map_shm_cache(owner.seq.kv_transfer_info); }, StatusCode::kInvalidArgument,
                 {"cannot be mapped"});
    for (ReaderCache kind : {ReaderCache::kShared, ReaderCache::kPrivate, ReaderCache::kLayers}) {
      SCOPED_TRACE(static_cast<int>(kind));
      auto cache = reader_cache(l, kind);
      auto m = shm_manager(cache);
      const auto pages = spread_pages(owner.seq.page_indices.size(), l.num_pages);
      // A prefix hit: tokens [40, 1000) only.
      m->sync_retrieve(40, 1000, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
      const auto reads = plan_reads(l, 40, 1000, pages, owner.seq.page_indices);
      EXPECT_EQ(testing::bytes_written_outside(*cache, l, reads, kSentinel), 0u);
      auto host = testing::download(*cache);
      testing::fill_pattern_any(*host, kSeed, pages, 0, 40);  // what the prefix would hold
      EXPECT_TRUE(verify_pattern(*host, kSeed, pages, 0, 1000).ok());
      // A small read (inline on this thread): one page of one sequence.
      m->sync_retrieve(0, 16, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
      EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, pages, 0, 16).ok());
      EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, pages, 40, 1000).ok());
    }
  }
}

TEST(ShmCma, OwnerKilledMidReadFailsInBoundedTimeAndNothingLandsAfter) {
  // 4 layers x 512 pages x 32 KiB blocks = 128 MiB: the read takes tens of
  // milliseconds, long enough to be killed in.
  const KVLayout l = make_layout(4, 512, 16, 8, 128);
  const std::uint64_t tokens = 512 * 16;
  int killed_mid_read = 0;
  for (int round = 0; round < 2; ++round) {
    PrivateOwner owner(l, tokens, round % 2 == 0 ? "--private" : "--layers");
    auto cache = make_kv_cache(l, MemoryKind::kHost);
    auto m = shm_manager(cache, 10000ms);
    std::vector<std::uint32_t> pages(owner.seq.page_indices.size());
    for (std::uint32_t i = 0; i < pages.size(); ++i) pages[i] = i;
    const auto reads = plan_reads(l, 0, tokens, pages, owner.seq.page_indices);
    toolkit::ReadChecker checker(*cache, l, reads, 1);
    const auto started = std::chrono::steady_clock::now();
    auto f = m->start_async_retrieve(0, tokens, pages, owner.seq.page_indices,
                                     owner.seq.kv_transfer_info);
    ASSERT_TRUE(f.has_value());
    std::this_thread::sleep_for(2ms);
    owner.kill_now();
    ASSERT_TRUE(f->wait_for(5s)) << "the read did not resolve within 5 s of the owner's death";
    EXPECT_LT(std::chrono::steady_clock::now() - started, 5s);
    EXPECT_EQ(checker.check(*f, 1s, 100ms), "");
    if (f->status().is_ok()) {
      EXPECT_TRUE(verify_pattern(*cache, kSeed, pages, 0, tokens).ok());
    } else {
      ++killed_mid_read;
      EXPECT_EQ(f->status().code(), StatusCode::kNotFound) << f->status().to_string();
      EXPECT_NE(f->status().message().find("exited"), std::string::npos);
    }
    // Whatever happened to that read, the next one names the dead owner.
    expect_error(
        [&] {
          m->sync_retrieve(0, tokens, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
        },
        StatusCode::kNotFound, {"owner process"});
  }
  EXPECT_GT(killed_mid_read, 0) << "no read was in flight when its owner died";
  std::printf("reads killed mid-read: %d of 2\n", killed_mid_read);
}

TEST(ShmCma, ANewEngineOrCacheOfTheOwnerMakesItsOldDescriptorsStale) {
  PrivatePull p(500);
  auto& [l, owner, cache, m, pages] = p;
  m->sync_retrieve(0, 500, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
  // The same cache under a new engine: a new anchor, a new nonce.
  const SequenceInfo old = owner.seq;
  owner.send("reengine");
  const SequenceInfo fresh = owner.read_sequence();
  testing::fill_bytes(*cache, kSentinel);
  // Both the cache's own descriptor (epoch 0, nothing but the nonce checks
  // it) and the sequence's.
  KVTransferInfo own = old.kv_transfer_info;
  own.epoch = 0;
  for (const KVTransferInfo& d : {own, old.kv_transfer_info}) {
    expect_error([&] { m->sync_retrieve(0, 500, pages, old.page_indices, d); },
                 StatusCode::kStaleDescriptor, {"engine shut down"});
    EXPECT_EQ(testing::bytes_written_outside(*cache, l, {}, kSentinel), 0u);
  }
  m->sync_retrieve(0, 500, pages, fresh.page_indices, fresh.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, pages, 0, 500).ok());
  // A new cache: the old descriptor names memory the owner freed.
  owner.send("regen");
  const SequenceInfo regen = owner.read_sequence();
  expect_error([&] { m->sync_retrieve(0, 500, pages, fresh.page_indices, fresh.kv_transfer_info); },
               StatusCode::kStaleDescriptor);
  m->sync_retrieve(0, 500, pages, regen.page_indices, regen.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, pages, 0, 500).ok());
}

TEST(ShmCma, ForgedDescriptorsAreRefusedByNameBeforeAnyByteMoves) {
  const KVLayout l = testing::small_layout();
  PrivateOwner owner(l, 500, "--layers");
  const auto pages = spread_pages(owner.seq.page_indices.size(), l.num_pages);
  struct Case {
    const char* name;
    std::function<void(ShmKVTransferInfo&)> edit;
    StatusCode code;
    std::string needle;
  };
  const std::uint64_t lb = l.layer_bytes();
  const std::vector<Case> cases = {
      {"two regions for four layers", [](auto& i) { i.regions.resize(2); },
       StatusCode::kCorruptDescriptor, "region count 2 is neither 1 nor one per layer (4)"},
      {"more regions than the limit", [](auto& i) { i.regions.resize(5000, 0x10000); },
       StatusCode::kCorruptDescriptor, "region count 5000 out of range [1, 4096]"},
      {"a region beyond the address space", [](auto& i) { i.regions[2] = (1ull << 57) - 4096; },
       StatusCode::kCorruptDescriptor, "layer 2 region"},
      {"overlapping regions", [lb](auto& i) { i.regions[1] = i.regions[0] + lb / 2; },
       StatusCode::kCorruptDescriptor, "overlaps"},
      {"a region over the epoch table", [](auto& i) { i.regions[3] = i.epochs_addr; },
       StatusCode::kCorruptDescriptor, "overlaps"},
      {"region bytes other than a layer's", [](auto& i) { i.region_bytes += 4096; },
       StatusCode::kCorruptDescriptor, "differ from the layout's layer bytes"},
      {"a misaligned epoch table", [](auto& i) { i.epochs_addr += 4; },
       StatusCode::kCorruptDescriptor, "not 8-byte aligned"},
      {"a region the owner does not serve", [](auto& i) { std::swap(i.regions[0], i.regions[1]); },
       StatusCode::kStaleDescriptor, "region addresses differ"},
      {"an anchor that is not mapped", [](auto& i) { i.anchor = 0x1000; },
       StatusCode::kStaleDescriptor, "no longer maps its anchor"},
      {"another nonce", [](auto& i) { i.nonce ^= 1; }, StatusCode::kStaleDescriptor, "nonce"},
      {"another start time", [](auto& i) { i.start_time += 1; }, StatusCode::kStaleDescriptor,
       "owner restarted"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto cache = reader_cache(l, ReaderCache::kLayers);
    auto m = shm_manager(cache);
    const KVTransferInfo bad = forged(owner.seq, c.edit);
    expect_error([&] { m->sync_retrieve(0, 500, pages, owner.seq.page_indices, bad); }, c.code,
                 {c.needle});
    EXPECT_EQ(testing::bytes_written_outside(*cache, l, {}, kSentinel), 0u);
  }
  // The owner's own descriptor still reads.
  auto cache = reader_cache(l, ReaderCache::kLayers);
  shm_manager(cache)->sync_retrieve(0, 500, pages, owner.seq.page_indices,
                                    owner.seq.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, pages, 0, 500).ok());
}

// process_vm_readv answers EPERM on this thread only (seccomp, as a
// container's profile may): the reader is told why and what to change.
void forbid_cross_memory_attach_on_this_thread() {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_process_vm_readv, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog prog{static_cast<unsigned short>(std::size(filter)), filter};
  ASSERT_EQ(::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
  ASSERT_EQ(::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog), 0) << std::strerror(errno);
}

TEST(ShmCma, AReaderTheKernelForbidsIsToldWhyAndWhatToChange) {
  PrivatePull p(500);
  auto& [l, owner, cache, m, pages] = p;
  std::string message;
  std::thread t([&] {
    forbid_cross_memory_attach_on_this_thread();
    // The first read opens the owner (its anchor: the probe) on this thread.
    message = expect_error(
        [&] {
          m->sync_retrieve(0, 500, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
        },
        StatusCode::kPermissionDenied,
        {"process_vm_readv", "ptrace", "seccomp", "memory='shared'"});
  });
  t.join();
  EXPECT_EQ(testing::bytes_written_outside(*cache, l, {}, kSentinel), 0u);
  // Another user: the kernel's refusal (the uid check bypassed by the peer).
  if (::geteuid() != 0) GTEST_SKIP() << "switching users needs root";
  Child other({SHM_PEER_PATH, "--reader", "--as-uid", "65534", "--layout", testing::layout_arg(l),
               "--seed", std::to_string(kSeed)});
  other.write_line("tryopen " + testing::to_hex(owner.seq.encode()));
  const std::string line = other.read_line();
  EXPECT_EQ(line.rfind("CODE " + std::string(to_string(StatusCode::kPermissionDenied)), 0), 0u)
      << line;
  EXPECT_NE(line.find("ptrace"), std::string::npos) << line;
}

}  // namespace
}  // namespace mstar::kv
