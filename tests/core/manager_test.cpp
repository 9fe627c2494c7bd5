// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv {
namespace {

std::shared_ptr<KVCache> cache() {
  return KVCache::create_host(testing::make_layout(2, 8, 4, 1, 8));
}

TEST(LocalOnlyEngine, EmptyInfoNoFutureForNothingErrorForSomething) {
  LocalOnlyKVTransferEngine e;
  EXPECT_TRUE(e.get_kv_transfer_info().empty());
  EXPECT_FALSE(e.read_batched_async({}, {}).has_value());
  std::vector<KVReadInfo> one{{0, 0, 0, 0, 4}};
  try {
    e.read_batched_async({}, one);
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("1 reads given"), std::string::npos);
  }
  e.shutdown();
}

TEST(KVTransferManager, WithoutInfoIsLocalOnly) {
  KVTransferManager m(std::nullopt, cache());
  EXPECT_TRUE(m.get_kv_transfer_info().empty());
  const std::vector<std::uint32_t> pages = {0, 1};
  EXPECT_FALSE(m.start_async_retrieve(3, 3, pages, pages, {}).has_value());
  EXPECT_EQ(m.sync_retrieve(3, 3, pages, pages, {}), 0u);
  EXPECT_THROW(m.start_async_retrieve(0, 8, pages, pages, {}), Error);
  // Planning errors come first, naming the value.
  try {
    m.start_async_retrieve(0, 9, pages, pages, {});
    FAIL();
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("local page table has 2 entries"), std::string::npos);
  }
  m.cleanup();
  m.cleanup();  // idempotent
}

// start_len == end_len validates first (manager.hpp), then returns nothing.
TEST(KVTransferManager, AroundAGivenEngineNeedsACacheAnEngineAndAPositiveTimeout) {
  const std::shared_ptr<KVCache> c = cache();
  auto code_of = [](auto&& fn) {
    try {
      fn();
    } catch (const Error& e) {
      return e.code();
    }
    return StatusCode::kOk;
  };
  EXPECT_EQ(
      code_of([&] { KVTransferManager m(nullptr, std::make_unique<LocalOnlyKVTransferEngine>()); }),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] { KVTransferManager m(c, nullptr); }), StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              KVTransferManager m(c, std::make_unique<LocalOnlyKVTransferEngine>(),
                                  std::chrono::milliseconds{0});
            }),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code_of([&] {
              KVTransferManager m(c, std::make_unique<LocalOnlyKVTransferEngine>(),
                                  std::chrono::milliseconds{250});
            }),
            StatusCode::kOk);
}

TEST(KVTransferManager, EmptyRangeIsValidatedFirst) {
  KVTransferManager m(std::nullopt, cache());
  const std::vector<std::uint32_t> good = {0, 1};
  const std::vector<std::uint32_t> bad = {0, 99};
  auto message = [&](std::uint64_t at, std::span<const std::uint32_t> pages,
                     const KVTransferInfo& info) {
    try {
      m.start_async_retrieve(at, at, pages, pages, info);
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), StatusCode::kInvalidArgument) << err.what();
      return std::string(err.what());
    }
    return std::string("no error");
  };
  // Page size 4: token 6 lies in table entry 1.
  EXPECT_NE(message(6, bad, {}).find("local page 99 (table entry 1) out of range [0, 8)"),
            std::string::npos);
  EXPECT_NE(message(9, good, {}).find("local page table has 2 entries"), std::string::npos);
  // A descriptor the local-only engine cannot read, as for a non-empty pull.
  KVTransferInfo shm{"shm", {1, 2, 3}, 0};
  EXPECT_NE(message(4, good, shm).find("cannot read a 'shm' descriptor"), std::string::npos);
  EXPECT_NE(message(0, {}, shm).find("cannot read a 'shm' descriptor"), std::string::npos);
  EXPECT_FALSE(m.start_async_retrieve(8, 8, good, good, {}).has_value());
  EXPECT_FALSE(m.start_async_retrieve(0, 0, {}, {}, {}).has_value());
}

// Every engine refuses an unknown key of its own prefix, naming the known
// ones, and ignores other engines' keys and the shared ones (only
// Mooncake and UCX did).
TEST(KVTransferManager, EveryEngineRejectsUnknownKeysOfItsPrefix) {
  const auto built = built_engines();
  auto has = [&](const std::string& n) {
    return std::find(built.begin(), built.end(), n) != built.end();
  };
  struct Case {
    std::string engine, typo, known;
    MemoryKind kind;
  };
  const std::vector<Case> cases = {
      {"shm", "shm_max_wokers", "known shm_* options: shm_map_private", MemoryKind::kSharedHost},
      {"cuda_ipc", "cuda_ipc_bach",
       "known cuda_ipc_* options: cuda_ipc_batch, cuda_ipc_check_owner_pid", MemoryKind::kHost},
      {"ucx", "ucx_mdoe",
       "(known: ucx_mode, ucx_am_proto, ucx_chunk_bytes, ucx_progress, ucx_staging, "
       "ucx_emulated_gets, ucx_peer_timeout_ms)",
       MemoryKind::kHost},
  };
  const std::map<std::string, std::string> others = {
      {"auth_token", "a-shared-secret-of-24b"},
      {"shm_x", "1"},
      {"cuda_ipc_x", "1"},
      {"ucx_x", "1"},
      {"mooncake_x", "1"},
  };
  for (const Case& c : cases) {
    if (!has(c.engine)) continue;
    SCOPED_TRACE(c.engine);
    auto host = cache();
    auto target = c.kind == MemoryKind::kHost ? host : make_kv_cache(host->layout(), c.kind);
    TransferEngineInfo info{"me", "", c.engine, {}};
    info.options.extra = {{c.typo, "1"}};
    try {
      KVTransferManager m(info, target);
      FAIL() << "accepted " << c.typo;
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), StatusCode::kInvalidArgument) << err.what();
      EXPECT_NE(std::string(err.what()).find("'" + c.typo + "'"), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find(c.known), std::string::npos) << err.what();
    }
    // Keys of every other engine, and the shared auth_token, are not this
    // engine's: whatever the constructor says next, it is not about them.
    info.options.extra.clear();
    for (const auto& [k, v] : others) {
      if (k.rfind(c.engine + "_", 0) != 0) info.options.extra[k] = v;
    }
    try {
      KVTransferManager m(info, target);
    } catch (const Error& err) {
      // cuda_ipc on a host cache: refused for the memory, not for a key.
      EXPECT_EQ(std::string(err.what()).find("option"), std::string::npos) << err.what();
      EXPECT_NE(std::string(err.what()).find("device cache"), std::string::npos) << err.what();
    }
  }
}

TEST(KVTransferManager, FactoryNamesUnknownAndUnbuiltEngines) {
  TransferEngineInfo info{"me", "127.0.0.1:1", "carrier-pigeon", {}};
  try {
    KVTransferManager m(info, cache());
    FAIL();
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(err.what()).find("unknown transfer engine 'carrier-pigeon'"),
              std::string::npos);
  }
  info.transfer_engine = "local";
  EXPECT_NO_THROW(KVTransferManager(info, cache()));
  const auto built = built_engines();
  EXPECT_EQ(built.front(), "local");
  for (const char* name : {"shm", "ucx", "mooncake", "cuda_ipc"}) {
    if (std::find(built.begin(), built.end(), name) != built.end()) continue;
    info.transfer_engine = name;
    try {
      KVTransferManager m(info, cache());
      FAIL() << name;
    } catch (const Error& err) {
      EXPECT_EQ(err.code(), StatusCode::kUnavailable) << err.what();
    }
  }
}

}  // namespace
}  // namespace mstar::kv
