// Copyright mstar-kv authors.
//
// The cuda_ipc copy kernel: the option that chooses it (runs
// anywhere), the kernel itself against the host walk's reference on device
// buffers, and the engine's kernel path against a real owner process
// beside the memcpy path: geometries, many reads in flight, cancel and
// timeout, shutdown, an owner killed mid-copy. The GPU cases skip with the
// reason without a device (fail under MSTAR_KV_REQUIRE_GPU=1); they run in
// ./scripts/gpu-check.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>

#include <cstring>
#include <random>
#include <thread>

#include "common/expectations.hpp"
#include "common/geometry_pulls.hpp"
#include "common/layouts.hpp"
#include "common/managers.hpp"
#include "common/scoped_env.hpp"
#include "common/strided_spans.hpp"
#include "core/span_table.hpp"
#include "cuda_ipc_fixture.hpp"
#include "engines/cuda_ipc/span_kernel.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;
using cuda_test::OwnerProcess;
using testing::ScopedEnv;
using testing::small_layout;

using cuda_test::kSeed;

// ---- the option (no device needed) -------------------------------------------

// A bad copy path is named with where it came from, before anything
// touches the device (a host cache: the option is checked first).
TEST(CudaIpcCopyOption, BadValuesAreRefusedNamingWhereTheyCameFrom) {
  auto host = make_kv_cache(small_layout(), MemoryKind::kHost);
  EngineOptions o;
  o.extra["cuda_ipc_copy"] = "warp";
  testing::expect_error([&] { CudaIpcKVTransferEngine e(host, o); }, StatusCode::kInvalidArgument,
                        {"cuda_ipc_copy='warp'", "expected kernel or memcpy"});
  {
    ScopedEnv env("MSTAR_KV_CUDA_IPC_COPY", "fast");
    testing::expect_error([&] { CudaIpcKVTransferEngine e(host, EngineOptions{}); },
                          StatusCode::kInvalidArgument,
                          {"MSTAR_KV_CUDA_IPC_COPY='fast'", "expected kernel or memcpy"});
    // The option wins over the environment: this one gets to the cache check.
    o.extra["cuda_ipc_copy"] = "memcpy";
    testing::expect_error([&] { CudaIpcKVTransferEngine e(host, o); }, StatusCode::kInvalidArgument,
                          {"device cache"});
  }
  o.extra["cuda_ipc_copie"] = "kernel";  // a typo of the key
  testing::expect_error([&] { CudaIpcKVTransferEngine e(host, o); }, StatusCode::kInvalidArgument,
                        {"cuda_ipc_copie", "cuda_ipc_copy"});
  std::cout << "[ INFO     ] copy kernel built: " << (cuda_ipc::span_kernel_built() ? "yes" : "no")
            << std::endl;
  if (!cuda_ipc::span_kernel_built()) {
    o.extra.erase("cuda_ipc_copie");
    o.extra["cuda_ipc_copy"] = "kernel";
    testing::expect_error([&] { CudaIpcKVTransferEngine e(host, o); }, StatusCode::kInvalidArgument,
                          {"no copy kernel"});
  }
}

// ---- on a device -----------------------------------------------------------------

class CudaIpcKernel : public cuda_test::DeviceTest {
 protected:
  void SetUp() override {
    DeviceTest::SetUp();
    if (IsSkipped() || HasFatalFailure()) return;
    if (!cuda_ipc::span_kernel_built()) {
      if (testing::gpu_required()) FAIL() << "MSTAR_KV_REQUIRE_GPU=1 but the kernel is not built";
      GTEST_SKIP() << "this build has no copy kernel (no CUDA compiler at configure time)";
    }
  }

  static std::unique_ptr<KVTransferManager> manager(std::shared_ptr<KVCache> cache,
                                                    const char* path,
                                                    std::chrono::milliseconds timeout = 20000ms) {
    auto m =
        testing::reader_manager("cuda_ipc", std::move(cache), timeout, {{"cuda_ipc_copy", path}});
    EXPECT_EQ(dynamic_cast<CudaIpcKVTransferEngine&>(m->engine()).copy_path(), path);
    return m;
  }
};

void check_cuda(cudaError_t e, const char* what) {
  ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorName(e);
}

std::byte* device_alloc(std::size_t n) {
  void* p = nullptr;
  const cudaError_t e = cudaMalloc(&p, n);
  EXPECT_EQ(e, cudaSuccess) << "cudaMalloc of " << n << " bytes: " << cudaGetErrorName(e);
  return static_cast<std::byte*>(p);
}

// The kernel on device buffers, from bases at every few misalignments, for
// spans of odd lengths, offsets and strides and for a large plan: the same
// bytes as the host reference (memcpy of every row).
TEST_F(CudaIpcKernel, KernelCopiesWhatTheHostReferenceCopies) {
  std::mt19937_64 g(3);
  testing::OddSpans odd = testing::odd_spans(300, 9, g);
  std::vector<StridedSpan>& spans = odd.spans;
  const std::uint64_t dst = odd.dst_end;
  const std::uint64_t src = odd.src_end;
  // And 20,000 aligned 4 KiB blocks, scattered (a layer-major pull's shape).
  for (std::uint64_t i = 0; i < 20000; ++i) {
    spans.push_back(
        {(dst + 4095) / 4096 * 4096 + i * 4096, ((i * 7919) % 20000) * 4096, 4096, 1, 0, 0});
  }
  const std::uint64_t dst_size = (dst + 4095) / 4096 * 4096 + 20000 * 4096 + 64;
  const std::uint64_t src_size = std::max<std::uint64_t>(src, 20000 * 4096) + 64;
  std::vector<std::byte> host_src(src_size);
  for (auto& b : host_src) b = std::byte(g() & 0xFF);
  const walk::TableSize size = walk::measure_table(spans);
  std::vector<std::byte> block(walk::table_bytes(size));
  std::byte* d_src = device_alloc(src_size + 16);
  std::byte* d_dst = device_alloc(dst_size + 16);
  std::byte* d_table = device_alloc(block.size());
  ASSERT_TRUE(d_src != nullptr && d_dst != nullptr && d_table != nullptr);
  const walk::WalkTable t =
      walk::write_table(spans, walk::Packing::kNone, 0, size, block.data(), d_table);
  check_cuda(cudaMemcpy(d_table, block.data(), block.size(), cudaMemcpyHostToDevice), "upload");
  for (std::uint64_t sa : {0u, 4u, 5u}) {
    for (std::uint64_t da : {0u, 8u, 3u}) {
      SCOPED_TRACE("source +" + std::to_string(sa) + ", destination +" + std::to_string(da));
      check_cuda(cudaMemcpy(d_src + sa, host_src.data(), src_size, cudaMemcpyHostToDevice), "up");
      check_cuda(cudaMemset(d_dst, 0xEE, dst_size + 16), "memset");
      for (unsigned blocks : {1u, cuda_ipc::span_kernel_blocks(0)}) {
        check_cuda(cuda_ipc::launch_span_copy(t, d_src + sa, d_dst + da, blocks, nullptr),
                   "launch");
        check_cuda(cudaDeviceSynchronize(), "sync");
      }
      std::vector<std::byte> got(dst_size);
      check_cuda(cudaMemcpy(got.data(), d_dst + da, dst_size, cudaMemcpyDeviceToHost), "down");
      std::vector<std::byte> want(dst_size, std::byte{0xEE});
      testing::reference_copy(spans, host_src.data(), want.data());
      std::uint64_t bad = 0;
      for (std::uint64_t i = 0; i < dst_size; ++i) bad += want[i] != got[i];
      EXPECT_EQ(bad, 0u);
    }
  }
  EXPECT_EQ(cuda_ipc::launch_span_copy(walk::WalkTable{}, d_src, d_dst, 4, nullptr), cudaSuccess)
      << "an empty table launches nothing";
  (void)cudaFree(d_src);
  (void)cudaFree(d_dst);
  (void)cudaFree(d_table);
}

// Every geometry the engine tests pull, through both copy paths, from one
// owner (all heads, 16-token HND pages, page-major): byte-exact by the
// pattern, nothing outside the read written.
TEST_F(CudaIpcKernel, KernelAndMemcpyPathsAgreeOnEveryGeometry) {
  const KVLayout owner_layout = testing::geometry_owner();
  OwnerProcess owner(spec(owner_layout, 300));
  for (const testing::GeometryCase& c : testing::geometry_cases()) {
    for (const char* path : {"kernel", "memcpy"}) {
      SCOPED_TRACE(std::string(c.what) + ", " + path);
      auto cache = local_cache(c.local);
      auto m = manager(cache, path);
      testing::expect_geometry_pull(*m, *cache, c, owner_layout, owner.sequence(), 300, kSeed,
                                    cuda_test::kSentinel);
    }
  }
}

// Reads in flight at once, each with its own span table (slots are taken,
// returned and reused): every one byte-exact, twice over.
TEST_F(CudaIpcKernel, ManyReadsInFlightEachWithItsTable) {
  KVLayout l = small_layout();
  l.num_pages = 256;
  OwnerProcess owner(spec(l, 256 * 16));
  const auto& seq = owner.sequence();
  auto cache = local_cache(l);
  auto m = manager(cache, "kernel");
  for (int round = 0; round < 2; ++round) {
    std::vector<TransferFuture> fs;
    std::vector<std::uint32_t> all(256);
    for (std::uint32_t r = 0; r < 16; ++r) {
      std::vector<std::uint32_t> lp(16);
      std::vector<std::uint32_t> rp(16);
      for (std::uint32_t i = 0; i < 16; ++i) {
        lp[i] = r * 16 + (i * 5 + static_cast<std::uint32_t>(round)) % 16;
        rp[i] = seq.page_indices[r * 16 + i];
        all[r * 16 + i] = lp[i];
      }
      auto f = m->start_async_retrieve(0, 256, lp, rp, seq.kv_transfer_info);
      ASSERT_TRUE(f.has_value());
      fs.push_back(std::move(*f));
    }
    for (auto& f : fs) EXPECT_EQ(f.get(), 256u * l.token_bytes() * 2 * l.num_layers);
    // Sequence page k landed in local page all[k].
    auto v = testing::verify_pattern_any(*cache, kSeed, all, 0, 256 * 16);
    EXPECT_TRUE(v.ok()) << "round " << round << ": " << v.first_mismatch;
  }
}

// Cancel and a 1 ms deadline on a large kernel read resolve only once the
// launch drained (no byte after), or the read finished first, byte-exact.
TEST_F(CudaIpcKernel, CancelAndTimeoutResolveOnlyAfterTheLaunchDrains) {
  cuda_test::expect_cancel_and_timeout_drain(
      "kernel", [](std::shared_ptr<KVCache> cache, std::chrono::milliseconds timeout) {
        return manager(std::move(cache), "kernel", timeout);
      });
}

// Shutdown with kernel reads in flight resolves every one, closes every
// handle, and nothing lands after.
TEST_F(CudaIpcKernel, ShutdownWithKernelReadsInFlight) {
  KVLayout l = small_layout();
  l.num_pages = 2048;  // 64 MiB
  OwnerProcess owner(spec(l, 2048 * 16));
  const auto& seq = owner.sequence();
  auto cache = local_cache(l);
  auto m = manager(cache, "kernel");
  const auto lp = testing::iota_pages(seq.page_indices.size());
  std::vector<TransferFuture> fs;
  for (int i = 0; i < 4; ++i) {
    auto f = m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
    ASSERT_TRUE(f.has_value());
    fs.push_back(std::move(*f));
  }
  m->cleanup();
  for (auto& f : fs) {
    ASSERT_TRUE(f.ready()) << "cleanup() returned with a read unresolved";
    const StatusCode c = f.status().code();
    EXPECT_TRUE(c == StatusCode::kOk || c == StatusCode::kShutdown) << f.status().to_string();
  }
  testing::expect_quiet(*cache, 50ms);
  EXPECT_EQ(dynamic_cast<CudaIpcKVTransferEngine&>(m->engine()).open_handles(), 0u);
}

// The owner SIGKILLed while reads of its memory are in flight: every
// future resolves in bounded time (the mapping stays valid while opened,
// so reads may well succeed), the engine keeps working for a new owner,
// and the dead owner's descriptor is refused.
TEST_F(CudaIpcKernel, OwnerKilledMidCopyResolvesInBoundedTime) {
  const KVLayout l = cuda_test::many_copies_layout();
  for (const char* path : {"kernel", "memcpy"}) {
    SCOPED_TRACE(path);
    auto owner = std::make_unique<OwnerProcess>(spec(l, 1024 * 16));
    const SequenceInfo seq = owner->sequence();
    auto cache = local_cache(l);
    auto m = manager(cache, path);
    const auto lp = cuda_test::scattered_pages(seq.page_indices.size());
    std::vector<TransferFuture> fs;
    for (int i = 0; i < 8; ++i) {
      auto f =
          m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
      ASSERT_TRUE(f.has_value());
      fs.push_back(std::move(*f));
    }
    owner->kill_now();
    for (auto& f : fs) {
      ASSERT_TRUE(f.wait_for(30s)) << "a read of a killed owner never resolved";
      std::cout << "[ INFO     ] " << path << ", owner killed: " << f.status().to_string()
                << std::endl;
    }
    testing::expect_error(
        [&] {
          m->start_async_retrieve(0, seq.num_tokens, lp, seq.page_indices, seq.kv_transfer_info);
        },
        StatusCode::kNotFound);
    OwnerProcess again(spec(small_layout(), 64));
    auto small = local_cache(small_layout());
    auto m2 = manager(small, path);
    const std::vector<std::uint32_t> lp2{3, 8, 13, 18};
    m2->sync_retrieve(0, 64, lp2, again.sequence().page_indices, again.sequence().kv_transfer_info);
    EXPECT_TRUE(testing::verify_pattern_any(*small, kSeed, lp2, 0, 64).ok());
  }
}

}  // namespace
}  // namespace mstar::kv
