// Copyright mstar-kv authors.
//
// Google Benchmark: the cost of one KVTransferManager::start_async_retrieve
// + get() over the shm engine, with statistics off (/0) and on (/1, the
// default), for a one-page request and for 4 KiB x 4096, source and destination
// in this process (the shared cache is read through /proc/self like any
// peer's). The C++ side of bench/python_bench.py, which times the same call
// from Python over the same geometries and reports the difference as the
// Python overhead.
//   OnePage/llama3_8b   32 layers x 8 heads x 128 dim bf16, 16-token page:
//                       64 blocks of 32 KiB (2 MiB, copied by a worker)
//   OnePage/tiny        1 layer x 1 head x 64 dim bf16: 2 blocks of 2 KiB
//                       (copied on the calling thread)
#include <benchmark/benchmark.h>

#include <memory>
#include <vector>

#include "mstar/kv/factory.hpp"
#include "mstar/kv/manager.hpp"

namespace {

using namespace mstar::kv;

KVLayout geometry(bool tiny) {
  KVLayout l;
  l.num_layers = tiny ? 1 : 32;
  l.num_kv_heads = tiny ? 1 : 8;
  l.head_dim = tiny ? 64 : 128;
  l.dtype = DType::kBFloat16;
  l.page_size = 16;
  l.num_pages = 16;
  return l;
}

void OnePage(benchmark::State& state, bool tiny) {
  const KVLayout l = geometry(tiny);
  const bool stats = state.range(0) != 0;
  auto src = make_kv_cache(l, MemoryKind::kSharedHost);
  KVTransferManager owner(TransferEngineInfo{"prefill", "", "shm", {}}, src);
  const KVTransferInfo info = owner.get_kv_transfer_info();
  auto dst = make_kv_cache(l, MemoryKind::kHost);
  KVTransferManager reader(TransferEngineInfo{"decode", "", "shm", {}}, dst);
  reader.set_stats_enabled(stats);
  const std::vector<std::uint32_t> local{3}, remote{5};
  reader.sync_retrieve(0, 16, local, remote, info);  // maps the peer's cache
  for (auto _ : state) {
    auto f = reader.start_async_retrieve(0, 16, local, remote, info);
    benchmark::DoNotOptimize(f->get());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * l.num_layers *
                          l.block_bytes());
}

// 4 KiB x 4096: one layer, 1 head x 128 dim bf16, 16-token pages (4 KiB
// blocks), 2048 pages scattered on the remote side: 4096 copies of 4 KiB.
void Small4K(benchmark::State& state) {
  KVLayout l;
  l.num_layers = 1;
  l.num_kv_heads = 1;
  l.head_dim = 128;
  l.dtype = DType::kBFloat16;
  l.page_size = 16;
  l.num_pages = 2048;
  auto src = make_kv_cache(l, MemoryKind::kSharedHost);
  KVTransferManager owner(TransferEngineInfo{"prefill", "", "shm", {}}, src);
  const KVTransferInfo info = owner.get_kv_transfer_info();
  auto dst = make_kv_cache(l, MemoryKind::kHost);
  KVTransferManager reader(TransferEngineInfo{"decode", "", "shm", {}}, dst);
  reader.set_stats_enabled(state.range(0) != 0);
  std::vector<std::uint32_t> local(l.num_pages), remote(l.num_pages);
  for (std::uint32_t i = 0; i < l.num_pages; ++i) {
    local[i] = i;
    remote[i] = (i * 1031u) % l.num_pages;  // 1031 is prime: a permutation, no neighbours
  }
  const std::uint64_t tokens = std::uint64_t{l.num_pages} * l.page_size;
  reader.sync_retrieve(0, tokens, local, remote, info);
  for (auto _ : state) {
    benchmark::DoNotOptimize(reader.sync_retrieve(0, tokens, local, remote, info));
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * l.num_pages *
                          l.block_bytes());
}

// Arg: statistics off (0) / on (1), the default.
BENCHMARK_CAPTURE(OnePage, llama3_8b, false)
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK_CAPTURE(OnePage, tiny, true)
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(Small4K)->Arg(0)->Arg(1)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
