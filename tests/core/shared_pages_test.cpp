// Copyright mstar-kv authors.
//
// Shared pages (prefix caching, docs/correctness.md): two sequences of one
// KVCachePool hold the same pages (KVCachePool::adopt with allow_shared),
// both are published, and a reader's manager pulls each over the real shm
// engine (an owner's shared cache read by a reader in this process): each
// page is read with its own epoch; one sequence's done never makes the
// other's pull fail or read wrong bytes; pages freed by the last holder and
// reused fail the old descriptors as stale.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/layouts.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using testing::small_layout;

struct Owner {
  std::shared_ptr<KVCache> owner_cache = make_kv_cache(small_layout(16), MemoryKind::kSharedHost);
  std::shared_ptr<KVCache> reader_cache = make_kv_cache(small_layout(16), MemoryKind::kHost);
  KVTransferManager owner{TransferEngineInfo{"prefill", "", "shm", {}}, owner_cache};
  KVTransferManager reader{TransferEngineInfo{"decode", "", "shm", {}}, reader_cache};
  KVCachePool pool{owner_cache, owner.get_kv_transfer_info()};

  // Pulls every token of `seq` into `local`; the code of the pull (a read
  // refused before the copy throws, one caught during it fails its future).
  StatusCode pull(const SequenceInfo& seq, const std::vector<std::uint32_t>& local,
                  std::uint64_t* bytes = nullptr) {
    try {
      auto f = reader.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                           seq.kv_transfer_info);
      if (!f) return StatusCode::kOk;
      f->wait();
      if (bytes != nullptr) *bytes = f->bytes();
      return f->status().code();
    } catch (const Error& e) {
      return e.code();
    }
  }
  bool holds(std::uint64_t seed, const std::vector<std::uint32_t>& local, std::uint64_t tokens) {
    const VerifyResult v = verify_pattern(*reader_cache, seed, local, 0, tokens);
    EXPECT_TRUE(v.ok()) << v.first_mismatch;
    return v.ok();
  }
};

// A shares its 2 full pages with B (B's prefix: the same tokens, so the
// same pattern), B has one page of its own.
constexpr std::uint64_t kSeed = 7;
const std::vector<std::uint32_t> kPagesA = {1, 2};
const std::vector<std::uint32_t> kPagesB = {1, 2, 6};

TEST(SharedPages, BothPublicationsPullByteExactAndOutliveEachOthersDone) {
  Owner o;
  fill_pattern(*o.owner_cache, kSeed, kPagesB, 0, 40);
  o.pool.adopt(1, 32, kPagesA);
  o.pool.adopt(2, 40, kPagesB, /*allow_shared=*/true);
  const SequenceInfo a = o.pool.publish(1);
  const SequenceInfo b = o.pool.publish(2);
  const std::uint64_t ea = a.kv_transfer_info.epoch;
  const std::uint64_t eb = b.kv_transfer_info.epoch;
  ASSERT_NE(ea, eb);
  EXPECT_TRUE(a.kv_transfer_info.page_epochs.empty());
  EXPECT_EQ(b.kv_transfer_info.page_epochs, (std::vector<PageEpoch>{{1, ea}, {2, ea}}));
  EXPECT_EQ(o.owner_cache->epochs().load(6), eb);
  EXPECT_EQ(o.pool.holders(1), 2u);
  EXPECT_EQ(o.pool.holders(6), 1u);
  // The reader gets B from the wire.
  const SequenceInfo b_wire = SequenceInfo::decode(b.encode());
  ASSERT_EQ(b_wire, b);

  std::uint64_t bytes = 0;
  ASSERT_EQ(o.pull(a, {0, 3}, &bytes), StatusCode::kOk);
  EXPECT_TRUE(o.holds(kSeed, {0, 3}, 32));
  ASSERT_EQ(o.pull(b_wire, {4, 5, 7}, &bytes), StatusCode::kOk);
  // 40 tokens of (k, v) x 4 layers: every token once, none twice.
  const std::uint64_t token_bytes = o.reader_cache->layout().block_bytes() / 16;
  EXPECT_EQ(bytes, 40 * token_bytes * 2 * 4);
  EXPECT_TRUE(o.holds(kSeed, {4, 5, 7}, 40));
  // The same pull through the synchronous form.
  EXPECT_GT(o.reader.sync_retrieve(0, 40, std::vector<std::uint32_t>{8, 9, 10}, b.page_indices,
                                   b.kv_transfer_info),
            0u);
  EXPECT_TRUE(o.holds(kSeed, {8, 9, 10}, 40));

  // A's done leaves the shared pages to B with A's epoch: B pulls every byte.
  EXPECT_TRUE(o.pool.done(1, ea));
  EXPECT_EQ(o.pool.holders(1), 1u);
  EXPECT_EQ(o.owner_cache->epochs().load(1), ea);
  ASSERT_EQ(o.pull(b_wire, {11, 12, 13}), StatusCode::kOk);
  EXPECT_TRUE(o.holds(kSeed, {11, 12, 13}, 40));

  // B's done frees them all: epoch 0, back on the free list.
  EXPECT_TRUE(o.pool.done(2, eb));
  for (std::uint32_t p : kPagesB) {
    EXPECT_EQ(o.pool.holders(p), 0u) << p;
    EXPECT_EQ(o.owner_cache->epochs().load(p), 0u) << p;
  }
  EXPECT_EQ(o.pool.free_page_count(), 16u);
  EXPECT_EQ(o.pull(b_wire, {0, 3, 4}), StatusCode::kStaleDescriptor);

  // A third sequence reuses the pages with other KV: B's and A's old
  // descriptors fail as stale, never read it as theirs.
  o.pool.adopt(3, 40, std::vector<std::uint32_t>{6, 2, 1});
  fill_pattern(*o.owner_cache, 99, std::vector<std::uint32_t>{6, 2, 1}, 0, 40);
  const SequenceInfo c = o.pool.publish(3);
  EXPECT_TRUE(c.kv_transfer_info.page_epochs.empty());
  EXPECT_EQ(o.pull(b_wire, {0, 3, 4}), StatusCode::kStaleDescriptor);
  EXPECT_EQ(o.pull(a, {0, 3}), StatusCode::kStaleDescriptor);
  ASSERT_EQ(o.pull(c, {0, 3, 4}), StatusCode::kOk);
  EXPECT_TRUE(o.holds(99, {0, 3, 4}, 40));
}

// Negative controls: the checks above can fail. A pool that re-stamped the
// shared pages when A went (or a reader that read every page with B's own
// epoch) makes B's pull fail: the engine checks each page's epoch.
TEST(SharedPages, ARestampedSharedPageOrIgnoredExceptionsFailTheRemainingReader) {
  Owner o;
  fill_pattern(*o.owner_cache, kSeed, kPagesB, 0, 40);
  o.pool.adopt(1, 32, kPagesA);
  o.pool.adopt(2, 40, kPagesB, true);
  const SequenceInfo a = o.pool.publish(1);
  const SequenceInfo b = o.pool.publish(2);
  const std::uint64_t ea = a.kv_transfer_info.epoch;

  SequenceInfo ignored = b;
  ignored.kv_transfer_info.page_epochs.clear();
  EXPECT_EQ(o.pull(ignored, {4, 5, 7}), StatusCode::kStaleDescriptor);

  EXPECT_TRUE(o.pool.done(1, ea));
  // The sabotage: what a pool that freed A's pages outright would stamp.
  o.owner_cache->epochs().stamp(kPagesA, 0);
  EXPECT_EQ(o.pull(b, {4, 5, 7}), StatusCode::kStaleDescriptor);
  // Undone, the pull is whole again.
  o.owner_cache->epochs().stamp(kPagesA, ea);
  ASSERT_EQ(o.pull(b, {4, 5, 7}), StatusCode::kOk);
  EXPECT_TRUE(o.holds(kSeed, {4, 5, 7}, 40));
}

// The shard form and a partial range read shared pages by epoch too; a
// handle names one epoch, so open_remote refuses such a descriptor, naming
// why.
TEST(SharedPages, ShardsAndRangesReadByEpochAndHandlesRefuse) {
  Owner o;
  fill_pattern(*o.owner_cache, kSeed, kPagesB, 0, 40);
  o.pool.adopt(1, 32, kPagesA);
  o.pool.adopt(2, 40, kPagesB, true);
  o.pool.publish(1);
  const SequenceInfo b = o.pool.publish(2);

  const std::vector<std::uint32_t> local = {4, 5, 7};
  const RemoteShard shard{b.page_indices, b.kv_transfer_info};
  auto f = o.reader.start_async_retrieve(0, 40, local, std::span<const RemoteShard>(&shard, 1));
  ASSERT_TRUE(f);
  ASSERT_TRUE(f->wait_for(std::chrono::seconds(10)));
  ASSERT_EQ(f->status().code(), StatusCode::kOk) << f->status().message();
  EXPECT_TRUE(o.holds(kSeed, local, 40));

  // Tokens [20, 40): the second shared page and B's own.
  const std::vector<std::uint32_t> tail = {8, 9, 10};
  auto g = o.reader.start_async_retrieve(20, 40, tail, b.page_indices, b.kv_transfer_info);
  ASSERT_TRUE(g);
  EXPECT_GT(g->get(), 0u);
  EXPECT_TRUE(verify_pattern(*o.reader_cache, kSeed, tail, 20, 40).ok());

  try {
    o.reader.open_remote(b.kv_transfer_info);
    ADD_FAILURE() << "open_remote took a descriptor with page_epochs";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("2 pages with epochs of their own"), std::string::npos)
        << e.what();
  }
}

// A stream of B watches and reads the shared pages with A's epoch and its
// own page with B's: the layers A wrote are ready at once, the stream waits
// for B's own page, and the bytes are exact.
TEST(SharedPages, AStreamWaitsForTheNewPagesAndReadsTheSharedOnesByEpoch) {
  Owner o;
  fill_pattern(*o.owner_cache, kSeed, kPagesA, 0, 32);
  o.pool.adopt(1, 32, kPagesA);
  o.pool.publish(1);  // every layer of A's pages ready
  o.pool.adopt(2, 40, kPagesB, true);
  const SequenceInfo b = o.pool.publish(2, 0);
  EXPECT_EQ(o.owner_cache->readiness().load(1), 4u);
  EXPECT_EQ(o.owner_cache->readiness().load(6), 0u);

  const std::vector<std::uint32_t> local = {4, 5, 7};
  StreamOptions opts;
  opts.ready_timeout = std::chrono::milliseconds(10000);
  auto stream =
      o.reader.start_streaming_retrieve(0, 40, local, b.page_indices, b.kv_transfer_info, opts);
  ASSERT_TRUE(stream);
  EXPECT_EQ(stream->wait_for_layer(0, std::chrono::milliseconds(50)).code(),
            StatusCode::kInProgress);  // B's own page has no layer yet
  for (std::uint32_t l = 0; l < 4; ++l) {
    fill_pattern_layers(*o.owner_cache, kSeed, kPagesB, 32, 40, l, l + 1);
    o.pool.mark_layers_ready(2, l + 1);
  }
  const TransferFuture f = stream->future();
  ASSERT_TRUE(f.wait_for(std::chrono::seconds(10)));
  ASSERT_EQ(f.status().code(), StatusCode::kOk) << f.status().message();
  EXPECT_TRUE(o.holds(kSeed, local, 40));

  // The stream's shared pages really are watched with A's epoch: without
  // the exceptions the stream fails stale (negative control).
  SequenceInfo bare = b;
  bare.kv_transfer_info.page_epochs.clear();
  StatusCode code = StatusCode::kOk;
  try {
    auto bad = o.reader.start_streaming_retrieve(0, 40, local, bare.page_indices,
                                                 bare.kv_transfer_info, opts);
    ASSERT_TRUE(bad);
    ASSERT_TRUE(bad->future().wait_for(std::chrono::seconds(10)));
    code = bad->future().status().code();
  } catch (const Error& e) {
    code = e.code();
  }
  EXPECT_EQ(code, StatusCode::kStaleDescriptor);
}

}  // namespace
}  // namespace mstar::kv
