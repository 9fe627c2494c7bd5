// Copyright mstar-kv authors.
//
// The cuda_ipc engine against a real owner process (cuda_ipc_owner) that
// exports its device cache: both processes on device 0, one IPC handle
// exported by one and opened by the other. The cases mirror the engine
// conformance suite (tests/engines/conformance) with the bytes staged
// through host memory to be checked. Without a visible CUDA device every
// case skips with the reason (or fails under MSTAR_KV_REQUIRE_GPU=1).
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <thread>

#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "common/managers.hpp"
#include "cuda_ipc_fixture.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using cuda_test::OwnerProcess;
using cuda_test::OwnerSpec;
using testing::small_layout;

using cuda_test::kSeed;
using cuda_test::kSentinel;

std::vector<std::uint32_t> local_pages(std::size_t n, std::uint32_t first = 3,
                                       std::uint32_t num_pages = 64) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) {
    v[i] = static_cast<std::uint32_t>((first + i * 5) % num_pages);
  }
  return v;
}

class CudaIpcEngine : public cuda_test::DeviceTest {
 protected:
  static std::unique_ptr<KVTransferManager> manager(std::shared_ptr<KVCache> cache,
                                                    std::chrono::milliseconds timeout = 10000ms,
                                                    std::map<std::string, std::string> extra = {}) {
    return testing::reader_manager("cuda_ipc", std::move(cache), timeout, std::move(extra));
  }
};

TEST_F(CudaIpcEngine, DescriptorDescribesTheAllocation) {
  const KVLayout l = small_layout();
  auto cache = make_kv_cache(l, MemoryKind::kDevice, 0);
  CudaIpcKVTransferEngine engine(cache, 3u);
  const CudaIpcKVTransferInfo& info = engine.info();
  EXPECT_EQ(info.owner_pid, static_cast<std::uint32_t>(::getpid()));
  EXPECT_NE(info.generation, 0u);
  EXPECT_EQ(info.cuda_share.device, 0);
  EXPECT_GE(info.cuda_share.allocation_bytes, l.total_bytes());
  EXPECT_EQ(info.offset, 0);
  EXPECT_EQ(info.size, CudaIpcKVTransferInfo::view_size(l));
  EXPECT_EQ(info.requires_grad, false);
  EXPECT_NE(info.cuda_share.handle, (std::array<std::uint8_t, 64>{}));
  EXPECT_EQ(CudaIpcKVTransferInfo::decode(engine.get_kv_transfer_info()), info);
  // The host tables readers stream from (cuda_ipc.hpp "Layer readiness").
  EXPECT_TRUE(info.has_epoch_table);
  EXPECT_TRUE(info.has_host_tables);
  EXPECT_EQ(info.host_tables_uid, static_cast<std::uint32_t>(::geteuid()));
  EXPECT_EQ(::fcntl(static_cast<int>(info.host_tables_fd), F_GETFD) >= 0, true);
  // Zero-filled, as make_kv_cache promises.
  auto host = testing::download(*cache);
  const auto* b = reinterpret_cast<const std::uint8_t*>(host->base());
  EXPECT_TRUE(std::all_of(b, b + l.total_bytes(), [](std::uint8_t x) { return x == 0; }));
}

// mark_layers_ready_after: the mark waits for the work enqueued before it
// on the stream. A host function that blocks until the test lets it go
// holds the stream; the mark must not land before it is released.
TEST_F(CudaIpcEngine, AMarkEnqueuedOnAStreamLandsOnlyWhenTheStreamGetsThere) {
  const KVLayout l = small_layout();
  auto cache = make_kv_cache(l, MemoryKind::kDevice, 0);
  CudaIpcKVTransferEngine engine(cache, 1u);
  auto pool = std::make_shared<KVCachePool>(cache, engine.get_kv_transfer_info());
  const auto pages = pool->allocate(7, 64);
  (void)pool->publish(7, 0);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  std::atomic<bool> release{false};
  ASSERT_EQ(cudaLaunchHostFunc(
                stream,
                [](void* flag) {
                  auto* f = static_cast<std::atomic<bool>*>(flag);
                  while (!f->load()) std::this_thread::sleep_for(1ms);
                },
                &release),
            cudaSuccess);
  mark_layers_ready_after(pool, 7, 2, stream);
  std::this_thread::sleep_for(50ms);
  EXPECT_EQ(cache->readiness().load(pages[0]), 0u) << "marked before the stream got there";
  release = true;
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  for (std::uint32_t p : pages) EXPECT_EQ(cache->readiness().load(p), 2u);
  // A mark the pool refuses (backwards) is dropped, not thrown on CUDA's
  // thread; readiness stays where it was.
  mark_layers_ready_after(pool, 7, 1, stream);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cache->readiness().load(pages[0]), 2u);
  EXPECT_THROW(mark_layers_ready_after(nullptr, 7, 1, stream), Error);
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// Byte-exact pulls are the conformance suite's; here, that one IPC handle
// is opened per owner, reused by the next read and closed at shutdown.
TEST_F(CudaIpcEngine, OneHandlePerOwnerReusedAndClosedAtShutdown) {
  const KVLayout l = small_layout();
  OwnerProcess owner(spec(l, 300));
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto& seq = owner.sequence();
  ASSERT_EQ(seq.kv_transfer_info.engine, "cuda_ipc");
  const auto lp = local_pages(seq.page_indices.size());
  auto& engine = dynamic_cast<CudaIpcKVTransferEngine&>(m->engine());
  for (int i = 0; i < 2; ++i) {
    m->sync_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
    EXPECT_EQ(engine.open_handles(), 1u);
  }
  m->cleanup();
  EXPECT_EQ(engine.open_handles(), 0u);
}

// Other orders are the conformance suite's; here, one partial page read
// through the engine directly: tokens [3, 11) of one page, every layer.
TEST_F(CudaIpcEngine, APartialPageThroughTheEngineDirectly) {
  const KVLayout remote = small_layout(CacheOrder::kPageMajor, PageOrder::kHND);
  OwnerProcess owner(spec(remote, 90));
  const auto& seq = owner.sequence();
  const KVLayout l = small_layout();
  auto cache = local_cache(l);
  CudaIpcKVTransferEngine engine(cache, 2u);
  std::vector<KVReadInfo> reads;
  for (std::int64_t layer = 0; layer < 4; ++layer) {
    reads.push_back({layer, 40, seq.page_indices[2], 3, 11});
  }
  auto f = engine.read_batched_async(seq.kv_transfer_info, reads);
  ASSERT_TRUE(f.has_value());
  EXPECT_EQ(f->get(), 8u * l.token_bytes() * 2 * 4);
  // Local page 40 holds sequence page 2's tokens [3, 11) = tokens [35, 43).
  const std::vector<std::uint32_t> table = {0, 0, 40};
  auto v = testing::verify_pattern_any(*cache, kSeed, table, 35, 43);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  expect_only_named_bytes_written(*cache, remote, reads);
}

TEST_F(CudaIpcEngine, WrappedMemoryAtAnOffsetIsServed) {
  const KVLayout l = small_layout();
  OwnerSpec s = spec(l, 200);
  s.wrap_offset = 4096 + 512;  // not at the allocation's base
  OwnerProcess owner(s);
  const auto& seq = owner.sequence();
  const auto info = CudaIpcKVTransferInfo::decode(seq.kv_transfer_info);
  EXPECT_EQ(info.offset_bytes(), 4096u + 512u);
  EXPECT_GE(info.cuda_share.allocation_bytes, l.total_bytes() + 4096 + 512);
  auto cache = local_cache(l);
  auto m = manager(cache);
  const auto lp = local_pages(seq.page_indices.size());
  m->sync_retrieve(0, 200, lp, seq.page_indices, seq.kv_transfer_info);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 0, 200);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

TEST_F(CudaIpcEngine, LocalWrapOfAPyTorchLikeTensor) {
  // Memory owned by the caller: the cache never frees it.
  const KVLayout l = small_layout();
  void* raw = nullptr;
  ASSERT_EQ(cudaMalloc(&raw, l.total_bytes() + 1024), cudaSuccess);
  {
    auto cache = wrap_device_cache(l, static_cast<std::byte*>(raw) + 1024, l.total_bytes(), 0);
    CudaIpcKVTransferEngine engine(cache, 1u);
    EXPECT_EQ(engine.info().offset, 512);
    // Out of its allocation (by more than any rounding of the allocation).
    EXPECT_THROW(wrap_device_memory(static_cast<std::byte*>(raw) + 1024,
                                    l.total_bytes() + (std::size_t{64} << 20), 0),
                 Error);
  }
  EXPECT_EQ(cudaFree(raw), cudaSuccess) << "the wrapped memory was freed by the cache";
  int host_value = 0;
  EXPECT_THROW(wrap_device_memory(&host_value, sizeof host_value, 0), Error);
  EXPECT_THROW(wrap_device_memory(nullptr, 16, 0), Error);
}

TEST_F(CudaIpcEngine, BadReadsAreRejectedBeforeAnyByteMoves) {
  const KVLayout l = small_layout();
  OwnerProcess owner(spec(l, 64));
  const auto& seq = owner.sequence();
  {
    KVLayout other = l;
    other.head_dim = 32;
    auto cache = local_cache(other);
    auto m = manager(cache);
    testing::expect_error(
        [&] {
          m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, seq.kv_transfer_info);
        },
        StatusCode::kIncompatibleLayout);
    expect_only_named_bytes_written(*cache, other, {});
  }
  auto cache = local_cache(l);
  auto m = manager(cache);
  auto remote = seq.page_indices;
  remote[2] = 64;
  testing::expect_error(
      [&] { m->start_async_retrieve(0, 64, local_pages(4), remote, seq.kv_transfer_info); },
      StatusCode::kInvalidArgument, {"remote page 64 (table entry 2)", "out of range [0, 64)"});
  const auto& good = seq.kv_transfer_info;
  for (std::size_t n = 0; n < good.payload.size(); n += 7) {
    KVTransferInfo bad = good;
    bad.payload.resize(n);
    EXPECT_THROW(m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, bad), Error) << n;
  }
  KVTransferInfo other = good;
  other.engine = "shm";
  EXPECT_THROW(m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, other), Error);
  // A forged allocation size larger than the real allocation is caught when
  // the handle is opened (the mapping is smaller than claimed).
  auto forged = CudaIpcKVTransferInfo::decode(good);
  forged.cuda_share.allocation_bytes += std::uint64_t{1} << 40;
  forged.offset = static_cast<std::int64_t>((std::uint64_t{1} << 40) / l.element_size());
  forged.generation ^= 1;  // not the generation opened above
  testing::expect_error(
      [&] { m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, forged.encode()); },
      StatusCode::kCorruptDescriptor);
  expect_only_named_bytes_written(*cache, l, {});
}

TEST_F(CudaIpcEngine, StaleGenerationIsRefused) {
  const KVLayout l = small_layout();
  OwnerProcess owner(spec(l, 64));
  auto cache = local_cache(l);
  auto m = manager(cache);
  auto& engine = dynamic_cast<CudaIpcKVTransferEngine&>(m->engine());
  const SequenceInfo first = owner.sequence();
  const auto lp = local_pages(4);
  m->sync_retrieve(0, 64, lp, first.page_indices, first.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 0, 64).ok());

  const SequenceInfo second = owner.regenerate(kSeed + 1);
  EXPECT_NE(CudaIpcKVTransferInfo::decode(second.kv_transfer_info).generation,
            CudaIpcKVTransferInfo::decode(first.kv_transfer_info).generation);
  m->sync_retrieve(0, 64, lp, second.page_indices, second.kv_transfer_info);
  auto v = testing::verify_pattern_any(*cache, kSeed + 1, lp, 0, 64);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
  EXPECT_EQ(engine.open_handles(), 1u) << "the replaced generation's handle stayed open";

  testing::fill_bytes(*cache, kSentinel);
  testing::expect_error(
      [&] { m->start_async_retrieve(0, 64, lp, first.page_indices, first.kv_transfer_info); },
      StatusCode::kStaleDescriptor);
  expect_only_named_bytes_written(*cache, l, {});
}

// Never the wrong KV (epochs.hpp): a sequence whose pages the owner freed
// and gave to the next request fails with kStaleDescriptor, never reads as
// success with the next request's bytes; and in a race (the owner reuses
// while the reader pulls) every read verifies as its own sequence or fails
// stale.
TEST_F(CudaIpcEngine, ReusedPagesFailStaleNeverAsAnotherRequest) {
  const KVLayout l = small_layout();
  OwnerProcess owner(spec(l, 64 * 16));  // every page in the sequence
  auto cache = local_cache(l);
  auto m = manager(cache);
  const SequenceInfo first = owner.sequence();
  std::vector<std::uint32_t> lp(first.page_indices.size());
  std::iota(lp.begin(), lp.end(), 0u);
  m->sync_retrieve(0, first.num_tokens, lp, first.page_indices, first.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, lp, 0, first.num_tokens).ok());

  const SequenceInfo second = owner.reuse(kSeed + 1);
  std::vector<std::uint32_t> a = first.page_indices, b = second.page_indices;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  ASSERT_EQ(a, b) << "the owner did not reuse the pages";
  ASSERT_NE(second.kv_transfer_info.epoch, first.kv_transfer_info.epoch);
  testing::expect_error(
      [&] {
        auto f = m->start_async_retrieve(0, first.num_tokens, lp, first.page_indices,
                                         first.kv_transfer_info);
        ASSERT_TRUE(f.has_value());
        f->get();
      },
      StatusCode::kStaleDescriptor, {"changed owner"});
  m->sync_retrieve(0, second.num_tokens, lp, second.page_indices, second.kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed + 1, lp, 0, second.num_tokens).ok());

  std::uint64_t ok = 0, stale = 0, wrong = 0;
  SequenceInfo cur = second;
  std::uint64_t seed = kSeed + 1;
  for (int i = 0; i < 200; ++i) {
    owner.send_reuse(seed + 1);  // the owner frees and rewrites while we read
    Status st;
    try {
      auto f =
          m->start_async_retrieve(0, cur.num_tokens, lp, cur.page_indices, cur.kv_transfer_info);
      if (f) f->get();
    } catch (const Error& e) {
      st = e.status();
    }
    if (st.is_ok()) {
      if (testing::verify_pattern_any(*cache, seed, lp, 0, cur.num_tokens).ok()) {
        ++ok;
      } else {
        ++wrong;
      }
    } else {
      EXPECT_EQ(st.code(), StatusCode::kStaleDescriptor) << st.to_string();
      ++stale;
    }
    cur = owner.await_sequence();
    ++seed;
  }
  std::cout << "[ reuse    ] cuda_ipc: 200 pulls, " << ok << " verified, " << stale
            << " stale, wrong-sequence reads: " << wrong << std::endl;
  EXPECT_EQ(wrong, 0u);
}

// Caches of different geometry: strided spans become cudaMemcpy2DAsync
// copies. A TP=2 decode rank with 64-token NHD pages pulls its head from a
// TP=1 owner with 16-token HND pages; byte-exact by the pattern.
TEST_F(CudaIpcEngine, MixedGeometriesUse2DCopies) {
  const KVLayout owner = small_layout(CacheOrder::kPageMajor, PageOrder::kHND);
  OwnerProcess p(spec(owner, 256));
  KVLayout l = small_layout();
  l.page_size = 64;
  l.num_pages = 16;
  l.total_kv_heads = 2;
  l.first_kv_head = 1;
  l.num_kv_heads = 1;
  auto cache = local_cache(l);
  auto m = manager(cache);
  const std::vector<std::uint32_t> lp{3, 9, 0, 12};
  const auto& seq = p.sequence();
  EXPECT_EQ(m->sync_retrieve(20, 256, lp, seq.page_indices, seq.kv_transfer_info),
            (256u - 20) * l.token_bytes() * 2 * l.num_layers);
  auto v = testing::verify_pattern_any(*cache, kSeed, lp, 20, 256);
  EXPECT_TRUE(v.ok()) << v.first_mismatch;
}

// A descriptor without an epoch table (made from a bare torch cuda_share)
// cannot be read with an epoch: refused before any byte moves.
TEST_F(CudaIpcEngine, AnEpochWithoutATableIsRefused) {
  const KVLayout l = small_layout();
  OwnerProcess owner(spec(l, 64));
  auto cache = local_cache(l);
  auto m = manager(cache);
  SequenceInfo seq = owner.sequence();
  auto info = CudaIpcKVTransferInfo::decode(seq.kv_transfer_info);
  ASSERT_TRUE(info.has_epoch_table);
  info.has_epoch_table = false;
  info.epoch_handle.fill(0);
  info.epoch_pages = 0;
  info.has_host_tables = false;  // a bare cuda_share has neither
  info.host_tables_fd = 0;
  info.host_tables_uid = 0;
  KVTransferInfo bare = info.encode();
  bare.epoch = seq.kv_transfer_info.epoch;
  testing::expect_error(
      [&] { m->start_async_retrieve(0, 64, local_pages(4), seq.page_indices, bare); },
      StatusCode::kInvalidArgument, {"no epoch table"});
  // Nor can it be streamed: no readiness to watch.
  testing::expect_error(
      [&] { m->start_streaming_retrieve(0, 64, local_pages(4), seq.page_indices, bare); },
      StatusCode::kNotSupported, {"carries no host tables"});
  expect_only_named_bytes_written(*cache, l, {});
}

TEST_F(CudaIpcEngine, AnOwnerMayExportCachesOfTwoLayouts) {
  // Two caches in one owner process (say a draft and a target model's, or
  // two pools): layouts that differ (here in page count and order) are
  // separate lineages, so one engine reads both, alternately, without
  // either replacing the other.
  const KVLayout first = small_layout();
  KVLayout second = small_layout(CacheOrder::kPageMajor, PageOrder::kHND);
  second.num_pages = 128;
  OwnerProcess owner(spec(first, 64));
  const SequenceInfo a = owner.sequence();
  const SequenceInfo b = owner.add_cache(kSeed + 5, second);
  auto cache = local_cache(first);
  auto m = manager(cache);
  const auto la = local_pages(4, 3);
  const auto lb = local_pages(4, 30);
  for (int round = 0; round < 2; ++round) {
    m->sync_retrieve(0, 64, la, a.page_indices, a.kv_transfer_info);
    m->sync_retrieve(0, 64, lb, b.page_indices, b.kv_transfer_info);
  }
  auto va = testing::verify_pattern_any(*cache, kSeed, la, 0, 64);
  auto vb = testing::verify_pattern_any(*cache, kSeed + 5, lb, 0, 64);
  EXPECT_TRUE(va.ok()) << va.first_mismatch;
  EXPECT_TRUE(vb.ok()) << vb.first_mismatch;
  EXPECT_EQ(dynamic_cast<CudaIpcKVTransferEngine&>(m->engine()).open_handles(), 2u);
}

TEST_F(CudaIpcEngine, DeadOwnerIsRefused) {
  const KVLayout l = small_layout();
  auto cache = local_cache(l);
  auto m = manager(cache);
  auto& engine = dynamic_cast<CudaIpcKVTransferEngine&>(m->engine());
  OwnerProcess owner(spec(l, 64));
  const testing::DeadPeer dead = testing::read_then_kill(owner, *m, 64, local_pages(4));
  const KVTransferInfo& stale = dead.descriptor;
  const std::vector<std::uint32_t>& pages = dead.pages;
  testing::fill_bytes(*cache, kSentinel);
  testing::expect_error([&] { m->start_async_retrieve(0, 64, local_pages(4), pages, stale); },
                        StatusCode::kNotFound);
  EXPECT_EQ(engine.open_handles(), 0u);
  expect_only_named_bytes_written(*cache, l, {});
  // A new owner works.
  OwnerProcess again(spec(l, 64));
  m->sync_retrieve(0, 64, local_pages(4), again.sequence().page_indices,
                   again.sequence().kv_transfer_info);
  EXPECT_TRUE(testing::verify_pattern_any(*cache, kSeed, local_pages(4), 0, 64).ok());
}

// What every engine does at shutdown is the conformance suite's; here, that
// no IPC handle stays open once the reads in flight resolved.
TEST_F(CudaIpcEngine, ShutdownClosesEveryHandle) {
  KVLayout l = small_layout();
  l.num_pages = 2048;  // 64 MiB
  OwnerProcess owner(spec(l, 2048 * 16));
  auto cache = local_cache(l);
  auto m = manager(cache, 20000ms);
  const auto& seq = owner.sequence();
  const auto lp = testing::iota_pages(seq.page_indices.size());
  auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
  ASSERT_TRUE(f.has_value());
  m->cleanup();
  ASSERT_TRUE(f->ready()) << "cleanup() returned with a read unresolved";
  testing::expect_quiet(*cache, 50ms);
  EXPECT_EQ(dynamic_cast<CudaIpcKVTransferEngine&>(m->engine()).open_handles(), 0u);
}

// Many small copies (one span per block, cuda_ipc_batch=0), so the read is
// still queued when cancel / the 1 ms deadline hits.
TEST_F(CudaIpcEngine, CancelAndTimeoutResolveOnlyAfterTheCopiesDrain) {
  cuda_test::expect_cancel_and_timeout_drain(
      "unbatched copies", [](std::shared_ptr<KVCache> cache, std::chrono::milliseconds timeout) {
        return manager(std::move(cache), timeout, {{"cuda_ipc_batch", "0"}});
      });
}

TEST_F(CudaIpcEngine, BatchedAndPlainCopiesAgree) {
  const KVLayout l = small_layout();
  OwnerProcess owner(spec(l, 500));
  const auto& seq = owner.sequence();
  const auto lp = local_pages(seq.page_indices.size());
  for (const char* batch : {"0", "1"}) {
    auto cache = local_cache(l);
    auto m = manager(cache, 10000ms, {{"cuda_ipc_batch", batch}});
    m->sync_retrieve(3, 500, lp, seq.page_indices, seq.kv_transfer_info);
    auto v = testing::verify_pattern_any(*cache, kSeed, lp, 3, 500);
    EXPECT_TRUE(v.ok()) << "cuda_ipc_batch=" << batch << ": " << v.first_mismatch;
    expect_only_named_bytes_written(*cache, l, plan_reads(l, 3, 500, lp, seq.page_indices));
  }
}

TEST_F(CudaIpcEngine, OwnCacheIsReadableInProcessOthersAreNot) {
  const KVLayout l = small_layout();
  auto a = local_cache(l);
  auto b = local_cache(l);
  const std::vector<std::uint32_t> src = {1, 2};
  testing::fill_pattern_any(*a, kSeed, src, 0, 32);
  CudaIpcKVTransferEngine ea(a, 2u);
  CudaIpcKVTransferEngine eb(b, 2u);
  // Pages 1, 2 -> 10, 11 within cache a.
  const std::vector<std::uint32_t> dst = {10, 11};
  auto reads = plan_reads(l, 0, 32, dst, src);
  auto f = ea.read_batched_async(ea.get_kv_transfer_info(), reads);
  ASSERT_TRUE(f.has_value());
  f->get();
  EXPECT_TRUE(testing::verify_pattern_any(*a, kSeed, dst, 0, 32).ok());
  testing::expect_error([&] { ea.read_batched_async(eb.get_kv_transfer_info(), reads); },
                        StatusCode::kInvalidArgument);
}

// ---- memory legacy IPC cannot share is refused -----------------------------

template <typename Fn>
Fn driver_fn(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    return nullptr;
  }
  return reinterpret_cast<Fn>(fn);
}

TEST_F(CudaIpcEngine, VmmAllocationsAreRefused) {
  // cuMemCreate + cuMemAddressReserve + cuMemMap, as PyTorch's expandable
  // segments allocate.
  auto create = driver_fn<PFN_cuMemCreate_v10020>("cuMemCreate");
  auto granularity =
      driver_fn<PFN_cuMemGetAllocationGranularity_v10020>("cuMemGetAllocationGranularity");
  auto reserve = driver_fn<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
  auto map = driver_fn<PFN_cuMemMap_v10020>("cuMemMap");
  auto set_access = driver_fn<PFN_cuMemSetAccess_v10020>("cuMemSetAccess");
  auto unmap = driver_fn<PFN_cuMemUnmap_v10020>("cuMemUnmap");
  auto release = driver_fn<PFN_cuMemRelease_v10020>("cuMemRelease");
  auto addr_free = driver_fn<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
  ASSERT_TRUE(create && granularity && reserve && map && set_access && unmap && release &&
              addr_free)
      << "driver lacks the VMM API";
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // a current context for the driver calls
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = 0;
  std::size_t gran = 0;
  ASSERT_EQ(granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), CUDA_SUCCESS);
  const std::size_t size = gran;
  CUmemGenericAllocationHandle h{};
  ASSERT_EQ(create(&h, size, &prop, 0), CUDA_SUCCESS);
  CUdeviceptr ptr = 0;
  ASSERT_EQ(reserve(&ptr, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(map(ptr, size, 0, h, 0), CUDA_SUCCESS);
  CUmemAccessDesc access{};
  access.location = prop.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(set_access(ptr, size, &access, 1), CUDA_SUCCESS);
  try {
    wrap_device_memory(reinterpret_cast<void*>(ptr), size, 0);
    ADD_FAILURE() << "VMM memory was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
    EXPECT_NE(std::string(e.what()).find("cuMemCreate"), std::string::npos) << e.what();
    std::cout << "[ INFO     ] refused: " << e.what() << std::endl;
  }
  EXPECT_EQ(unmap(ptr, size), CUDA_SUCCESS);
  EXPECT_EQ(release(h), CUDA_SUCCESS);
  EXPECT_EQ(addr_free(ptr, size), CUDA_SUCCESS);
}

TEST_F(CudaIpcEngine, MemoryPoolAllocationsAreRefused) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, 1 << 20, s);
  if (err != cudaSuccess) {
    cudaStreamDestroy(s);
    GTEST_SKIP() << "cudaMallocAsync unsupported here: " << cudaGetErrorName(err);
  }
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  testing::expect_error([&] { wrap_device_memory(p, 1 << 20, 0); }, StatusCode::kInvalidArgument);
  EXPECT_EQ(cudaFreeAsync(p, s), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

}  // namespace
}  // namespace mstar::kv
