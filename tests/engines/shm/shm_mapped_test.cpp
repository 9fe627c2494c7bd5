// Copyright mstar-kv authors.
//
// The shm engine serving a private cache re-backed in place by a memfd
// (map_private, private_backing.hpp), between real processes (shm_peer
// --private / --layers with --extra shm_map_private=on, and --unaligned:
// regions that start and end inside a page, as a tensor's allocation does):
// the owner's bytes and addresses stay its own; readers pull byte-exact
// through the mapped pages (seen in their own /proc/self/maps) and the
// partial pages by cross-memory attach; what the owner writes afterwards is
// what they read; a new engine or cache of the owner makes old descriptors
// stale; forged descriptors naming another fd are refused before any byte
// moves. Every engine invariant besides runs in the conformance and
// streaming suites' shm-mapped-layers setup.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "common/peer.hpp"
#include "common/wire.hpp"
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "shm_test_kit.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using testing::expect_error;
using testing::forged;
using testing::shm_manager;
using testing::spread_pages;

constexpr std::byte kSentinel{0xA5};
constexpr std::uint64_t kSeed = 4242;
// Every page of small_layout(): the reads cover each region's first and
// last (partial, when unaligned) pages too.
constexpr std::uint64_t kTokens = 64 * 16;

struct MappedOwner : testing::Peer {
  MappedOwner(const KVLayout& l, const char* memory, bool unaligned)
      : Peer(args(l, memory, unaligned)), seq(sequence()) {}
  static std::vector<std::string> args(const KVLayout& l, const char* memory, bool unaligned) {
    std::vector<std::string> a = {SHM_PEER_PATH, memory,
                                  "--layout",    testing::layout_arg(l),
                                  "--tokens",    std::to_string(kTokens),
                                  "--seed",      std::to_string(kSeed),
                                  "--scatter",   "5",
                                  "--extra",     "shm_map_private=on"};
    if (unaligned) a.push_back("--unaligned");
    return a;
  }
  SequenceInfo seq;
};

std::shared_ptr<KVCache> sentinel_cache(const KVLayout& l) {
  auto c = make_kv_cache(l, MemoryKind::kHost);
  testing::fill_bytes(*c, kSentinel);
  return c;
}

// Lines of this process's /proc/self/maps that map an owner's re-backed
// pages (the memfd's name).
std::size_t mapped_owner_files() {
  std::ifstream maps("/proc/self/maps");
  std::size_t n = 0;
  for (std::string line; std::getline(maps, line);) {
    n += line.find("memfd:mstar-kv-private") != std::string::npos ? 1 : 0;
  }
  return n;
}

TEST(ShmMapped, OwnersPullByteExactThroughTheirPagesAndWhatTheyWriteLater) {
  const KVLayout l = testing::small_layout();
  for (const char* memory : {"--private", "--layers"}) {
    for (bool unaligned : {false, true}) {
      SCOPED_TRACE(std::string(memory) + (unaligned ? " unaligned" : ""));
      MappedOwner owner(l, memory, unaligned);
      const ShmKVTransferInfo info = ShmKVTransferInfo::decode(owner.seq.kv_transfer_info);
      ASSERT_EQ(info.access, ShmKVTransferInfo::Access::kCma);
      ASSERT_TRUE(info.backed);
      // The page epochs and readiness words are the cache's own: mapped too.
      EXPECT_TRUE(info.backed_tables);
      EXPECT_EQ(info.regions[0] % 4096, unaligned ? 1024u : 0u);
      auto cache = sentinel_cache(l);
      auto m = shm_manager(cache);
      const auto pages = spread_pages(owner.seq.page_indices.size(), l.num_pages);
      const std::size_t before = mapped_owner_files();
      // A prefix hit on the worker pool, then the prefix inline.
      m->sync_retrieve(40, kTokens, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
      m->sync_retrieve(0, 40, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
      EXPECT_TRUE(verify_pattern(*cache, kSeed, pages, 0, kTokens).ok());
      EXPECT_EQ(testing::bytes_written_outside(
                    *cache, l, plan_reads(l, 0, kTokens, pages, owner.seq.page_indices), kSentinel),
                0u);
      // The reader mapped the owner's pages (not only the kernel's copies).
      EXPECT_EQ(mapped_owner_files(), before + 1);
      // What the owner writes now is in the very pages readers map.
      owner.send("refill 77");
      ASSERT_EQ(owner.read_line(), "REFILLED");
      m->sync_retrieve(0, kTokens, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
      EXPECT_TRUE(verify_pattern(*cache, 77, pages, 0, kTokens).ok());
    }
  }
}

TEST(ShmMapped, ANewEngineOrCacheOfTheOwnerMakesItsOldDescriptorsStale) {
  const KVLayout l = testing::small_layout();
  MappedOwner owner(l, "--layers", true);
  auto cache = sentinel_cache(l);
  auto m = shm_manager(cache);
  const auto pages = spread_pages(owner.seq.page_indices.size(), l.num_pages);
  m->sync_retrieve(0, kTokens, pages, owner.seq.page_indices, owner.seq.kv_transfer_info);
  // The same cache under a new engine: re-backed again, a new nonce.
  const SequenceInfo old = owner.seq;
  owner.send("reengine");
  const SequenceInfo fresh = owner.read_sequence();
  testing::fill_bytes(*cache, kSentinel);
  expect_error([&] { m->sync_retrieve(0, kTokens, pages, old.page_indices, old.kv_transfer_info); },
               StatusCode::kStaleDescriptor, {"engine shut down"});
  EXPECT_EQ(testing::bytes_written_outside(*cache, l, {}, kSentinel), 0u);
  ASSERT_TRUE(ShmKVTransferInfo::decode(fresh.kv_transfer_info).backed);
  m->sync_retrieve(0, kTokens, pages, fresh.page_indices, fresh.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, pages, 0, kTokens).ok());
  // A new cache: the old descriptor names memory the owner freed.
  owner.send("regen");
  const SequenceInfo regen = owner.read_sequence();
  expect_error(
      [&] { m->sync_retrieve(0, kTokens, pages, fresh.page_indices, fresh.kv_transfer_info); },
      StatusCode::kStaleDescriptor);
  m->sync_retrieve(0, kTokens, pages, regen.page_indices, regen.kv_transfer_info);
  EXPECT_TRUE(verify_pattern(*cache, kSeed, pages, 0, kTokens).ok());
}

TEST(ShmMapped, ForgedDescriptorsNamingAnotherFdAreRefusedBeforeAnyByteMoves) {
  const KVLayout l = testing::small_layout();
  MappedOwner owner(l, "--private", true);
  const auto pages = spread_pages(owner.seq.page_indices.size(), l.num_pages);
  struct Case {
    const char* name;
    std::function<void(ShmKVTransferInfo&)> edit;
    StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      // The owner's stdout: a pipe.
      {"a pipe", [](auto& i) { i.fd = 1; }, StatusCode::kStaleDescriptor,
       "is not the cache's memfd"},
      {"an fd the owner does not have", [](auto& i) { i.fd = 900000; }, StatusCode::kNotFound,
       "900000"},
      {"its stdin", [](auto& i) { i.fd = 0; }, StatusCode::kStaleDescriptor,
       "is not the cache's memfd"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto cache = sentinel_cache(l);
    auto m = shm_manager(cache);
    const KVTransferInfo bad = forged(owner.seq, c.edit);
    expect_error([&] { m->sync_retrieve(0, kTokens, pages, owner.seq.page_indices, bad); }, c.code,
                 {c.needle});
    EXPECT_EQ(testing::bytes_written_outside(*cache, l, {}, kSentinel), 0u);
  }
  // Not naming the memfd at all reads the same bytes by cross-memory attach.
  auto cache = sentinel_cache(l);
  const std::size_t before = mapped_owner_files();
  shm_manager(cache)->sync_retrieve(0, kTokens, pages, owner.seq.page_indices,
                                    forged(owner.seq, [](auto& i) { i.backed = false; }));
  EXPECT_TRUE(verify_pattern(*cache, kSeed, pages, 0, kTokens).ok());
  EXPECT_EQ(mapped_owner_files(), before);
}

TEST(ShmMapped, TheOwnersBytesAndAddressesStayItsOwn) {
  // In this process: a private cache 1 KiB into its mapping, filled, then
  // served with map_private. Its pointers and bytes are what they were, its
  // whole pages are the memfd's, the partial ones still private.
  const KVLayout l = testing::small_layout();
  const std::size_t bytes = l.total_bytes() + 1024 + 4096;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* data = static_cast<std::byte*>(p) + 1024;
  struct Borrowed final : KVMemory {
    Borrowed(std::byte* d, std::size_t n) : d_(d), n_(n) {}
    std::byte* data() const noexcept override { return d_; }
    std::size_t size() const noexcept override { return n_; }
    MemoryKind kind() const noexcept override { return MemoryKind::kHost; }
    std::byte* d_;
    std::size_t n_;
  };
  const std::size_t before = mapped_owner_files();
  {
    auto cache = std::make_shared<KVCache>(l, std::make_unique<Borrowed>(data, l.total_bytes()));
    std::vector<std::uint32_t> all(l.num_pages);
    for (std::uint32_t i = 0; i < l.num_pages; ++i) all[i] = i;
    fill_pattern(*cache, kSeed, all, 0, kTokens);
    EngineOptions o;
    o.extra["shm_map_private"] = "on";
    {
      KVTransferManager m(TransferEngineInfo{"owner", "", "shm", o}, cache);
      EXPECT_EQ(cache->base(), data);
      EXPECT_TRUE(verify_pattern(*cache, kSeed, all, 0, kTokens).ok());
      // The whole pages (and the memfd's header page) are the memfd's now.
      EXPECT_GE(mapped_owner_files(), before + 1);
      // Written through the application's pointers: the same bytes.
      fill_pattern(*cache, 9, all, 0, kTokens);
      EXPECT_TRUE(verify_pattern(*cache, 9, all, 0, kTokens).ok());
    }
    // The engine gone, the memory stays the application's.
    EXPECT_TRUE(verify_pattern(*cache, 9, all, 0, kTokens).ok());
  }
  ::munmap(p, bytes);
  EXPECT_EQ(mapped_owner_files(), before);
}

TEST(ShmMapped, TheOptionTakesOnOrOffAndNamesAnyOtherValue) {
  EngineOptions o;
  o.extra["shm_map_private"] = "yes";
  expect_error([&] { ShmEngineOptions::parse(o); }, StatusCode::kInvalidArgument,
               {"shm_map_private 'yes'", "on, off"});
  o.extra["shm_map_private"] = "off";
  EXPECT_FALSE(ShmEngineOptions::parse(o).map_private);
  o.extra["shm_map_privat"] = "on";
  expect_error([&] { ShmEngineOptions::parse(o); }, StatusCode::kInvalidArgument,
               {"shm_map_privat", "shm_map_private"});
}

}  // namespace
}  // namespace mstar::kv
