// Copyright mstar-kv authors.
//
// `mstar-kv demo`: a prefill process hands a request's KV cache to a decode
// process on the same host. The command starts both roles as child processes
// of itself (`demo --role prefill|decode`), connected by a socketpair that
// carries only SequenceInfo bytes, watches them, and stops the other when one
// fails, so nothing is left behind.
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "demo_layerwise.hpp"
#include "demo_proc.hpp"
#include "layout_args.hpp"
#include "mstar/kv/kv.hpp"
#include "toolkit/child.hpp"
#include "toolkit/span_copy.hpp"
#if MSTAR_KV_DEMO_SHM
#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/testing/pattern.hpp"
#endif

namespace mstar::kv::cli {

namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kSeedFull = 0x5eed0001;
constexpr std::uint64_t kSeedPrefix = 0x5eed0002;
constexpr std::byte kSentinel{0xA5};

const char* kDemoHelp =
    "usage: mstar-kv demo [options]\n"
    "\n"
    "Starts a prefill process and a decode process. The prefill fills two requests'\n"
    "KV with a deterministic pattern and publishes them; the decode process pulls\n"
    "request 1 whole and request 2 with a prefix already cached locally (only the\n"
    "tail moves), verifies every page, and compares the pull with a copy of the\n"
    "same bytes in the same run (the fastest this machine copies them: memcpy or\n"
    "non-temporal stores, on each thread count up to the cores, threads started and\n"
    "pages touched before timing).\n"
    "\n"
    "options:\n"
    "  --tokens N          tokens per request (default 4096)\n"
    "  --scatter           pages scattered in both pools (default)\n"
    "  --contiguous        pages in ascending order in both pools\n"
    "  --workers N         engine copy threads (default: the hardware threads)\n"
    "  --engine NAME       transfer engine (default shm; see `mstar-kv info`)\n"
    "  --repeat N          timed pulls of request 1 (default 5); the median leaves out\n"
    "                      the first, which also opens the peer's memory\n"
    "  --prefix-hit F      fraction of request 2 cached locally (default 0.75)\n"
    "  --timeout-ms N      engine timeout per read and channel timeout (default 30000)\n"
    "  --seed N            scatter seed (default 7)\n"
    "  a prefill cache of another geometry than the decode one (the layout flags\n"
    "  below describe the decode side; the baseline then copies the same bytes\n"
    "  contiguously):\n"
    "  --remote-page-size N --remote-page-order O --remote-cache-order O\n"
    "  --remote-tp M --local-tp N --local-rank R   decode rank R of TP=N reads its\n"
    "                      KV heads from the TP=M prefill rank that holds them (M <= N)\n"
    "  --layerwise         layer-wise streaming instead: the prefill writes each layer,\n"
    "                      sleeps --prefill-ms-per-layer, then marks it ready; the decode\n"
    "                      streams it (even rounds) or pulls after the prefill (odd rounds,\n"
    "                      the baseline); --repeat rounds of each; prints both end times and\n"
    "                      the fraction of the transfer hidden under compute\n"
    "  --prefill-ms-per-layer X  the prefill's compute per layer with --layerwise (default 1)\n"
    "  --mooncake-lib PATH Mooncake's libtransfer_engine.so for --engine mooncake\n"
    "                      (default: $MSTAR_KV_MOONCAKE_LIB, else the loader's search path)\n";

struct DemoConfig {
  KVLayout layout;          // the decode cache's
  KVLayout prefill_layout;  // the prefill cache's (another geometry with --remote-*)
  std::uint64_t tokens = 4096;
  bool scatter = true;
  std::uint32_t workers = 1;  // parse(): the hardware threads unless --workers
  std::string engine = "shm";
  std::uint32_t repeat = 5;
  double prefix_hit = 0.75;
  std::chrono::milliseconds timeout{30000};
  std::uint64_t scatter_seed = 7;
  std::string role;  // "", "prefill", "decode"
  int fd = -1;
  std::string crash;         // test hook: this role kills itself mid-way
  std::string mooncake_lib;  // EngineOptions.extra["mooncake_lib"] when set
  bool layerwise = false;
  double ms_per_layer = 1.0;
};

std::set<std::string> demo_flags() { return {"help", "scatter", "contiguous", "layerwise"}; }

std::set<std::string> demo_options() {
  auto o = layout_options();
  for (const char* s :
       {"tokens", "workers", "engine", "repeat", "prefix-hit", "timeout-ms", "seed", "role", "fd",
        "crash", "mooncake-lib", "remote-page-size", "remote-page-order", "remote-cache-order",
        "remote-tp", "local-tp", "local-rank", "prefill-ms-per-layer"}) {
    o.insert(s);
  }
  return o;
}

[[noreturn]] void bad(const std::string& msg) { throw Error(StatusCode::kInvalidArgument, msg); }

DemoConfig parse(const Args& args) {
  DemoConfig c;
  if (!args.positional().empty()) bad("unexpected argument '" + args.positional()[0] + "'");
  if (args.flag("scatter") && args.flag("contiguous")) {
    bad("--scatter and --contiguous exclude each other");
  }
  c.scatter = !args.flag("contiguous");
  c.tokens = args.u64("tokens", 4096);
  if (c.tokens == 0 || c.tokens > (1u << 24)) {
    bad("--tokens " + std::to_string(c.tokens) + " out of range [1, 16777216]");
  }
  // The default follows the cores, within the limit --workers has.
  const std::uint64_t w = args.u64("workers", std::min(toolkit::hardware_threads(), 256u));
  if (w == 0 || w > 256) bad("--workers " + std::to_string(w) + " out of range [1, 256]");
  c.workers = static_cast<std::uint32_t>(w);
  c.engine = args.str("engine", "shm");
  const std::uint64_t r = args.u64("repeat", 5);
  if (r == 0 || r > 1000) bad("--repeat " + std::to_string(r) + " out of range [1, 1000]");
  c.repeat = static_cast<std::uint32_t>(r);
  c.prefix_hit = args.f64("prefix-hit", 0.75);
  if (!(c.prefix_hit >= 0.0 && c.prefix_hit < 1.0)) {
    bad("--prefix-hit " + args.str("prefix-hit", "") + " out of range [0, 1)");
  }
  const std::uint64_t t = args.u64("timeout-ms", 30000);
  if (t == 0 || t > 3600000)
    bad("--timeout-ms " + std::to_string(t) + " out of range [1, 3600000]");
  c.timeout = std::chrono::milliseconds(t);
  c.scatter_seed = args.u64("seed", 7);
  if (c.scatter_seed == 0) bad("--seed must be > 0");
  c.role = args.str("role", "");
  if (!c.role.empty() && c.role != "prefill" && c.role != "decode") {
    bad("--role '" + c.role + "' must be prefill or decode");
  }
  c.fd = static_cast<int>(args.u64("fd", 3));
  c.crash = args.str("crash", "");
  c.mooncake_lib = args.str("mooncake-lib", "");
  c.layerwise = args.flag("layerwise");
  c.ms_per_layer = args.f64("prefill-ms-per-layer", 1.0);
  if (!(c.ms_per_layer >= 0.0 && c.ms_per_layer <= 10000.0)) {
    bad("--prefill-ms-per-layer " + args.str("prefill-ms-per-layer", "") +
        " out of range [0, 10000]");
  }
  if (!c.layerwise && args.has("prefill-ms-per-layer")) {
    bad("--prefill-ms-per-layer needs --layerwise");
  }
  // Each pool holds both requests, plus slack so that scattered pages spread.
  KVLayout probe = layout_from_args(args, 1);
  const std::uint64_t per_request = (c.tokens + probe.page_size - 1) / probe.page_size;
  const std::uint64_t pages = 2 * per_request + per_request / 8 + 8;
  if (pages > LayoutLimits::kMaxPages) {
    bad("--tokens " + std::to_string(c.tokens) + " needs " + std::to_string(pages) +
        " pages, limit " + std::to_string(LayoutLimits::kMaxPages));
  }
  c.layout = layout_from_args(args, static_cast<std::uint32_t>(pages));
  if (c.layout.num_pages < 2 * per_request) {
    bad("--pages " + std::to_string(c.layout.num_pages) + " cannot hold two requests of " +
        std::to_string(per_request) + " pages");
  }
  // The prefill side in another geometry (caches of different geometry).
  c.prefill_layout = c.layout;
  if (args.has("remote-page-order")) {
    c.prefill_layout.page_order = parse_page_order(args.str("remote-page-order", ""));
  }
  if (args.has("remote-cache-order")) {
    c.prefill_layout.cache_order = parse_cache_order(args.str("remote-cache-order", ""));
  }
  const Geometry g = geometry_from_args(args);
  apply_geometry(c.layout, c.prefill_layout, g, c.tokens);
  if (g.remote_page_size != 0) {
    const std::uint64_t rp = (c.tokens + g.remote_page_size - 1) / g.remote_page_size;
    c.prefill_layout.num_pages = static_cast<std::uint32_t>(2 * rp + rp / 8 + 8);
    c.prefill_layout.validate();
  }
  return c;
}

MemoryKind memory_for(const std::string& engine) {
  const auto t = find_engine(engine);
  if (!t) return MemoryKind::kHost;  // run_parent refuses it, naming the built engines
  if (t->memory == MemoryKind::kDevice) {
    bad("the demo fills and verifies caches on the host; engine '" + engine +
        "' keeps them on a device (use `mstar-kv bench`)");
  }
  return t->memory;
}

TransferEngineInfo engine_info(const DemoConfig& c, const char* entity) {
  EngineOptions o;
  o.max_workers = c.workers;
  o.timeout = c.timeout;
  if (!c.mooncake_lib.empty()) o.extra["mooncake_lib"] = c.mooncake_lib;
  return TransferEngineInfo{entity, "demo-" + std::to_string(::getppid()), c.engine, o};
}

std::string gib(std::uint64_t b) {
  char s[32];
  if (b >= (1ull << 30)) {
    std::snprintf(s, sizeof s, "%.2f GiB", static_cast<double>(b) / (1ull << 30));
  } else {
    std::snprintf(s, sizeof s, "%.1f MiB", static_cast<double>(b) / (1ull << 20));
  }
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double gbps(std::uint64_t bytes, double seconds) {
  return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0;
}

void kill_self_now(const char* role) {
  std::fprintf(stderr, "[%s] --crash %s: killing myself with SIGKILL\n", role, role);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}

// ---- prefill ---------------------------------------------------------------

int run_prefill(const DemoConfig& c) {
  auto cache = make_kv_cache(c.prefill_layout, memory_for(c.engine));
  KVTransferManager manager(engine_info(c, "prefill"), cache);
  KVCachePool pool(cache, manager.get_kv_transfer_info(), c.scatter ? c.scatter_seed : 0);
  const auto p1 = pool.allocate(1, c.tokens);
  const auto p2 = pool.allocate(2, c.tokens);
  const auto t0 = Clock::now();
  fill_pattern(*cache, kSeedFull, p1, 0, c.tokens);
  fill_pattern(*cache, kSeedPrefix, p2, 0, c.tokens);
  const double fill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  demo::write_frame(c.fd, pool.publish(1).encode());
  demo::write_frame(c.fd, pool.publish(2).encode());
  std::printf(
      "[prefill] pid %d: %s cache of %s (%s), 2 requests x %zu pages %s, "
      "filled in %.2f s, published\n",
      ::getpid(), c.engine.c_str(), gib(c.prefill_layout.total_bytes()).c_str(),
      cache->memory_kind() == MemoryKind::kSharedHost ? "shared memfd" : "private", p1.size(),
      c.scatter ? "scattered" : "contiguous", fill_s);
  std::fflush(stdout);
  if (c.crash == "prefill") kill_self_now("prefill");
  // Keep the cache alive until the decode side says it is done.
  const std::uint8_t done = demo::read_byte(c.fd, c.timeout * (2 * c.repeat + 8), "decode");
  if (done != 'D') bad("unexpected byte from the decode process");
  pool.release(1);
  pool.release(2);
  manager.cleanup();
  return 0;
}

// ---- decode ----------------------------------------------------------------

SequenceInfo receive(const DemoConfig& c) {
  // Untrusted bytes: decode validates the frame, checksum and every field.
  return SequenceInfo::decode(demo::read_frame(c.fd, c.timeout, "prefill"));
}

void fill_sentinel(const KVCache& cache, std::span<const std::uint32_t> pages) {
  const KVLayout& l = cache.layout();
  for (std::uint32_t p : pages) {
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
        auto b = cache.block(layer, static_cast<KV>(kv), p);
        std::memset(b.data(), static_cast<int>(kSentinel), b.size());
      }
    }
  }
}

void expect_verified(const KVCache& cache, std::uint64_t seed, std::span<const std::uint32_t> pages,
                     std::uint64_t start, std::uint64_t end, const char* what) {
  const VerifyResult v = verify_pattern(cache, seed, pages, start, end);
  if (!v.ok()) {
    throw Error(StatusCode::kInternal, std::string(what) + ": " +
                                           std::to_string(v.mismatched_blocks) + " of " +
                                           std::to_string(v.blocks_checked) +
                                           " blocks differ, first: " + v.first_mismatch);
  }
}

// The source of the memcpy baseline: the peer's real memory where it can be
// mapped here (shm), else a private copy of the same layout.
struct BaselineSource {
  const std::byte* data = nullptr;
  KVLayout layout;
  std::string what;
  bool peer_memory = false;                 // true: data is the prefill's own cache
  std::shared_ptr<const std::byte> mapped;  // the prefill's memory (shm)
  std::shared_ptr<KVCache> private_copy;
};

BaselineSource baseline_source(const DemoConfig& c, const KVTransferInfo& info) {
  BaselineSource b;
#if MSTAR_KV_DEMO_SHM
  if (const auto t = find_engine(info.engine); t && t->host_readable) {
    ShmCacheView view = map_shm_cache(info);
    b.data = view.data.get();
    b.layout = view.layout;
    b.mapped = std::move(view.data);
    b.what = "from the prefill's mapped memory";
    b.peer_memory = true;
    return b;
  }
#else
  (void)info;
#endif
  b.layout = c.prefill_layout;  // both roles were started with the same flags
  b.private_copy = KVCache::create_host(b.layout);
  std::memset(b.private_copy->base(), 1, b.layout.total_bytes());  // fault it in
  b.data = b.private_copy->base();
  b.what = "from a private buffer of the same layout";
  return b;
}

int run_decode(const DemoConfig& c) {
  const SequenceInfo s1 = receive(c);
  const SequenceInfo s2 = receive(c);
  if (c.crash == "decode") kill_self_now("decode");
  auto cache = make_kv_cache(c.layout, memory_for(c.engine));
  KVTransferManager manager(engine_info(c, "decode"), cache);
  // A different scatter seed: the two sides' page tables differ.
  KVCachePool pool(cache, manager.get_kv_transfer_info(), c.scatter ? c.scatter_seed * 31 + 1 : 0);

  // Request 1: the whole sequence, `repeat` times, each pull followed by the
  // baseline: the same spans copied every way (memcpy and non-temporal
  // stores on 1..cores threads), the fastest kept; its threads started and
  // both sides' pages touched before the first, so that it pays no start-up
  // the pulls do not. Taking turns keeps both under the same conditions on a
  // busy machine.
  const auto l1 = pool.allocate(1, s1.num_tokens);
  BaselineSource src = baseline_source(c, s1.kv_transfer_info);
  const CopyPlan planned =
      plan_copies(c.layout, src.layout,
                  plan_reads(c.layout, src.layout, 0, s1.num_tokens, l1, s1.page_indices));
  // Between caches of different geometry the baseline copies the same bytes
  // laid out contiguously: what the conversion costs against moving them.
  const bool mixed =
      !c.layout.same_geometry(src.layout) || c.layout.page_order != src.layout.page_order;
  CopyPlan plan = planned;
  if (mixed) plan.spans = {{0, 0, planned.total_bytes}};
  toolkit::BestCopy best(plan.spans, toolkit::hardware_threads());
  best.warm(cache->base(), src.data);
  std::vector<double> pull_s;
  std::vector<double> base_s;
  std::uint64_t bytes1 = 0;
  for (std::uint32_t r = 0; r < c.repeat; ++r) {
    fill_sentinel(*cache, l1);
    const auto t0 = Clock::now();
    auto f =
        manager.start_async_retrieve(0, s1.num_tokens, l1, s1.page_indices, s1.kv_transfer_info);
    bytes1 = f ? f->get() : 0;
    pull_s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    expect_verified(*cache, kSeedFull, l1, 0, s1.num_tokens, "request 1 after the pull");
    fill_sentinel(*cache, l1);
    base_s.push_back(best.run_each(cache->base(), src.data));
    if (src.peer_memory && !mixed) {
      expect_verified(*cache, kSeedFull, l1, 0, s1.num_tokens, "memcpy baseline");
    }
  }

  // Request 2: a prefix is already cached here; only the tail moves.
  const auto l2 = pool.allocate(2, s2.num_tokens);
  const auto prefix =
      static_cast<std::uint64_t>(std::floor(static_cast<double>(s2.num_tokens) * c.prefix_hit));
  fill_sentinel(*cache, l2);
  fill_pattern(*cache, kSeedPrefix, l2, 0, prefix);  // the local prefix cache
  const auto t2 = Clock::now();
  auto f2 =
      manager.start_async_retrieve(prefix, s2.num_tokens, l2, s2.page_indices, s2.kv_transfer_info);
  const std::uint64_t bytes2 = f2 ? f2->get() : 0;
  const double tail_s = std::chrono::duration<double>(Clock::now() - t2).count();
  expect_verified(*cache, kSeedPrefix, l2, 0, s2.num_tokens, "request 2 (prefix + tail)");

  // The first pull also opens and maps the peer's memory (the baseline's
  // mapping was opened before timing): compare the steady state.
  const std::size_t skip = pull_s.size() > 1 ? 1 : 0;
  const double pull_med = median({pull_s.begin() + skip, pull_s.end()});
  const double base_med = median({base_s.begin() + skip, base_s.end()});
  // The last pull's bytes were overwritten by the baseline: pull once more.
  fill_sentinel(*cache, l1);
  manager.sync_retrieve(0, s1.num_tokens, l1, s1.page_indices, s1.kv_transfer_info);
  const VerifyResult v1 = verify_pattern(*cache, kSeedFull, l1, 0, s1.num_tokens);
  if (!v1.ok()) throw Error(StatusCode::kInternal, "request 1: " + v1.first_mismatch);
  std::printf("[decode]  pid %d: pulled with engine '%s', %u workers\n", ::getpid(),
              c.engine.c_str(), c.workers);
  std::printf("request 1: %llu tokens, %zu pages %s, full pull\n",
              static_cast<unsigned long long>(s1.num_tokens), l1.size(),
              c.scatter ? "scattered" : "contiguous");
  std::printf(
      "  moved    %s in %.2f ms = %.2f GB/s  (median of %zu; the first pull, which "
      "opens the peer's memory, took %.2f ms)\n",
      gib(bytes1).c_str(), pull_med * 1e3, gbps(bytes1, pull_med), pull_s.size() - skip,
      pull_s.front() * 1e3);
  std::printf(
      "  memcpy   %s in %.2f ms = %.2f GB/s  (median of %zu; %s%zu spans, the fastest of "
      "memcpy and non-temporal stores on 1..%u threads, mostly %s; %s)\n",
      gib(plan.total_bytes).c_str(), base_med * 1e3, gbps(plan.total_bytes, base_med),
      base_s.size() - skip, mixed ? "the same bytes contiguous, not the pull's " : "same ",
      mixed ? planned.spans.size() : plan.spans.size(), best.max_threads(), best.name().c_str(),
      src.what.c_str());
  std::printf("  ratio    %.3f of memcpy\n", base_med / pull_med);
  std::printf("  verified %llu blocks, %s, checksum %016llx\n",
              static_cast<unsigned long long>(v1.blocks_checked), gib(v1.bytes_checked).c_str(),
              static_cast<unsigned long long>(v1.checksum));
  std::printf(
      "request 2: %llu tokens, prefix of %llu tokens (%.0f%%) cached locally, tail pulled\n",
      static_cast<unsigned long long>(s2.num_tokens), static_cast<unsigned long long>(prefix),
      c.prefix_hit * 100);
  std::printf("  moved    %s in %.2f ms = %.2f GB/s\n", gib(bytes2).c_str(), tail_s * 1e3,
              gbps(bytes2, tail_s));
  std::printf("  verified all %llu tokens (local prefix + pulled tail)\n",
              static_cast<unsigned long long>(s2.num_tokens));
  std::printf("summary: %.2f GB/s, memcpy %.2f GB/s, ratio %.3f\n", gbps(bytes1, pull_med),
              gbps(plan.total_bytes, base_med), base_med / pull_med);
  std::fflush(stdout);
  demo::write_byte(c.fd, 'D');
  manager.cleanup();
  return 0;
}

// ---- the parent: starts both roles and watches them ------------------------

int run_parent(const DemoConfig& c, int argc, char** argv) {
  // Refuse what cannot work before starting anything.
  memory_for(c.engine);
  const auto built = built_engines();
  const auto traits = find_engine(c.engine);
  if (!traits || !traits->built || !traits->crosses_processes) {
    throw Error(StatusCode::kUnavailable, "engine '" + c.engine +
                                              "' cannot move pages between processes in this "
                                              "build (built: " +
                                              joined(built) + ")");
  }
  if (c.layerwise) demo::require_layer_readiness(c.engine);
  std::printf("mstar-kv demo: prefill -> decode on one host, engine '%s', %u workers\n",
              c.engine.c_str(), c.workers);
  if (!(c.prefill_layout == c.layout)) {
    std::printf("prefill layout: %s (decode pulls into the layout below)\n",
                c.prefill_layout.to_string().c_str());
  }
  std::printf("layout: %s, %llu tokens per request (%s per request)\n",
              c.layout.to_string().c_str(), static_cast<unsigned long long>(c.tokens),
              gib(((c.tokens + c.layout.page_size - 1) / c.layout.page_size) *
                  c.layout.page_bytes_all_layers())
                  .c_str());
  std::fflush(stdout);
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    throw Error(StatusCode::kInternal, std::string("socketpair: ") + std::strerror(errno));
  }
  const std::vector<std::string> args(argv, argv + argc);
  // `<this executable> demo --role ROLE --fd 3 <args>`, the channel as its fd 3.
  auto spawn_role = [&](const char* role, int channel_fd) {
    toolkit::ChildOptions o;
    o.argv = {toolkit::self_exe(), "demo", "--role", role, "--fd", "3"};
    o.argv.insert(o.argv.end(), args.begin(), args.end());
    o.pass_fds[3] = channel_fd;
    return std::make_unique<toolkit::Child>(o);
  };
  struct Kid {
    const char* role;
    std::unique_ptr<toolkit::Child> child;
    bool done = false;
  };
  Kid kids[2] = {{"prefill", nullptr}, {"decode", nullptr}};
  try {
    kids[0].child = spawn_role("prefill", sv[0]);
    kids[1].child = spawn_role("decode", sv[1]);
  } catch (...) {
    ::close(sv[0]);
    ::close(sv[1]);
    throw;  // ~Child kills and reaps a started prefill
  }
  ::close(sv[0]);
  ::close(sv[1]);
  std::printf("started prefill pid %d, decode pid %d\n", kids[0].child->pid(),
              kids[1].child->pid());
  std::fflush(stdout);

  // Both must finish; the first failure stops the other.
  const auto deadline = Clock::now() + c.timeout * (2 * c.repeat + 10) + std::chrono::seconds(60);
  std::string failure;
  auto stop_all = [&](int sig) {
    for (Kid& k : kids) {
      if (!k.done) k.child->signal(sig);
    }
  };
  Clock::time_point kill_at{};
  while (!kids[0].done || !kids[1].done) {
    for (Kid& k : kids) {
      if (k.done || !k.child->wait_for(std::chrono::milliseconds(0))) continue;
      k.done = true;
      const int status = k.child->wait_status();
      const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      if (!ok && failure.empty()) {
        failure = std::string(k.role) + " process (pid " + std::to_string(k.child->pid()) + ") " +
                  toolkit::describe_wait_status(status);
        stop_all(SIGTERM);
        kill_at = Clock::now() + std::chrono::seconds(2);
      }
    }
    if (failure.empty() && Clock::now() > deadline) {
      failure = "the demo did not finish in time; stopping both processes";
      stop_all(SIGTERM);
      kill_at = Clock::now() + std::chrono::seconds(2);
    }
    if (kill_at != Clock::time_point{} && Clock::now() > kill_at) stop_all(SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!failure.empty()) {
    std::fprintf(stderr, "mstar-kv demo: FAILED: %s; the other process was stopped\n",
                 failure.c_str());
    return 1;
  }
  std::printf("result: OK (every page verified)\n");
  return 0;
}

}  // namespace

int cmd_demo(int argc, char** argv) {
  Args args(argc, argv, demo_flags(), demo_options());
  if (args.flag("help")) {
    std::printf("%s%s", kDemoHelp, layout_help());
    return 0;
  }
  const DemoConfig c = parse(args);
  if (c.role.empty()) return run_parent(c, argc, argv);
  // A role process: its errors are reported with its name.
  try {
    if (c.layerwise) {
      demo::LayerwiseConfig lc;
      lc.layout = c.role == "prefill" ? c.prefill_layout : c.layout;  // geometries may differ
      lc.tokens = c.tokens;
      lc.scatter_seed = c.scatter ? c.scatter_seed : 0;
      lc.ms_per_layer = c.ms_per_layer;
      lc.rounds = c.repeat;
      lc.timeout = c.timeout;
      lc.fd = c.fd;
      lc.memory = memory_for(c.engine);
      lc.engine = engine_info(c, c.role == "prefill" ? "prefill" : "decode");
      return c.role == "prefill" ? demo::run_layerwise_prefill(lc) : demo::run_layerwise_decode(lc);
    }
    return c.role == "prefill" ? run_prefill(c) : run_decode(c);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "mstar-kv demo [%s]: error: %s\n", c.role.c_str(), e.what());
    return 1;
  }
}

}  // namespace mstar::kv::cli
