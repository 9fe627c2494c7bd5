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

// A bf16 cache of 16-token pages.
KVLayout bf16_layout(std::uint32_t layers, std::uint32_t heads, std::uint32_t head_dim,
                     std::uint32_t pages) {
  return {.num_layers = layers,
          .num_pages = pages,
          .page_size = 16,
          .num_kv_heads = heads,
          .head_dim = head_dim,
          .dtype = DType::kBFloat16};
}

// An owner's shared cache and a reader's private one of layout `l`, each
// under its manager over the shm engine (both in this process), the
// reader's statistics on or off.
struct ShmPair {
  ShmPair(const KVLayout& l, bool stats)
      : src(make_kv_cache(l, MemoryKind::kSharedHost)),
        owner(TransferEngineInfo{"prefill", "", "shm", {}}, src),
        info(owner.get_kv_transfer_info()),
        dst(make_kv_cache(l, MemoryKind::kHost)),
        reader(TransferEngineInfo{"decode", "", "shm", {}}, dst) {
    reader.set_stats_enabled(stats);
  }
  std::shared_ptr<KVCache> src;
  KVTransferManager owner;
  KVTransferInfo info;
  std::shared_ptr<KVCache> dst;
  KVTransferManager reader;
};

void OnePage(benchmark::State& state, bool tiny) {
  const KVLayout l = tiny ? bf16_layout(1, 1, 64, 16) : bf16_layout(32, 8, 128, 16);
  ShmPair p(l, state.range(0) != 0);
  const std::vector<std::uint32_t> local{3}, remote{5};
  p.reader.sync_retrieve(0, 16, local, remote, p.info);  // maps the peer's cache
  for (auto _ : state) {
    auto f = p.reader.start_async_retrieve(0, 16, local, remote, p.info);
    benchmark::DoNotOptimize(f->get());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * l.num_layers *
                          l.block_bytes());
}

// 4 KiB x 4096: one layer, 1 head x 128 dim bf16, 16-token pages (4 KiB
// blocks), 2048 pages scattered on the remote side: 4096 copies of 4 KiB.
void Small4K(benchmark::State& state) {
  const KVLayout l = bf16_layout(1, 1, 128, 2048);
  ShmPair p(l, state.range(0) != 0);
  std::vector<std::uint32_t> local(l.num_pages), remote(l.num_pages);
  for (std::uint32_t i = 0; i < l.num_pages; ++i) {
    local[i] = i;
    remote[i] = (i * 1031u) % l.num_pages;  // 1031 is prime: a permutation, no neighbours
  }
  const std::uint64_t tokens = std::uint64_t{l.num_pages} * l.page_size;
  p.reader.sync_retrieve(0, tokens, local, remote, p.info);
  for (auto _ : state) {
    benchmark::DoNotOptimize(p.reader.sync_retrieve(0, tokens, local, remote, p.info));
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
