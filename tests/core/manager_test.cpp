// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <algorithm>

#include "mstar/kv/kv.hpp"

namespace mstar::kv {
namespace {

std::shared_ptr<KVCache> cache() {
  KVLayout l;
  l.num_layers = 2;
  l.num_pages = 8;
  l.page_size = 4;
  l.num_kv_heads = 1;
  l.head_dim = 8;
  return KVCache::create_host(l);
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
