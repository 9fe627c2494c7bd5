// Copyright mstar-kv authors.
//
// What the RMA engine and the stream driver hold, and for how long, over an
// in-process backend (inproc_backend.hpp; no transport, runs everywhere).
// A backend may keep resources for the operations and layer watches it
// hands out (Mooncake keeps a registered scratch page for each epoch-checked
// read and each watch) and release them only when their holders let go, so
//   * RmaKVTransferEngine::shutdown must hold no operation once the
//     backend's shutdown has completed every batch (it kept the aborted
//     reads in a local list across it: Mooncake's shutdown then waited
//     forever), and
//   * the stream driver must drop a stream's watch when the stream resolves,
//     not when the caller drops its LayerStream (cleanup() waited forever
//     behind a finished stream's Mooncake watch).
// The owner's pages are sparse and high (a 4096-page cache, scattered).
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <vector>

#include "common/layouts.hpp"
#include "engines/rma/inproc_backend.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "rma/rma_engine.hpp"

namespace mstar::kv::testing {
namespace {

using namespace std::chrono_literals;

constexpr std::byte kSentinel{0x3C};
constexpr std::uint64_t kSeed = 77;

// 2 layers, 4096 pages of 16 tokens, 1 head x 64 bf16 (2 KiB blocks).
KVLayout layout() { return make_layout(2, 4096, 16, 1, 64); }

EngineOptions options() {
  EngineOptions o;
  o.timeout = 5000ms;
  return o;
}

// An owner (its RMA engine publishes the descriptor) with one sequence of
// 700 pages scattered over the cache, and a reader whose backend may hold
// every read until it is aborted.
struct OwnerAndReader {
  explicit OwnerAndReader(bool hold, std::uint32_t layers_ready = 2) {
    auto owner_cache = make_kv_cache(layout(), MemoryKind::kHost);
    owner = std::make_unique<rma::RmaKVTransferEngine>(
        owner_cache, std::make_unique<InProcessRmaBackend>(owner_cache, "owner"), options());
    pool = std::make_unique<KVCachePool>(owner_cache, owner->get_kv_transfer_info(),
                                         /*scatter_seed=*/11);
    const auto pages = pool->allocate(1, 700 * 16);
    fill_pattern(*owner_cache, kSeed, pages, 0, 700 * 16);
    seq = pool->publish(1, layers_ready);
    reader_cache = make_kv_cache(layout(), MemoryKind::kHost);
    std::memset(reader_cache->base(), static_cast<int>(kSentinel), reader_cache->size_bytes());
    auto backend = std::make_unique<InProcessRmaBackend>(reader_cache, "reader", hold);
    counts = backend->counts();
    reader =
        std::make_unique<rma::RmaKVTransferEngine>(reader_cache, std::move(backend), options());
    local_pages = iota_pages(seq.page_indices.size(), 2000);
  }
  std::uint32_t high_pages() const {
    std::uint32_t n = 0;
    for (auto p : seq.page_indices) n += p >= 512;
    return n;
  }
  bool untouched() const {
    for (std::size_t i = 0; i < reader_cache->size_bytes(); ++i) {
      if (reader_cache->base()[i] != kSentinel) return false;
    }
    return true;
  }

  std::unique_ptr<rma::RmaKVTransferEngine> owner;
  std::unique_ptr<KVCachePool> pool;
  SequenceInfo seq;
  std::shared_ptr<KVCache> reader_cache;
  std::unique_ptr<rma::RmaKVTransferEngine> reader;
  std::shared_ptr<RmaLiveCounts> counts;
  std::vector<std::uint32_t> local_pages;
};

TEST(RmaLifetimes, APullMovesTheSequencesBytes) {
  OwnerAndReader s(/*hold=*/false);
  ASSERT_GT(s.high_pages(), 500u) << "the sequence's pages are not mostly >= 512";
  const auto reads = plan_reads(layout(), 0, s.seq.num_tokens, s.local_pages, s.seq.page_indices);
  auto f = s.reader->read_batched_async(s.seq.kv_transfer_info, reads);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->get(), s.seq.num_tokens * layout().token_bytes() * 2 * layout().num_layers);
  const auto v = verify_pattern(*s.reader_cache, kSeed, s.local_pages, 0, s.seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST(RmaLifetimes, ShutdownHoldsNoAbortedReadWhenTheBackendShutsDown) {
  OwnerAndReader s(/*hold=*/true);  // every read stays in flight until aborted
  const auto reads = plan_reads(layout(), 0, s.seq.num_tokens, s.local_pages, s.seq.page_indices);
  auto a = s.reader->read_batched_async(s.seq.kv_transfer_info, reads);
  auto b = s.reader->read_batched_async(s.seq.kv_transfer_info, reads);
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_FALSE(a->wait_for(50ms)) << "the held read finished";
  s.reader->shutdown();
  ASSERT_TRUE(a->ready() && b->ready()) << "shutdown returned before resolving its reads";
  EXPECT_EQ(a->status().code(), StatusCode::kShutdown) << a->status().to_string();
  EXPECT_EQ(b->status().code(), StatusCode::kShutdown) << b->status().to_string();
  EXPECT_EQ(s.counts->operations_at_shutdown.load(), 0)
      << "the engine still held aborted reads when its backend shut down";
  EXPECT_TRUE(s.untouched()) << "an aborted read wrote";
}

TEST(RmaLifetimes, AFinishedStreamLetsGoOfItsWatchBeforeItsFutureResolves) {
  OwnerAndReader s(/*hold=*/false);  // a finished sequence: every layer ready
  auto reader_cache = s.reader_cache;
  KVTransferManager m(reader_cache, std::move(s.reader), 5000ms);
  auto stream = m.start_streaming_retrieve(0, s.seq.num_tokens, s.local_pages, s.seq.page_indices,
                                           s.seq.kv_transfer_info, {});
  ASSERT_TRUE(stream.has_value());
  EXPECT_EQ(stream->future().get(),
            s.seq.num_tokens * layout().token_bytes() * 2 * layout().num_layers);
  // The caller still holds the stream; its watch must be gone already.
  EXPECT_EQ(s.counts->watches.load(), 0) << "a finished stream's watch is still alive";
  const auto v = verify_pattern(*reader_cache, kSeed, s.local_pages, 0, s.seq.num_tokens);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  m.cleanup();
  EXPECT_EQ(s.counts->watches_at_shutdown.load(), 0);
  EXPECT_EQ(s.counts->operations_at_shutdown.load(), 0);
}

TEST(RmaLifetimes, ACancelledStreamLetsGoOfItsWatch) {
  OwnerAndReader s(/*hold=*/false, /*layers_ready=*/0);  // the owner never marks a layer
  auto reader_cache = s.reader_cache;
  KVTransferManager m(reader_cache, std::move(s.reader), 5000ms);
  auto stream = m.start_streaming_retrieve(0, s.seq.num_tokens, s.local_pages, s.seq.page_indices,
                                           s.seq.kv_transfer_info, {});
  ASSERT_TRUE(stream.has_value());
  EXPECT_EQ(s.counts->watches.load(), 1);
  stream->cancel();
  ASSERT_TRUE(stream->future().wait_for(5s));
  EXPECT_EQ(stream->future().status().code(), StatusCode::kCancelled);
  EXPECT_EQ(s.counts->watches.load(), 0) << "a cancelled stream's watch is still alive";
  m.cleanup();
  EXPECT_EQ(s.counts->watches_at_shutdown.load(), 0);
}

TEST(RmaLifetimes, CleanupStopsAWaitingStreamAndLetsGoOfItsWatch) {
  OwnerAndReader s(/*hold=*/false, /*layers_ready=*/0);
  auto reader_cache = s.reader_cache;
  KVTransferManager m(reader_cache, std::move(s.reader), 5000ms);
  auto stream = m.start_streaming_retrieve(0, s.seq.num_tokens, s.local_pages, s.seq.page_indices,
                                           s.seq.kv_transfer_info, {});
  ASSERT_TRUE(stream.has_value());
  m.cleanup();
  ASSERT_TRUE(stream->future().ready());
  EXPECT_EQ(stream->future().status().code(), StatusCode::kShutdown);
  EXPECT_EQ(s.counts->watches_at_shutdown.load(), 0)
      << "the stream's watch outlived the engine's shutdown";
  EXPECT_TRUE(s.untouched());
}

}  // namespace
}  // namespace mstar::kv::testing
