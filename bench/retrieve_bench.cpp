// Copyright mstar-kv authors.
//
// Google Benchmark: the cost of one KVTransferManager::start_async_retrieve
// + get() of a one-page request over the shm engine, source and destination
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
  auto src = make_kv_cache(l, MemoryKind::kSharedHost);
  KVTransferManager owner(TransferEngineInfo{"prefill", "", "shm", {}}, src);
  const KVTransferInfo info = owner.get_kv_transfer_info();
  auto dst = make_kv_cache(l, MemoryKind::kHost);
  KVTransferManager reader(TransferEngineInfo{"decode", "", "shm", {}}, dst);
  const std::vector<std::uint32_t> local{3}, remote{5};
  reader.sync_retrieve(0, 16, local, remote, info);  // maps the peer's cache
  for (auto _ : state) {
    auto f = reader.start_async_retrieve(0, 16, local, remote, info);
    benchmark::DoNotOptimize(f->get());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * 2 * l.num_layers *
                          l.block_bytes());
}

BENCHMARK_CAPTURE(OnePage, llama3_8b, false)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK_CAPTURE(OnePage, tiny, true)->Unit(benchmark::kMicrosecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
