// Copyright mstar-kv authors.
//
// cuda_ipc_bench: pulls one Llama-3-8B request (4096 tokens, scattered
// pages) device-to-device from another process through the cuda_ipc engine,
// and measures, in the same run and on the same GPU:
//   memcpy_d2d    one cudaMemcpyAsync of the request's bytes, contiguous
//                 (the device's copy bandwidth: the ceiling);
//   spans_local   the engine's exact copy plan (same spans, same number of
//                 streams, round-robin) issued with cudaMemcpyAsync from a
//                 local cache (no IPC, no engine);
//   engine_plain  the engine, one cudaMemcpyAsync per span;
//   engine_batch  the engine with cudaMemcpyBatchAsync (CUDA >= 13).
// For a layer-major cache (vLLM's: one span per (layer, k|v, page)) and a
// page-major one (one span per page). Every engine pull is verified once.
//
//   cuda_ipc_bench [--tokens 4096] [--iters 20] [--warmup 3] [--workers 3]
//                  [--json PATH]
//   cuda_ipc_bench --probe      exit 0 with a device, 2 with the reason
// Internal: cuda_ipc_bench --owner --layout ... (the exporting process).
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mstar/kv/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"
#include "testkit/child.hpp"
#include "testkit/seq_line.hpp"

using namespace mstar::kv;
using Clock = std::chrono::steady_clock;

namespace {

constexpr std::uint64_t kSeed = 42;

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
  }
}

KVLayout llama3_8b(std::uint32_t pages, CacheOrder order) {
  KVLayout l;
  l.num_layers = 32;
  l.num_pages = pages;
  l.page_size = 16;
  l.num_kv_heads = 8;
  l.head_dim = 128;
  l.dtype = DType::kBFloat16;
  l.cache_order = order;
  l.page_order = PageOrder::kNHD;
  return l;
}

void upload_pattern(const KVCache& dev, std::span<const std::uint32_t> pages,
                    std::uint64_t tokens) {
  auto host = KVCache::create_host(dev.layout());
  fill_pattern(*host, kSeed, pages, 0, tokens);
  check(cudaMemcpy(dev.base(), host->base(), dev.layout().total_bytes(), cudaMemcpyHostToDevice),
        "upload");
}

// ---- the exporting process -------------------------------------------------

int owner_main(int argc, char** argv) {
  std::uint32_t pages = 0;
  std::uint64_t tokens = 0;
  std::string order = "layer";
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--pages") pages = static_cast<std::uint32_t>(std::stoul(argv[i + 1]));
    if (k == "--tokens") tokens = std::stoull(argv[i + 1]);
    if (k == "--order") order = argv[i + 1];
  }
  try {
    const KVLayout l = llama3_8b(pages, parse_cache_order(order));
    auto cache = make_kv_cache(l, MemoryKind::kDevice, 0);
    KVTransferManager manager(TransferEngineInfo{"prefill", "", "cuda_ipc", {}}, cache);
    KVCachePool pool(cache, manager.get_kv_transfer_info(), /*scatter_seed=*/7);
    const auto p = pool.allocate(1, tokens);
    upload_pattern(*cache, p, tokens);
    std::cout << testkit::seq_line(pool.publish(1)) << std::endl;
    for (std::string line; std::getline(std::cin, line);) {
      if (line == "quit") break;
    }
    manager.cleanup();
  } catch (const std::exception& e) {
    std::cout << "ERR " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

class Owner {
 public:
  Owner(std::uint32_t pages, std::uint64_t tokens, const std::string& order)
      : child_({testkit::self_exe(), "--owner", "--pages", std::to_string(pages), "--tokens",
                std::to_string(tokens), "--order", order},
               {}, /*merge_stderr=*/false) {
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::string line;
      try {
        line = child_.read_line(std::max(left, std::chrono::milliseconds(1)));
      } catch (const Error& e) {
        throw std::runtime_error(std::string("owner did not publish: ") + e.what());
      }
      if (auto seq = testkit::parse_seq_line(line)) {
        seq_ = std::move(*seq);
        return;
      }
      if (line.rfind("ERR ", 0) == 0) throw std::runtime_error("owner: " + line.substr(4));
    }
  }
  ~Owner() {
    // It quits when asked (5 s), else it is killed.
    try {
      child_.write_line("quit");
    } catch (const Error&) {
    }
    child_.wait_exit(std::chrono::seconds(5));
  }
  Owner(const Owner&) = delete;
  Owner& operator=(const Owner&) = delete;
  const SequenceInfo& seq() const { return seq_; }

 private:
  testkit::Child child_;
  SequenceInfo seq_;
};

// ---- measurement -------------------------------------------------------------

struct Result {
  std::string name;
  std::uint64_t bytes = 0;
  std::vector<double> seconds;

  double median() const {
    auto s = seconds;
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  }
  double best() const { return *std::min_element(seconds.begin(), seconds.end()); }
  double gbps(double t) const { return static_cast<double>(bytes) / t / 1e9; }
};

template <typename Fn>
Result measure(const std::string& name, std::uint64_t bytes, int warmup, int iters, Fn&& fn) {
  Result r{name, bytes, {}};
  for (int i = 0; i < warmup; ++i) fn();
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    fn();
    r.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return r;
}

struct Config {
  std::uint64_t tokens = 4096;
  int iters = 20;
  int warmup = 3;
  std::uint32_t workers = 3;
  std::string json;
};

std::vector<Result> run_order(const Config& cfg, const std::string& order, std::ostream& log,
                              std::string* plan_note) {
  const std::uint32_t seq_pages = static_cast<std::uint32_t>((cfg.tokens + 15) / 16);
  const std::uint32_t pages = seq_pages * 2;  // scattered over a cache twice the request
  const KVLayout l = llama3_8b(pages, parse_cache_order(order));
  Owner owner(pages, cfg.tokens, order);
  const SequenceInfo& seq = owner.seq();

  auto local = make_kv_cache(l, MemoryKind::kDevice, 0);
  KVCachePool local_pool(local, {}, /*scatter_seed=*/11);
  const auto lp = local_pool.allocate(1, cfg.tokens);
  const auto reads = plan_reads(l, 0, cfg.tokens, lp, seq.page_indices);
  const CopyPlan plan = plan_copies(l, l, reads);
  *plan_note = order + "-major: " + std::to_string(plan.spans.size()) + " spans (" +
               std::to_string(plan.uncoalesced_spans) + " before coalescing), " +
               std::to_string(plan.total_bytes) + " bytes";
  log << "== " << *plan_note << std::endl;

  std::vector<Result> results;
  // Ceiling: the same bytes, one contiguous copy.
  {
    void* a = nullptr;
    void* b = nullptr;
    check(cudaMalloc(&a, plan.total_bytes), "cudaMalloc");
    check(cudaMalloc(&b, plan.total_bytes), "cudaMalloc");
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    results.push_back(measure(order + "/memcpy_d2d", plan.total_bytes, cfg.warmup, cfg.iters, [&] {
      check(cudaMemcpyAsync(b, a, plan.total_bytes, cudaMemcpyDeviceToDevice, s), "memcpy");
      check(cudaStreamSynchronize(s), "sync");
    }));
    check(cudaStreamDestroy(s), "stream destroy");
    check(cudaFree(a), "free");
    check(cudaFree(b), "free");
  }
  // The engine's spans, no engine, no IPC: a local source cache.
  {
    auto src = make_kv_cache(l, MemoryKind::kDevice, 0);
    std::vector<cudaStream_t> streams(cfg.workers);
    for (auto& s : streams) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
    results.push_back(
        measure(order + "/spans_local", plan.total_bytes, cfg.warmup, cfg.iters, [&] {
          const std::size_t n = std::min<std::size_t>(streams.size(), plan.spans.size());
          for (std::size_t i = 0; i < plan.spans.size(); ++i) {
            const CopySpan& c = plan.spans[i];
            check(cudaMemcpyAsync(local->base() + c.local_offset, src->base() + c.remote_offset,
                                  c.length, cudaMemcpyDeviceToDevice, streams[i % n]),
                  "memcpy");
          }
          for (auto s : streams) check(cudaStreamSynchronize(s), "sync");
        }));
    for (auto s : streams) check(cudaStreamDestroy(s), "stream destroy");
  }
  // The engine, both copy paths, each verified once.
  for (const char* batch : {"0", "1"}) {
    check(cudaMemset(local->base(), 0, l.total_bytes()), "memset");
    check(cudaDeviceSynchronize(), "sync");
    EngineOptions o;
    o.max_workers = cfg.workers;
    o.timeout = std::chrono::seconds(60);
    o.extra["cuda_ipc_batch"] = batch;
    CudaIpcKVTransferEngine engine(local, o);
    const std::string name = order + (batch[0] == '1' ? "/engine_batch" : "/engine_plain");
    results.push_back(measure(name, plan.total_bytes, cfg.warmup, cfg.iters, [&] {
      auto f = engine.read_batched_async(seq.kv_transfer_info, reads);
      if (!f || f->get() != plan.total_bytes) throw std::runtime_error(name + ": short read");
    }));
    auto host = KVCache::create_host(l);
    check(cudaMemcpy(host->base(), local->base(), l.total_bytes(), cudaMemcpyDeviceToHost), "d2h");
    const VerifyResult v = verify_pattern(*host, kSeed, lp, 0, cfg.tokens);
    if (!v.ok()) throw std::runtime_error(name + " delivered wrong bytes: " + v.first_mismatch);
    log << "   " << name << ": verified " << v.bytes_checked << " bytes" << std::endl;
    engine.shutdown();
  }
  return results;
}

int bench_main(const Config& cfg) {
  const std::string why = cuda_unavailable_reason();
  if (!why.empty()) {
    std::cerr << "cuda_ipc_bench: no CUDA device visible: " << why << std::endl;
    return 2;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  int runtime = 0;
  int driver = 0;
  check(cudaRuntimeGetVersion(&runtime), "runtime version");
  check(cudaDriverGetVersion(&driver), "driver version");
  std::cout << "device 0: " << prop.name << ", CUDA runtime " << runtime << ", driver " << driver
            << std::endl;
  std::cout << "request: Llama-3-8B (32 layers, 8 KV heads x 128, bf16, 16-token pages), "
            << cfg.tokens << " tokens, scattered pages; " << cfg.workers << " streams; "
            << cfg.iters << " timed pulls after " << cfg.warmup << " warm-up" << std::endl;
  std::vector<Result> all;
  std::vector<std::string> notes;
  for (const char* order : {"layer", "page"}) {
    std::string note;
    auto r = run_order(cfg, order, std::cout, &note);
    notes.push_back(note);
    all.insert(all.end(), r.begin(), r.end());
  }
  std::printf("\n%-22s %14s %12s %12s %12s\n", "case", "bytes", "median ms", "GB/s (med)",
              "GB/s (best)");
  for (const auto& r : all) {
    std::printf("%-22s %14llu %12.3f %12.1f %12.1f\n", r.name.c_str(),
                static_cast<unsigned long long>(r.bytes), r.median() * 1e3, r.gbps(r.median()),
                r.gbps(r.best()));
  }
  if (!cfg.json.empty()) {
    std::ofstream j(cfg.json);
    j << "{\n  \"device\": \"" << prop.name << "\",\n  \"cuda_runtime\": " << runtime
      << ",\n  \"cuda_driver\": " << driver << ",\n  \"tokens\": " << cfg.tokens
      << ",\n  \"streams\": " << cfg.workers << ",\n  \"iters\": " << cfg.iters
      << ",\n  \"plans\": [";
    for (std::size_t i = 0; i < notes.size(); ++i) j << (i ? ", " : "") << "\"" << notes[i] << "\"";
    j << "],\n  \"results\": [\n";
    for (std::size_t i = 0; i < all.size(); ++i) {
      const auto& r = all[i];
      j << "    {\"case\": \"" << r.name << "\", \"bytes\": " << r.bytes
        << ", \"median_ms\": " << r.median() * 1e3 << ", \"gbps_median\": " << r.gbps(r.median())
        << ", \"gbps_best\": " << r.gbps(r.best()) << "}" << (i + 1 < all.size() ? "," : "")
        << "\n";
    }
    j << "  ]\n}\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--owner") return owner_main(argc, argv);
  Config cfg;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--probe") {
      const std::string why = cuda_unavailable_reason();
      if (!why.empty()) {
        std::cerr << "no CUDA device visible: " << why << std::endl;
        return 2;
      }
      int n = 0;
      cudaGetDeviceCount(&n);
      std::cout << n << " CUDA device(s) visible" << std::endl;
      return 0;
    }
    if (i + 1 >= argc) {
      std::cerr << "missing value for " << k << std::endl;
      return 64;
    }
    const std::string v = argv[++i];
    if (k == "--tokens") cfg.tokens = std::stoull(v);
    else if (k == "--iters") cfg.iters = std::max(1, std::stoi(v));
    else if (k == "--warmup") cfg.warmup = std::max(0, std::stoi(v));
    else if (k == "--workers") cfg.workers = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--json") cfg.json = v;
    else {
      std::cerr << "unknown option " << k << std::endl;
      return 64;
    }
  }
  try {
    return bench_main(cfg);
  } catch (const std::exception& e) {
    std::cerr << "cuda_ipc_bench: " << e.what() << std::endl;
    return 1;
  }
}
