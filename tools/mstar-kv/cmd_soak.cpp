// Copyright mstar-kv authors.
//
// `mstar-kv soak`: decode threads pull many requests from several prefill
// processes (shm and ucx) while the prefill processes are SIGKILLed and
// restarted at random and the decode side's engines inject faults, and every
// request is checked:
// * a read whose future reported success must verify (verify_pattern);
// * after a failed read resolved, no byte of the thread's pages changes
//   during a grace period;
// * no byte outside the read's destination spans changes (the thread's other
//   pages, the token ranges of named pages the read did not ask for, and
//   guard pages no thread uses);
// * every future resolves within the engine's timeout (plus slack).
// Anything else is a corruption; the exit status is non-zero when there is
// one. The prefill processes are re-execs of this program
// (`mstar-kv soak --role prefill ...`), die with it (PR_SET_PDEATHSIG) and
// are killed and reaped on exit and on SIGINT/SIGTERM.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "args.hpp"
#include "commands.hpp"
#include "layout_args.hpp"
#include "mstar/kv/fault_injection.hpp"
#include "mstar/kv/kv.hpp"
#include "soak_prefill.hpp"
#include "soak_shared.hpp"
#include "testkit/seq_line.hpp"

namespace mstar::kv::cli {

using namespace soak;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_soak_signal(int) { g_interrupted.store(true, std::memory_order_relaxed); }

std::vector<std::string> layout_flags(const KVLayout& l) {
  return {"--layers",      std::to_string(l.num_layers),
          "--kv-heads",    std::to_string(l.num_kv_heads),
          "--head-dim",    std::to_string(l.head_dim),
          "--dtype",       std::string(to_string(l.dtype)),
          "--page-size",   std::to_string(l.page_size),
          "--pages",       std::to_string(l.num_pages),
          "--cache-order", l.cache_order == CacheOrder::kPageMajor ? "page" : "layer",
          "--page-order",  l.page_order == PageOrder::kHND ? "hnd" : "nhd"};
}

// The soak's default geometry is small (4 layers, 2 heads x 64) so that many
// requests fit in a short run; the layout flags override it.
KVLayout soak_layout(const Args& args, std::uint32_t pages) {
  KVLayout l = layout_from_args(args, pages);
  if (!args.has("model")) {
    l.num_layers = static_cast<std::uint32_t>(args.u64("layers", 4));
    l.num_kv_heads = static_cast<std::uint32_t>(args.u64("kv-heads", 2));
    l.head_dim = static_cast<std::uint32_t>(args.u64("head-dim", 64));
  }
  l.validate();
  return l;
}

// ---- the prefill role -------------------------------------------------------

// Publishes `sequences` sequences filled with their pattern, one
// "SEQ <hex>" line each, then "READY", and serves until stdin closes.
int run_prefill(const Args& args) {
  const std::string engine = args.str("engine", "shm");
  const std::uint64_t gen = args.u64("gen", 1);
  const std::uint64_t sequences = args.u64("sequences", 6);
  const std::uint64_t max_tokens = args.u64("max-tokens", 256);
  const KVLayout l = soak_layout(args, 256);
  auto cache = make_kv_cache(l, engine_traits(engine).memory);
  EngineOptions o;
  o.timeout = std::chrono::milliseconds(args.u64("timeout-ms", 2000));
  KVTransferManager m(TransferEngineInfo{"soak-prefill-" + std::to_string(gen), "", engine, o},
                      cache);
  KVCachePool pool(cache, m.get_kv_transfer_info(), gen,
                   std::chrono::milliseconds(args.u64("lease-ms", 1000)));
  std::mt19937_64 rng(gen * 7919);
  std::vector<std::uint64_t> live;
  for (std::uint64_t i = 0; i < sequences; ++i) {
    const std::uint64_t seq_id = gen * 1000 + i;
    const std::uint64_t tokens = std::uniform_int_distribution<std::uint64_t>(1, max_tokens)(rng);
    const auto pages = pool.allocate(seq_id, tokens);
    fill_pattern(*cache, pattern_seed(seq_id), pages, 0, tokens);
    std::printf("%s\n", testkit::seq_line(pool.publish(seq_id)).c_str());
    live.push_back(seq_id);
  }
  std::printf("READY\n");
  std::fflush(stdout);
  PrefillChurn churn;
  churn.reuse = std::chrono::milliseconds(args.u64("reuse-ms", 50));
  churn.gen = gen;
  churn.max_tokens = max_tokens;
  churn.first_free_id = sequences;
  serve_prefill_with_churn(pool, *cache, std::move(live), churn, pattern_seed,
                           [](const SequenceInfo& s) {
                             std::printf("%s\n", testkit::seq_line(s).c_str());
                             std::fflush(stdout);
                           });
  m.cleanup();
  return 0;
}

const char* kHelp =
    "usage: mstar-kv soak [--seconds N] [options] [layout options]\n"
    "Decode threads pull requests from prefill processes that are SIGKILLed and\n"
    "restarted at random, through the shm and ucx engines, with faults injected on\n"
    "the decode side; every page is checked. Prints requests, bytes verified,\n"
    "faults injected, failures (expected) and corruptions (must be 0: else exit 1).\n"
    "options:\n"
    "  --seconds N          run time (default 10)\n"
    "  --engines LIST       comma-separated, of shm,ucx (default: those built)\n"
    "  --prefill N          prefill processes, round-robin over the engines (default 2)\n"
    "  --threads N          decode threads (default 4)\n"
    "  --sequences N        sequences per prefill process (default 6)\n"
    "  --max-tokens N       tokens per sequence, at most (default 256)\n"
    "  --kill-ms N          mean time between prefill kills (default 400; 0: none)\n"
    "  --fault-rate P       probability of an injected fault per read (default 0.15)\n"
    "  --timeout-ms N       engine timeout (default 2000)\n"
    "  --grace-ms N         wait after a failed read before re-checking (default 50)\n"
    "  --seed N             random seed (default 1)\n"
    "  --reuse-ms N         mean time between page reuses in each prefill: a sequence\n"
    "                       is freed and its pages go to a new one (default 50; 0: none)\n"
    "  --lease-ms N         prefill pools' lease: unread sequences expire (default 1000)\n"
    "  --ucx-tls T          UCX_TLS unless set in the environment (default tcp)\n";

}  // namespace

int cmd_soak(int argc, char** argv) {
  std::set<std::string> options = layout_options();
  for (const char* o : {"seconds", "engines", "prefill", "threads", "sequences", "max-tokens",
                        "kill-ms", "fault-rate", "timeout-ms", "grace-ms", "seed", "ucx-tls",
                        "role", "engine", "gen", "reuse-ms", "lease-ms"}) {
    options.insert(o);
  }
  const Args args(argc, argv, {"help"}, options);
  if (args.flag("help")) {
    std::printf("%s%s", kHelp, layout_help());
    return 0;
  }
  // UCX is pinned to loopback (its error log shows the peers dying).
  ::setenv("UCX_TLS", args.str("ucx-tls", "tcp").c_str(), 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  if (args.str("role", "") == "prefill") return run_prefill(args);
  if (args.has("role")) throw Error(StatusCode::kInvalidArgument, "unknown --role");

  const auto seconds = args.u64("seconds", 10);
  const std::size_t n_prefill = args.u64("prefill", 2);
  const std::size_t n_threads = args.u64("threads", 4);
  const std::uint64_t sequences = args.u64("sequences", 6);
  const std::uint64_t max_tokens = args.u64("max-tokens", 256);
  const std::uint64_t kill_ms = args.u64("kill-ms", 400);
  const double fault_rate = args.f64("fault-rate", 0.15);
  const std::uint64_t seed = args.u64("seed", 1);
  const DecodeConfig dcfg{std::chrono::milliseconds(args.u64("timeout-ms", 2000)),
                          std::chrono::milliseconds(args.u64("grace-ms", 50)), seed};
  if (n_prefill == 0 || n_threads == 0 || sequences == 0 || max_tokens == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "--prefill, --threads, --sequences and --max-tokens must be >= 1");
  }
  if (fault_rate < 0 || fault_rate > 1) {
    throw Error(StatusCode::kInvalidArgument, "--fault-rate must be in [0, 1]");
  }

  std::vector<std::string> engines;
  {
    // The soak runs the engines that move host pages between processes with
    // nothing beyond their build.
    std::vector<std::string> soakable;
    for (const EngineTraits& t : engine_table()) {
      if (t.crosses_processes && t.self_contained && t.memory != MemoryKind::kDevice) {
        soakable.push_back(t.name);
      }
    }
    const auto is_soakable = [&](const std::string& e) {
      return std::find(soakable.begin(), soakable.end(), e) != soakable.end();
    };
    const auto built = built_engines();
    std::string list = args.str("engines", "");
    if (list.empty()) {
      for (const std::string& e : built) {
        if (is_soakable(e)) engines.push_back(e);
      }
    } else {
      for (std::size_t pos = 0; pos <= list.size();) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        const std::string e = list.substr(pos, comma - pos);
        if (!is_soakable(e)) {
          throw Error(StatusCode::kInvalidArgument,
                      "--engines: '" + e + "' is not " + joined(soakable, " or "));
        }
        if (std::find(built.begin(), built.end(), e) == built.end()) {
          throw Error(StatusCode::kUnavailable, "--engines: engine '" + e + "' is not built");
        }
        engines.push_back(e);
        pos = comma + 1;
      }
    }
    if (engines.empty()) {
      throw Error(StatusCode::kUnavailable, "none of " + joined(soakable, ", ") + " is built");
    }
  }

  // Geometry: each prefill holds `sequences` sequences of up to max_tokens;
  // each decode thread owns enough pages for the longest one, and 4 guard
  // pages (no thread's) sit at each end of the decode cache.
  const KVLayout probe = soak_layout(args, 1);
  const std::uint32_t seq_pages =
      static_cast<std::uint32_t>((max_tokens + probe.page_size - 1) / probe.page_size);
  const std::uint32_t thread_pages = seq_pages + 4;
  constexpr std::uint32_t kGuard = 4;
  KVLayout remote_layout = soak_layout(args, static_cast<std::uint32_t>(sequences) * seq_pages);
  KVLayout local_layout = remote_layout;
  local_layout.num_pages = 2 * kGuard + static_cast<std::uint32_t>(n_threads) * thread_pages;
  local_layout.validate();
  std::vector<std::string> child_args = layout_flags(remote_layout);
  for (const std::string& s : {std::string("--sequences"), std::to_string(sequences),
                               std::string("--max-tokens"), std::to_string(max_tokens),
                               std::string("--timeout-ms"), std::to_string(dcfg.timeout.count()),
                               std::string("--reuse-ms"), std::to_string(args.u64("reuse-ms", 50)),
                               std::string("--lease-ms"), std::to_string(args.u64("lease-ms", 1000))}) {
    child_args.push_back(s);
  }

  struct sigaction sa {};
  sa.sa_handler = &on_soak_signal;
  ::sigemptyset(&sa.sa_mask);
  struct sigaction old_int {}, old_term {};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  ::signal(SIGPIPE, SIG_IGN);

  Shared shared(n_prefill);
  Stats stats;
  std::vector<Prefill> prefills(n_prefill);
  std::uint64_t gen = seed * 100000;
  std::uint64_t kills = 0, restarts = 0, deaths = 0, republished = 0;
  std::mt19937_64 rng(seed);

  auto start = [&](std::size_t i) {
    Prefill& p = prefills[i];
    std::vector<std::string> a = child_args;
    a.insert(a.end(), {"--engine", p.engine, "--gen", std::to_string(++gen)});
    auto seqs = start_prefill(p, a, 30s);
    auto pub = std::make_shared<Published>(Published{p.engine, std::move(seqs)});
    std::lock_guard<std::mutex> lock(shared.mu);
    shared.slots[i] = std::move(pub);
    shared.pids[i] = p.pid();
  };
  auto stop_slot = [&](std::size_t i) {
    {
      std::lock_guard<std::mutex> lock(shared.mu);
      shared.pids[i] = -1;  // the kill hook must never signal a reaped pid
    }
    kill_prefill(prefills[i]);
  };
  auto cleanup_children = [&] {
    for (std::size_t i = 0; i < prefills.size(); ++i) stop_slot(i);
  };

  int rc = 0;
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  std::vector<std::unique_ptr<FaultInjectingEngine>> decode_engines;
  FaultCounters faults;
  std::shared_ptr<KVCache> cache;
  std::vector<std::byte> guard_saved;
  Ranges guard;
  try {
    for (std::size_t i = 0; i < n_prefill; ++i) {
      prefills[i].engine = engines[i % engines.size()];
      start(i);
    }

    cache = make_kv_cache(local_layout, MemoryKind::kHost);
    std::map<std::string, KVTransferEngine*> by_name;
    for (const std::string& e : engines) {
      EngineOptions o;
      o.timeout = dcfg.timeout;
      FaultConfig fc;
      fc.p_delay = fault_rate * 0.25;
      fc.p_drop = fault_rate * 0.1;
      fc.p_fail_after = fault_rate * 0.2;
      fc.p_kill = fault_rate * 0.05;
      fc.p_duplicate = fault_rate * 0.2;
      fc.p_cancel = fault_rate * 0.2;
      fc.max_random_delay = 20ms;
      fc.drop_timeout = dcfg.timeout;
      fc.seed = seed * 31 + decode_engines.size();
      auto inner = make_engine(TransferEngineInfo{"soak-decode", "", e, o}, cache);
      auto wrapped = std::make_unique<FaultInjectingEngine>(
          std::move(inner), local_layout, fc,
          [&shared, r = std::make_shared<std::mt19937_64>(seed + 99)] { shared.kill_random((*r)()); });
      by_name[e] = wrapped.get();
      decode_engines.push_back(std::move(wrapped));
    }

    // Guard pages: nobody's; they must never change.
    std::vector<std::uint32_t> guard_pages;
    for (std::uint32_t p = 0; p < kGuard; ++p) {
      guard_pages.push_back(p);
      guard_pages.push_back(local_layout.num_pages - 1 - p);
    }
    guard = testkit::page_ranges(local_layout, guard_pages);
    testkit::fill_sentinel(*cache, guard, seed + 12345);
    guard_saved = testkit::save(*cache, guard);

    for (std::size_t t = 0; t < n_threads; ++t) {
      std::vector<std::uint32_t> region;
      for (std::uint32_t p = 0; p < thread_pages; ++p) {
        region.push_back(kGuard + static_cast<std::uint32_t>(t) * thread_pages + p);
      }
      threads.emplace_back(decode_thread, t, std::cref(dcfg), std::cref(*cache),
                           std::cref(remote_layout), std::move(region), by_name,
                           std::ref(shared), std::ref(stats), std::cref(stop));
    }

    // Supervisor: kill at random, restart what died.
    std::exponential_distribution<double> next_kill(kill_ms > 0 ? 1.0 / static_cast<double>(kill_ms) : 1.0);
    const auto t0 = Clock::now();
    const auto deadline = t0 + std::chrono::seconds(seconds);
    auto kill_at = t0 + std::chrono::milliseconds(static_cast<std::int64_t>(next_kill(rng)));
    while (Clock::now() < deadline && !g_interrupted.load(std::memory_order_relaxed)) {
      std::this_thread::sleep_for(5ms);
      for (std::size_t i = 0; i < n_prefill; ++i) {
        republished += take_published(prefills[i], i, 2 * sequences, shared);
        // Killed by a fault hook (or crashed)? Looked at without reaping, so
        // that the hook can never signal a recycled pid.
        siginfo_t si{};
        if (prefills[i].pid() > 0 &&
            ::waitid(P_PID, static_cast<id_t>(prefills[i].pid()), &si,
                     WEXITED | WNOHANG | WNOWAIT) == 0 &&
            si.si_pid == prefills[i].pid()) {
          ++deaths;
          stop_slot(i);
          start(i);
          ++restarts;
        }
      }
      if (kill_ms > 0 && Clock::now() >= kill_at) {
        const std::size_t i = rng() % n_prefill;
        stop_slot(i);
        ++kills;
        start(i);
        ++restarts;
        kill_at = Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(next_kill(rng)));
      }
    }
  } catch (...) {
    stop.store(true);
    for (auto& th : threads) th.join();
    for (auto& e : decode_engines) e->shutdown();
    cleanup_children();
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    throw;
  }
  stop.store(true);
  for (auto& th : threads) th.join();
  for (auto& e : decode_engines) {
    e->shutdown();
    const FaultCounters c = e->counters();
    faults.batches += c.batches;
    faults.delayed += c.delayed;
    faults.dropped += c.dropped;
    faults.failed_after_bytes += c.failed_after_bytes;
    faults.kills += c.kills;
    faults.duplicates += c.duplicates;
    faults.duplicates_ignored += c.duplicates_ignored;
    faults.cancels += c.cancels;
  }
  cleanup_children();
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (testkit::changed(*cache, guard, guard_saved)) stats.corruption("a guard page (no thread's) changed");
  if (faults.duplicates != faults.duplicates_ignored) {
    stats.corruption("a duplicate completion changed a resolved future");
  }

  const std::uint64_t injected = faults.total() + kills;
  std::printf("soak: %llu s, %zu prefill processes (%s), %zu decode threads, seed %llu%s\n",
              static_cast<unsigned long long>(seconds), n_prefill,
              [&] {
                std::string s;
                for (const auto& p : prefills) s += (s.empty() ? "" : ", ") + p.engine;
                return s;
              }().c_str(),
              n_threads, static_cast<unsigned long long>(seed),
              g_interrupted.load() ? " (interrupted)" : "");
  std::printf("requests: %llu (ok %llu, failed %llu, rejected before any byte %llu)\n",
              static_cast<unsigned long long>(stats.requests.load()),
              static_cast<unsigned long long>(stats.ok.load()),
              static_cast<unsigned long long>(stats.failed.load()),
              static_cast<unsigned long long>(stats.rejected.load()));
  std::printf("bytes verified: %llu (%.2f GiB)\n",
              static_cast<unsigned long long>(stats.bytes_verified.load()),
              static_cast<double>(stats.bytes_verified.load()) / (1 << 30));
  std::printf("faults injected: %llu (prefill kills %llu, kill-hook kills %llu, delays %llu, "
              "drops %llu, fail-after-bytes %llu, duplicate completions %llu, cancels %llu; "
              "prefill restarts %llu, of which after kill-hook deaths %llu)\n",
              static_cast<unsigned long long>(injected), static_cast<unsigned long long>(kills),
              static_cast<unsigned long long>(faults.kills),
              static_cast<unsigned long long>(faults.delayed),
              static_cast<unsigned long long>(faults.dropped),
              static_cast<unsigned long long>(faults.failed_after_bytes),
              static_cast<unsigned long long>(faults.duplicates),
              static_cast<unsigned long long>(faults.cancels),
              static_cast<unsigned long long>(restarts),
              static_cast<unsigned long long>(deaths));
  {
    std::lock_guard<std::mutex> lock(stats.mu);
    std::string by;
    for (const auto& [code, count] : stats.failures_by_code) {
      by += (by.empty() ? "" : ", ") + code + " " + std::to_string(count);
    }
    std::printf("pages reused: %llu new sequences published on freed pages (page reuse every "
              "~%llu ms per prefill, lease %llu ms)\n",
              static_cast<unsigned long long>(republished),
              static_cast<unsigned long long>(args.u64("reuse-ms", 50)),
              static_cast<unsigned long long>(args.u64("lease-ms", 1000)));
  std::printf("failures reported (expected): %llu (%s)\n",
                static_cast<unsigned long long>(stats.failed.load()) +
                    static_cast<unsigned long long>(stats.rejected.load()),
                by.empty() ? "none" : by.c_str());
    std::printf("corruptions: %llu\n", static_cast<unsigned long long>(stats.corruptions.load()));
    std::printf("wrong-sequence reads: %llu\n",
                static_cast<unsigned long long>(stats.wrong_sequence.load()));
    if (!stats.first_corruption.empty()) {
      std::printf("first corruption: %s\n", stats.first_corruption.c_str());
    }
  }
  std::fflush(stdout);
  if (stats.corruptions.load() != 0 || stats.wrong_sequence.load() != 0) rc = 1;
  if (stats.ok.load() == 0) {
    std::fprintf(stderr, "mstar-kv soak: no request succeeded\n");
    rc = 1;
  }
  return rc;
}

}  // namespace mstar::kv::cli
