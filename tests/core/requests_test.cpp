// Copyright mstar-kv authors.
//
// Request-scoped descriptors (requests.hpp): the descriptor's codec, the
// manager's request registry (which epochs it stamps when), and pulls of
// such descriptors over the real shm engine (an owner's shared cache read by
// a reader's manager in this process; tests/python cover two processes).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using testing::iota_pages;
using testing::small_layout;

RequestPublication pub(std::string request, std::string label, std::vector<std::uint32_t> pages,
                       std::uint64_t seq_len, std::optional<std::int64_t> generation = {}) {
  return {std::move(request), std::move(label), std::move(pages), seq_len, generation};
}

StatusCode code_of(const std::function<void()>& fn, std::string* what = nullptr) {
  try {
    fn();
  } catch (const Error& e) {
    if (what) *what = e.what();
    return e.code();
  }
  return StatusCode::kOk;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// An owner (shm over a shared cache) and a reader (shm over a private one).
struct Pair {
  std::shared_ptr<KVCache> owner_cache = make_kv_cache(small_layout(16), MemoryKind::kSharedHost);
  std::shared_ptr<KVCache> reader_cache = make_kv_cache(small_layout(16), MemoryKind::kHost);
  KVTransferManager owner{TransferEngineInfo{"prefill", "", "shm", {}}, owner_cache};
  KVTransferManager reader{TransferEngineInfo{"decode", "", "shm", {}}, reader_cache};

  std::uint64_t epoch(std::uint32_t page) const { return owner_cache->epochs().load(page); }
};

TEST(RequestDescriptor, RoundTripsAndRefusesCorruptBytesByField) {
  RequestKVTransferInfo d;
  d.resource_key = "kv";
  d.request_id = "req-1";
  d.label = "cfg_text";
  d.reset_generation = -3;
  d.seq_len = 40;
  d.page_size = 16;
  d.page_indices = {7, 2, 9};
  d.page_epochs = {5, 5, 11};
  d.owner = std::string(32, 'a');
  d.cache = KVTransferInfo{"shm", {1, 2, 3}, 0};
  const auto bytes = d.encode();
  EXPECT_EQ(RequestKVTransferInfo::decode(bytes), d);
  EXPECT_EQ(d.with_epoch(11).epoch, 11u);
  EXPECT_EQ(d.with_epoch(11).engine, "shm");

  std::string what;
  for (std::size_t i = 0; i < bytes.size(); i += 7) {
    auto bad = bytes;
    bad[i] ^= 0x40;
    EXPECT_EQ(code_of([&] { RequestKVTransferInfo::decode(bad); }), StatusCode::kCorruptDescriptor)
        << "byte " << i;
  }
  auto cut = bytes;
  cut.resize(cut.size() - 9);
  EXPECT_EQ(code_of([&] { RequestKVTransferInfo::decode(cut); }), StatusCode::kCorruptDescriptor);
  // Well-framed but inconsistent: each names its field.
  auto decode_of = [&](RequestKVTransferInfo x) {
    what.clear();
    return code_of([&] { RequestKVTransferInfo::decode(x.encode()); }, &what);
  };
  RequestKVTransferInfo x = d;
  x.page_epochs = {5, 0, 11};
  EXPECT_EQ(decode_of(x), StatusCode::kCorruptDescriptor);
  EXPECT_TRUE(has(what, "page_epochs")) << what;
  x = d;
  x.seq_len = 49;
  EXPECT_EQ(decode_of(x), StatusCode::kCorruptDescriptor);
  EXPECT_TRUE(has(what, "seq_len")) << what;
  x = d;
  x.owner = "not-hex";
  EXPECT_EQ(decode_of(x), StatusCode::kCorruptDescriptor);
  EXPECT_TRUE(has(what, "owner")) << what;
  x = d;
  x.cache = {};
  EXPECT_EQ(decode_of(x), StatusCode::kCorruptDescriptor);
  EXPECT_TRUE(has(what, "cache")) << what;
  x = d;
  x.cache.epoch = 4;
  EXPECT_EQ(decode_of(x), StatusCode::kCorruptDescriptor);
  EXPECT_TRUE(has(what, "cache")) << what;
  // Not a request descriptor at all.
  EXPECT_EQ(code_of([&] { RequestKVTransferInfo::decode(d.cache.encode()); }),
            StatusCode::kCorruptDescriptor);
}

TEST(ManagerRequests, LocalOnlyPublishesNothingAndStampsNothing) {
  auto c = make_kv_cache(small_layout(16), MemoryKind::kSharedHost);
  KVTransferManager local(std::nullopt, c);
  EXPECT_FALSE(local.get_kv_transfer_info(pub("r", "main", {0, 1}, 20)).has_value());
  KVTransferManager kept(TransferEngineInfo{"w", "", "shm", {}}, c,
                         ResourceScope{"local_kv", false});
  EXPECT_TRUE(kept.get_kv_transfer_info().empty());
  EXPECT_FALSE(kept.get_kv_transfer_info(pub("r", "main", {0, 1}, 20)).has_value());
  EXPECT_EQ(c->epochs().load(0), 0u);
  EXPECT_EQ(kept.scope().resource_key, "local_kv");
}

TEST(ManagerRequests, EqualPublicationsGiveEqualDescriptorsOfOneManagerOnly) {
  Pair p;
  auto a = p.owner.get_kv_transfer_info(pub("r", "main", {3, 4}, 20, 0));
  auto b = p.owner.get_kv_transfer_info(pub("r", "main", {3, 4}, 20, 0));
  ASSERT_TRUE(a && b);
  EXPECT_EQ(*a, *b);
  EXPECT_EQ(a->encode(), b->encode());
  EXPECT_EQ(a->resource_key, "kv");
  EXPECT_EQ(a->page_size, 16u);
  EXPECT_EQ(a->cache, p.owner.get_kv_transfer_info());
  KVTransferManager other{TransferEngineInfo{"prefill", "", "shm", {}}, p.owner_cache};
  auto c = other.get_kv_transfer_info(pub("r", "main", {3, 4}, 20, 0));
  ASSERT_TRUE(c);
  EXPECT_NE(c->owner, a->owner);
  EXPECT_TRUE(p.owner.owns_transfer_info(*a, "r", "main"));
  EXPECT_FALSE(p.owner.owns_transfer_info(*a, "r", "cfg_text"));
  EXPECT_FALSE(p.owner.owns_transfer_info(*c, "r", "main"));
  EXPECT_FALSE(other.owns_transfer_info(*a, "r", "main"));
}

TEST(ManagerRequests, EpochsFollowPublicationsGenerationsAndRemoval) {
  Pair p;
  auto first = *p.owner.get_kv_transfer_info(pub("r", "main", {3, 4}, 20, 0));
  const std::uint64_t e = p.epoch(3);
  EXPECT_NE(e, 0u);
  EXPECT_EQ(p.epoch(4), e);
  EXPECT_EQ(first.page_epochs, (std::vector<std::uint64_t>{e, e}));
  EXPECT_EQ(p.epoch(5), 0u);  // not published: untouched

  // The same generation, appended: kept pages keep their epoch, the new one
  // gets a fresh epoch (it was free).
  auto appended = *p.owner.get_kv_transfer_info(pub("r", "main", {3, 4, 5}, 40, 0));
  EXPECT_EQ(p.epoch(3), e);
  EXPECT_NE(p.epoch(5), 0u);
  EXPECT_NE(p.epoch(5), e);
  EXPECT_NE(appended, first);

  // Another generation: every page this publication alone holds is fresh.
  auto reset = *p.owner.get_kv_transfer_info(pub("r", "main", {3, 4}, 10, 1));
  EXPECT_NE(p.epoch(3), e);
  EXPECT_EQ(p.epoch(4), p.epoch(3));
  EXPECT_EQ(p.epoch(5), 0u);  // dropped: released
  EXPECT_EQ(reset.reset_generation, 1);

  // A second label of the request, then removal releases both.
  p.owner.get_kv_transfer_info(pub("r", "cfg_text", {8}, 3, 1));
  EXPECT_NE(p.epoch(8), 0u);
  EXPECT_TRUE(p.owner.owns_transfer_info(reset, "r", "main"));
  p.owner.remove_request("r");
  for (std::uint32_t page : {3u, 4u, 8u}) EXPECT_EQ(p.epoch(page), 0u) << page;
  EXPECT_FALSE(p.owner.owns_transfer_info(reset, "r", "main"));
  p.owner.remove_request("r");           // again: nothing
  p.owner.remove_request("never-seen");  // unknown: nothing
}

TEST(ManagerRequests, SharedPagesKeepTheirEpochUntilTheLastHolderGoes) {
  Pair p;
  auto a = *p.owner.get_kv_transfer_info(pub("a", "main", {1, 2}, 32));
  auto b = *p.owner.get_kv_transfer_info(pub("b", "main", {1, 6}, 20));
  EXPECT_EQ(b.page_epochs[0], a.page_epochs[0]);  // shared: adopted
  EXPECT_NE(b.page_epochs[1], a.page_epochs[0]);  // free: fresh
  // A new generation of b does not re-stamp the page a still holds.
  auto b1 = *p.owner.get_kv_transfer_info(pub("b", "main", {1, 6}, 20, 1));
  EXPECT_EQ(b1.page_epochs[0], a.page_epochs[0]);
  EXPECT_NE(b1.page_epochs[1], b.page_epochs[1]);
  p.owner.remove_request("a");
  EXPECT_EQ(p.epoch(2), 0u);
  EXPECT_EQ(p.epoch(1), a.page_epochs[0]);  // b still holds it
  p.owner.remove_request("b");
  EXPECT_EQ(p.epoch(1), 0u);
  EXPECT_EQ(p.epoch(6), 0u);
}

TEST(ManagerRequests, BadPublicationsNameTheValueAndChangeNothing) {
  Pair p;
  std::string what;
  auto publish = [&](RequestPublication x) {
    what.clear();
    return code_of([&] { p.owner.get_kv_transfer_info(x); }, &what);
  };
  EXPECT_EQ(publish(pub("r", "main", {3, 16}, 20)), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "page_indices[1] = 16 out of range [0, 16)")) << what;
  EXPECT_EQ(publish(pub("r", "main", {3, 4, 3}, 20)), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "page_indices[2] = 3 is also page_indices[0]")) << what;
  EXPECT_EQ(publish(pub("r", "main", {3, 4}, 33)), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "seq_len 33 beyond the 32 tokens")) << what;
  EXPECT_EQ(publish(pub(std::string(5000, 'x'), "main", {3}, 1)), StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "request_id of 5000 bytes")) << what;
  EXPECT_EQ(p.epoch(3), 0u);
  EXPECT_EQ(code_of([&] {
              KVTransferManager m(TransferEngineInfo{"w", "", "shm", {}}, p.owner_cache,
                                  ResourceScope{std::string(5000, 'k'), true});
            }),
            StatusCode::kInvalidArgument);
}

TEST(ManagerRequests, PullReadsOnlyThePublishedTokensWithTheirEpochs) {
  Pair p;
  const auto owner_pages = std::vector<std::uint32_t>{9, 2, 5};
  fill_pattern(*p.owner_cache, 42, owner_pages, 0, 40);
  auto d = *p.owner.get_kv_transfer_info(pub("r", "main", owner_pages, 40, 0));
  const auto local = std::vector<std::uint32_t>{0, 1, 2};
  auto f = p.reader.start_async_retrieve_request(16, 40, local, owner_pages, d);
  ASSERT_TRUE(f);
  EXPECT_GT(f->get(), 0u);
  // Tokens [16, 40) arrived; [0, 16) (local page 0) was not asked for.
  EXPECT_TRUE(verify_pattern(*p.reader_cache, 42, local, 16, 40).ok());
  const auto block = p.reader_cache->block(0, KV::kKey, 0);
  EXPECT_TRUE(
      std::all_of(block.begin(), block.end(), [](std::byte b) { return b == std::byte{0}; }));
  // Empty range: validated, nothing.
  EXPECT_FALSE(p.reader.start_async_retrieve_request(8, 8, local, owner_pages, d).has_value());
  // The descriptor's own pages only, within its tokens, under this key.
  std::string what;
  EXPECT_EQ(
      code_of([&] { p.reader.start_async_retrieve_request(0, 41, local, owner_pages, d); }, &what),
      StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "beyond the 40 tokens request 'r' label 'main' published")) << what;
  const auto wrong = std::vector<std::uint32_t>{9, 3, 5};
  EXPECT_EQ(code_of([&] { p.reader.start_async_retrieve_request(0, 40, local, wrong, d); }, &what),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(
      has(what, "remote_page_indices[1] = 3, but request 'r' label 'main' published page 2"))
      << what;
  std::vector<KVReadInfo> foreign{{0, 0, 7, 0, 16}};
  EXPECT_EQ(code_of([&] { p.reader.read_request_async(d, foreign); }, &what),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "remote page 7 is not one of the 3 pages")) << what;
  std::vector<KVReadInfo> past{{0, 0, 5, 0, 16}};  // page 5 holds tokens [32, 40)
  EXPECT_EQ(code_of([&] { p.reader.read_request_async(d, past); }, &what),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "reach token 48, beyond the 40 tokens")) << what;
  KVTransferManager talker(TransferEngineInfo{"decode", "", "shm", {}}, p.reader_cache,
                           ResourceScope{"talker_kv", true});
  EXPECT_EQ(
      code_of([&] { talker.start_async_retrieve_request(0, 40, local, owner_pages, d); }, &what),
      StatusCode::kInvalidArgument);
  EXPECT_TRUE(has(what, "resource 'kv'")) << what;
  EXPECT_TRUE(has(what, "manager of resource 'talker_kv'")) << what;
}

TEST(ManagerRequests, PagesOfTwoEpochsAreReadInOnePull) {
  Pair p;
  fill_pattern(*p.owner_cache, 7, std::vector<std::uint32_t>{1, 6}, 0, 32);
  p.owner.get_kv_transfer_info(pub("a", "main", {1}, 16));
  auto b = *p.owner.get_kv_transfer_info(pub("b", "main", {1, 6}, 32));
  ASSERT_NE(b.page_epochs[0], b.page_epochs[1]);
  const auto local = std::vector<std::uint32_t>{3, 4};
  auto f = p.reader.start_async_retrieve_request(0, 32, local, b.page_indices, b);
  ASSERT_TRUE(f);
  EXPECT_EQ(f->get(), 2 * p.reader_cache->layout().block_bytes() * 2 * 4);
  EXPECT_TRUE(verify_pattern(*p.reader_cache, 7, local, 0, 32).ok());
}

TEST(ManagerRequests, ReadsOfRemovedReplacedOrCleanedUpPublicationsFailStale) {
  Pair p;
  const auto pages = std::vector<std::uint32_t>{2, 3};
  const auto local = std::vector<std::uint32_t>{0, 1};
  // Found before the copy, the engine refuses the read; during it, the
  // future fails: either way the code.
  auto stale = [&](const RequestKVTransferInfo& d) {
    try {
      auto f = p.reader.start_async_retrieve_request(0, 20, local, pages, d);
      if (!f) return StatusCode::kOk;
      f->wait();
      return f->status().code();
    } catch (const Error& e) {
      return e.code();
    }
  };
  auto d0 = *p.owner.get_kv_transfer_info(pub("r", "main", pages, 20, 0));
  EXPECT_EQ(stale(d0), StatusCode::kOk);
  auto d1 = *p.owner.get_kv_transfer_info(pub("r", "main", pages, 20, 1));
  EXPECT_EQ(stale(d0), StatusCode::kStaleDescriptor);  // a replaced generation
  EXPECT_EQ(stale(d1), StatusCode::kOk);
  p.owner.remove_request("r");
  EXPECT_EQ(stale(d1), StatusCode::kStaleDescriptor);  // a removed request
  // Published again: the old descriptors stay stale.
  auto d2 = *p.owner.get_kv_transfer_info(pub("r", "main", pages, 20, 1));
  EXPECT_NE(d2, d1);
  EXPECT_EQ(stale(d1), StatusCode::kStaleDescriptor);
  EXPECT_EQ(stale(d2), StatusCode::kOk);
  p.owner.cleanup();
  EXPECT_EQ(p.epoch(2), 0u);
  EXPECT_NE(stale(d2), StatusCode::kOk);  // a cleaned-up manager
  EXPECT_EQ(code_of([&] { p.owner.remove_request("r"); }), StatusCode::kShutdown);
}

}  // namespace
}  // namespace mstar::kv
