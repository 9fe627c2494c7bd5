// Copyright mstar-kv authors.
//
// The factory's engine table (factory.hpp) says what the factory does: the
// built rows are built_engines(), every built engine that needs nothing
// beyond its build is made from a cache of the memory its traits name and
// moves a page of it, and a name that is no engine is refused naming the
// known ones.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <string>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using testing::small_layout;

TEST(EngineTable, BuiltRowsAreTheBuiltEngines) {
  std::vector<std::string> built;
  std::set<std::string> names;
  std::set<std::string> setups;
  for (const EngineTraits& t : engine_table()) {
    EXPECT_TRUE(names.insert(t.name).second) << "engine '" << t.name << "' listed twice";
    ASSERT_FALSE(t.loopback.empty()) << t.name << " has no loopback setup";
    for (const LoopbackSetup& s : t.loopback) {
      EXPECT_TRUE(setups.insert(s.name).second) << "setup '" << s.name << "' listed twice";
    }
    if (t.built) built.push_back(t.name);
  }
  EXPECT_EQ(built, built_engines());
  ASSERT_FALSE(built.empty());
  EXPECT_EQ(built.front(), "local");
  EXPECT_FALSE(engine_traits("").crosses_processes);  // "" is local
}

TEST(EngineTable, AnUnknownNameIsRefusedNamingTheKnownOnes) {
  EXPECT_FALSE(find_engine("carrier-pigeon").has_value());
  try {
    engine_traits("carrier-pigeon");
    FAIL() << "engine_traits accepted an unknown name";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    const std::string what = e.what();
    EXPECT_NE(what.find("carrier-pigeon"), std::string::npos) << what;
    for (const EngineTraits& t : engine_table()) {
      EXPECT_NE(what.find(t.name), std::string::npos) << what;
    }
  }
  try {
    auto cache = make_kv_cache(small_layout(4), MemoryKind::kHost);
    make_engine(TransferEngineInfo{"x", "", "carrier-pigeon", {}}, cache);
    FAIL() << "make_engine accepted an unknown name";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("known: local, shm"), std::string::npos) << e.what();
  }
}

// Owner and reader in one process, each cache in the memory the traits name:
// the reader gets the owner's bytes.
TEST(EngineTable, EachSelfContainedEngineMovesAPageInTheMemoryItsTraitsName) {
  int moved = 0;
  for (const EngineTraits& t : engine_table()) {
    if (!t.built || !t.crosses_processes || !t.self_contained) continue;
    SCOPED_TRACE(t.name);
    for (const auto& [k, v] : t.loopback.front().env) ::setenv(k.c_str(), v.c_str(), 1);
    const KVLayout l = small_layout(4);
    auto src = make_kv_cache(l, t.memory);
    auto dst = make_kv_cache(l, t.reader_memory);
    ASSERT_EQ(src->memory_kind(), t.memory);
    const std::vector<std::uint32_t> src_pages{0, 1, 2, 3};
    const std::vector<std::uint32_t> dst_pages{3, 2, 1, 0};
    fill_pattern(*src, 7, src_pages, 0, 64);
    EngineOptions o;
    o.timeout = std::chrono::milliseconds(5000);
    KVTransferManager owner(TransferEngineInfo{"owner", "", t.name, o}, src);
    KVTransferManager reader(TransferEngineInfo{"reader", "", t.name, o}, dst);
    const KVTransferInfo info = owner.get_kv_transfer_info();
    EXPECT_EQ(info.engine, t.name);
    EXPECT_EQ(reader.sync_retrieve(0, 64, dst_pages, src_pages, info), l.total_bytes());
    const VerifyResult r = verify_pattern(*dst, 7, dst_pages, 0, 64);
    EXPECT_TRUE(r.ok()) << r.first_mismatch;
    EXPECT_EQ(r.bytes_checked, l.total_bytes());
    for (const auto& [k, v] : t.loopback.front().env) ::unsetenv(k.c_str());
    ++moved;
  }
  EXPECT_GT(moved, 0) << "no self-contained engine is built";
}

// Caches of one region per layer: every engine either moves them (the
// conformance setups shm-cma-layers and ucx-tcp-layers run every case) or
// refuses one by name, with the way out, before anything else happens:
// the C++ Mooncake engine (the wheel engine serves them) and cuda_ipc (whose
// device caches a host test cannot split; its check is the same one).
TEST(EngineTable, EnginesWithoutLayerRegionsRefuseThemByName) {
  const auto built = built_engines();
  if (std::find(built.begin(), built.end(), "mooncake") == built.end()) {
    GTEST_SKIP() << "the mooncake engine is not built";
  }
  auto cache = KVCache::create_host_layers(small_layout(4));
  testing::expect_error(
      [&] {
        make_engine(TransferEngineInfo{"x", "", "mooncake", {}}, cache);
      },
      StatusCode::kNotSupported, {"C++ Mooncake engine", "4 (one per layer)", "wheel engine"});
  // The local engine needs no memory of its own: any cache.
  EXPECT_NO_THROW(make_engine(std::nullopt, cache));
}

}  // namespace
}  // namespace mstar::kv
