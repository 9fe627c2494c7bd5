// Copyright mstar-kv authors.
//
// cuda_ipc_bench: pulls one Llama-3-8B request (4096 tokens, scattered
// pages) device-to-device from another process through the cuda_ipc engine,
// with the copy kernel and with the per-span memcpy path, and measures each,
// in the same run and on the same GPU, against
//   memcpy_d2d    one cudaMemcpyAsync of the same number of bytes,
//                 contiguous (the device's copy bandwidth: the ceiling).
// Cases (the owner always holds all 8 KV heads in 16-token pages):
//   layer         layer-major NHD -> layer-major NHD (16,384 spans of 32 KiB)
//   page          page-major NHD -> page-major NHD (256 spans of 2 MiB)
//   layer_page    layer_page NHD -> layer_page NHD (upstream mstar's
//                 [L, P, 2, T, H, D]: one span per (layer, page))
//   nhd_hnd       layer-major HND owner -> layer-major NHD reader
//   tp1_2         layer-major NHD owner -> a TP rank holding heads 4-8
// Per engine run: the median of the timed pulls (GB/s, ratio to
// memcpy_d2d), the CPU time of read_batched_async per read (the post:
// planning, the span table, enqueuing) and the process CPU time per read
// (every thread, the completion thread's polling included). Every engine
// pull is verified once against the pattern.
//
//   cuda_ipc_bench [--tokens 4096] [--iters 5] [--warmup 2] [--workers 3]
//                  [--cases layer,page,layer_page,nhd_hnd,tp1_2] [--json PATH]
//   cuda_ipc_bench --probe      exit 0 with a device, 2 with the reason
// Internal: cuda_ipc_bench --owner --pages N --tokens T --order O --hnd B
// (the exporting process).
#include <cuda_runtime_api.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
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

#include "mstar/kv/engines/cuda_ipc.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "toolkit/child.hpp"
#include "toolkit/seq_line.hpp"

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

KVLayout llama3_8b(std::uint32_t pages, CacheOrder order, PageOrder po = PageOrder::kNHD) {
  KVLayout l;
  l.num_layers = 32;
  l.num_pages = pages;
  l.page_size = 16;
  l.num_kv_heads = 8;
  l.head_dim = 128;
  l.dtype = DType::kBFloat16;
  l.cache_order = order;
  l.page_order = po;
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
  bool hnd = false;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--pages") pages = static_cast<std::uint32_t>(std::stoul(argv[i + 1]));
    if (k == "--tokens") tokens = std::stoull(argv[i + 1]);
    if (k == "--order") order = argv[i + 1];
    if (k == "--hnd") hnd = std::string(argv[i + 1]) == "1";
  }
  try {
    const KVLayout l =
        llama3_8b(pages, parse_cache_order(order), hnd ? PageOrder::kHND : PageOrder::kNHD);
    auto cache = make_kv_cache(l, MemoryKind::kDevice, 0);
    KVTransferManager manager(TransferEngineInfo{"prefill", "", "cuda_ipc", {}}, cache);
    KVCachePool pool(cache, manager.get_kv_transfer_info(), /*scatter_seed=*/7);
    const auto p = pool.allocate(1, tokens);
    upload_pattern(*cache, p, tokens);
    std::cout << toolkit::seq_line(pool.publish(1)) << std::endl;
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
  Owner(std::uint32_t pages, std::uint64_t tokens, const std::string& order, bool hnd)
      : child_({toolkit::self_exe(), "--owner", "--pages", std::to_string(pages), "--tokens",
                std::to_string(tokens), "--order", order, "--hnd", hnd ? "1" : "0"},
               {}, /*merge_stderr=*/false) {
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    for (;;) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::string line;
      try {
        line = child_.read_line(std::max(left, std::chrono::milliseconds(1)));
      } catch (const Error& e) {
        throw std::runtime_error(std::string("owner did not publish: ") + e.what());
      }
      if (auto seq = toolkit::parse_seq_line(line)) {
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
  toolkit::Child child_;
  SequenceInfo seq_;
};

// ---- measurement -------------------------------------------------------------

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double process_cpu_s() {
  rusage ru{};
  getrusage(RUSAGE_SELF, &ru);
  const auto tv = [](const timeval& t) {
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_usec) * 1e-6;
  };
  return tv(ru.ru_utime) + tv(ru.ru_stime);
}

struct Result {
  std::string name;
  std::uint64_t bytes = 0;
  std::vector<double> seconds;
  std::vector<double> post_cpu;  // read_batched_async's thread CPU, per read
  std::vector<double> proc_cpu;  // the process's CPU over the pull, per read
  double gbps() const { return static_cast<double>(bytes) / median(seconds) / 1e9; }
};

struct Config {
  std::uint64_t tokens = 4096;
  int iters = 5;
  int warmup = 2;
  std::uint32_t workers = 3;
  std::string cases = "layer,page,layer_page,nhd_hnd,tp1_2";
  std::string json;
};

// One contiguous copy of `bytes` device to device: the ceiling.
Result memcpy_d2d(const std::string& name, std::uint64_t bytes, const Config& cfg) {
  void* a = nullptr;
  void* b = nullptr;
  check(cudaMalloc(&a, bytes), "cudaMalloc");
  check(cudaMalloc(&b, bytes), "cudaMalloc");
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  Result r{name, bytes, {}, {}, {}};
  for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
    const auto t0 = Clock::now();
    check(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "memcpy");
    check(cudaStreamSynchronize(s), "sync");
    if (i >= cfg.warmup)
      r.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  check(cudaStreamDestroy(s), "stream destroy");
  check(cudaFree(a), "free");
  check(cudaFree(b), "free");
  return r;
}

// The engine on one copy path: timed pulls, then one verified.
Result engine_pulls(const std::string& name, const std::string& path,
                    const std::shared_ptr<KVCache>& local, const SequenceInfo& seq,
                    const std::vector<KVReadInfo>& reads, std::span<const std::uint32_t> lp,
                    std::uint64_t bytes, const Config& cfg, std::ostream& log) {
  check(cudaMemset(local->base(), 0, local->layout().total_bytes()), "memset");
  check(cudaDeviceSynchronize(), "sync");
  EngineOptions o;
  o.max_workers = cfg.workers;
  o.timeout = std::chrono::seconds(60);
  o.extra["cuda_ipc_copy"] = path;
  CudaIpcKVTransferEngine engine(local, o);
  const RemoteHandle remote = engine.open_remote(seq.kv_transfer_info);
  Result r{name, bytes, {}, {}, {}};
  for (int i = 0; i < cfg.warmup + cfg.iters; ++i) {
    const auto t0 = Clock::now();
    const double p0 = process_cpu_s();
    const double c0 = thread_cpu_s();
    auto f = engine.read_batched_async(*remote, reads);
    const double c1 = thread_cpu_s();
    if (!f || f->get() != bytes) throw std::runtime_error(name + ": short read");
    const double p1 = process_cpu_s();
    if (i < cfg.warmup) continue;
    r.seconds.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    r.post_cpu.push_back(c1 - c0);
    r.proc_cpu.push_back(p1 - p0);
  }
  auto host = KVCache::create_host(local->layout());
  check(cudaMemcpy(host->base(), local->base(), local->layout().total_bytes(),
                   cudaMemcpyDeviceToHost),
        "d2h");
  const VerifyResult v = verify_pattern(*host, kSeed, lp, 0, cfg.tokens);
  if (!v.ok()) throw std::runtime_error(name + " delivered wrong bytes: " + v.first_mismatch);
  log << "   " << name << ": verified " << v.bytes_checked << " bytes" << std::endl;
  engine.shutdown();
  return r;
}

struct CaseResult {
  std::string name;
  std::string plan;
  Result base;
  std::vector<Result> engine;  // kernel, memcpy
};

// One case: the owner's layout, the reader's, and both copy paths.
CaseResult run_case(const Config& cfg, const std::string& name, std::ostream& log) {
  const std::uint32_t seq_pages = static_cast<std::uint32_t>((cfg.tokens + 15) / 16);
  const std::uint32_t pages = seq_pages * 2;  // scattered over a cache twice the request
  const std::string order_name = name == "page" || name == "layer_page" ? name : "layer";
  const CacheOrder order = parse_cache_order(order_name);
  const bool owner_hnd = name == "nhd_hnd";
  const KVLayout remote = llama3_8b(pages, order, owner_hnd ? PageOrder::kHND : PageOrder::kNHD);
  KVLayout l = llama3_8b(pages, order);
  if (name == "tp1_2") {  // rank 1 of TP=2: heads 4-8 of 8
    l.num_kv_heads = 4;
    l.first_kv_head = 4;
    l.total_kv_heads = 8;
  }
  Owner owner(pages, cfg.tokens, order_name, owner_hnd);
  const SequenceInfo& seq = owner.seq();
  auto local = make_kv_cache(l, MemoryKind::kDevice, 0);
  KVCachePool local_pool(local, {}, /*scatter_seed=*/11);
  const auto lp = local_pool.allocate(1, cfg.tokens);
  const auto reads = plan_reads(l, remote, 0, cfg.tokens, lp, seq.page_indices);
  const StridedPlan plan = plan_strided_copies(l, remote, reads);
  std::uint64_t strided = 0;
  for (const StridedSpan& s : plan.spans) strided += s.rows > 1;
  CaseResult c{name,
               name + ": " + std::to_string(plan.spans.size()) + " spans (" +
                   std::to_string(strided) + " strided, " + std::to_string(plan.uncoalesced_spans) +
                   " rows), " + std::to_string(plan.total_bytes) + " bytes",
               {},
               {}};
  log << "== " << c.plan << std::endl;
  c.base = memcpy_d2d(name + "/memcpy_d2d", plan.total_bytes, cfg);
  for (const char* path : {"kernel", "memcpy"}) {
    c.engine.push_back(engine_pulls(name + "/engine_" + path, path, local, seq, reads, lp,
                                    plan.total_bytes, cfg, log));
  }
  return c;
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
            << cfg.tokens << " tokens, scattered pages; " << cfg.workers << " streams; medians of "
            << cfg.iters << " timed pulls after " << cfg.warmup << " warm-up" << std::endl;
  std::vector<CaseResult> all;
  std::stringstream names(cfg.cases);
  for (std::string name; std::getline(names, name, ',');) {
    if (name != "layer" && name != "page" && name != "layer_page" && name != "nhd_hnd" &&
        name != "tp1_2") {
      throw std::runtime_error("unknown case '" + name +
                               "' (layer, page, layer_page, nhd_hnd, tp1_2)");
    }
    all.push_back(run_case(cfg, name, std::cout));
  }
  std::printf("\n%-22s %12s %10s %10s %8s %14s %14s\n", "case", "bytes", "median ms", "GB/s",
              "ratio", "post CPU us", "proc CPU us");
  for (const CaseResult& c : all) {
    std::printf("%-22s %12llu %10.3f %10.1f %8s %14s %14s\n", c.base.name.c_str(),
                static_cast<unsigned long long>(c.base.bytes), median(c.base.seconds) * 1e3,
                c.base.gbps(), "1", "-", "-");
    for (const Result& r : c.engine) {
      std::printf("%-22s %12llu %10.3f %10.1f %8.3f %14.1f %14.1f\n", r.name.c_str(),
                  static_cast<unsigned long long>(r.bytes), median(r.seconds) * 1e3, r.gbps(),
                  r.gbps() / c.base.gbps(), median(r.post_cpu) * 1e6, median(r.proc_cpu) * 1e6);
    }
  }
  if (!cfg.json.empty()) {
    std::ofstream j(cfg.json);
    j << "{\n  \"device\": \"" << prop.name << "\",\n  \"cuda_runtime\": " << runtime
      << ",\n  \"cuda_driver\": " << driver << ",\n  \"tokens\": " << cfg.tokens
      << ",\n  \"streams\": " << cfg.workers << ",\n  \"iters\": " << cfg.iters
      << ",\n  \"cases\": [\n";
    for (std::size_t i = 0; i < all.size(); ++i) {
      const CaseResult& c = all[i];
      j << "    {\"case\": \"" << c.name << "\", \"plan\": \"" << c.plan
        << "\", \"bytes\": " << c.base.bytes << ", \"memcpy_d2d_gbps\": " << c.base.gbps()
        << ", \"engine\": [";
      for (std::size_t k = 0; k < c.engine.size(); ++k) {
        const Result& r = c.engine[k];
        j << (k ? ", " : "") << "{\"name\": \"" << r.name
          << "\", \"median_ms\": " << median(r.seconds) * 1e3 << ", \"gbps\": " << r.gbps()
          << ", \"ratio_to_memcpy_d2d\": " << r.gbps() / c.base.gbps()
          << ", \"post_cpu_us\": " << median(r.post_cpu) * 1e6
          << ", \"process_cpu_us\": " << median(r.proc_cpu) * 1e6 << "}";
      }
      j << "]}" << (i + 1 < all.size() ? "," : "") << "\n";
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
    if (k == "--tokens")
      cfg.tokens = std::stoull(v);
    else if (k == "--cases")
      cfg.cases = v;
    else if (k == "--iters")
      cfg.iters = std::max(1, std::stoi(v));
    else if (k == "--warmup")
      cfg.warmup = std::max(0, std::stoi(v));
    else if (k == "--workers")
      cfg.workers = static_cast<std::uint32_t>(std::stoul(v));
    else if (k == "--json")
      cfg.json = v;
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
