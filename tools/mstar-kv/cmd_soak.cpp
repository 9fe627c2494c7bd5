// Copyright mstar-kv authors.
//
// `mstar-kv soak`: decode threads, and decode processes, pull many requests
// from several prefill processes (shm and ucx) while the prefill processes
// are SIGKILLed and restarted at random, the decode side's engines inject
// faults, and the decode processes are SIGKILLed at random (half of them
// inside a read) and restarted, and every request is checked:
// * a read whose future reported success must verify (verify_pattern);
// * after a failed read resolved, no byte of the thread's pages changes
//   during a grace period;
// * no byte outside the read's destination spans changes (the thread's other
//   pages, the token ranges of named pages the read did not ask for, and
//   guard pages no thread uses);
// * every future resolves within the engine's timeout (plus slack).
// Anything else is a corruption; the exit status is non-zero when there is
// one. After every reader kill (and every 5 ms) the prefill processes are
// checked: one that ended without being killed on purpose (by the
// supervisor or a fault injector's kill hook) is an unexpected owner exit,
// which fails the run too. The prefill and decode processes are re-execs
// of this program (`mstar-kv soak --role prefill|decode ...`,
// soak_prefill.cpp, soak_readers.cpp), die with it (PR_SET_PDEATHSIG) and
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
#include "mstar/kv/engines/fault_injection.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "soak_prefill.hpp"
#include "soak_readers.hpp"
#include "soak_shared.hpp"
#include "toolkit/seq_line.hpp"

namespace mstar::kv::cli {

using namespace soak;

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_soak_signal(int) { g_interrupted.store(true, std::memory_order_relaxed); }

const char* kSoakHelp =
    "usage: mstar-kv soak [--seconds N] [options] [layout options]\n"
    "Decode threads and decode processes pull requests from prefill processes that\n"
    "are SIGKILLed and restarted at random, through the shm and ucx engines, with\n"
    "faults injected on the decode threads' side and the decode processes SIGKILLed\n"
    "at random (half inside a read); every page is checked, and the prefill\n"
    "processes after every reader kill. Prints requests, bytes verified, faults\n"
    "injected, failures (expected), reader kills, and corruptions, wrong-sequence\n"
    "reads and unexpected owner exits (each must be 0: else exit 1).\n"
    "options:\n"
    "  --seconds N          run time (default 10)\n"
    "  --engines LIST       comma-separated, of shm,ucx (default: those built)\n"
    "  --prefill N          prefill processes, round-robin over the engines (default 2)\n"
    "  --threads N          decode threads (default 4)\n"
    "  --readers N          decode processes (default 2; 0: none)\n"
    "  --reader-kill-ms N   mean time between decode process kills (default 150; 0: none)\n"
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
  for (const char* o :
       {"seconds",        "engines",      "prefill",    "threads",  "sequences", "max-tokens",
        "kill-ms",        "fault-rate",   "timeout-ms", "grace-ms", "seed",      "ucx-tls",
        "role",           "engine",       "gen",        "reuse-ms", "lease-ms",  "readers",
        "reader-kill-ms", "thread-pages", "slots",      "keep"}) {
    options.insert(o);
  }
  const Args args(argc, argv, {"help"}, options);
  if (args.flag("help")) {
    std::printf("%s%s", kSoakHelp, layout_help());
    return 0;
  }
  // UCX is pinned to loopback (its error log shows the peers dying).
  ::setenv("UCX_TLS", args.str("ucx-tls", "tcp").c_str(), 0);
  ::setenv("UCX_NET_DEVICES", "lo", 0);
  if (args.str("role", "") == "prefill") return run_soak_prefill(args);
  if (args.str("role", "") == "decode") return run_soak_decode(args);
  if (args.has("role")) throw Error(StatusCode::kInvalidArgument, "unknown --role");

  const auto seconds = args.u64("seconds", 10);
  const std::size_t n_prefill = args.u64("prefill", 2);
  const std::size_t n_threads = args.u64("threads", 4);
  const std::size_t n_readers = args.u64("readers", 2);
  const std::uint64_t reader_kill_ms = args.u64("reader-kill-ms", 150);
  const std::uint64_t sequences = args.u64("sequences", 6);
  const std::uint64_t max_tokens = args.u64("max-tokens", 256);
  const std::uint64_t kill_ms = args.u64("kill-ms", 400);
  const double fault_rate = args.f64("fault-rate", 0.15);
  const std::uint64_t seed = args.u64("seed", 1);
  const DecodeConfig dcfg{std::chrono::milliseconds(args.u64("timeout-ms", 2000)),
                          std::chrono::milliseconds(args.u64("grace-ms", 50)),
                          seed,
                          {}};
  if (n_prefill == 0 || n_threads == 0 || sequences == 0 || max_tokens == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "--prefill, --threads, --sequences and --max-tokens must be >= 1");
  }
  if (fault_rate < 0 || fault_rate > 1) {
    throw Error(StatusCode::kInvalidArgument, "--fault-rate must be in [0, 1]");
  }

  const std::vector<std::string> engines = soak_engines(args.str("engines", ""));

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
  for (const std::string& s :
       {std::string("--sequences"), std::to_string(sequences), std::string("--max-tokens"),
        std::to_string(max_tokens), std::string("--timeout-ms"),
        std::to_string(dcfg.timeout.count()), std::string("--reuse-ms"),
        std::to_string(args.u64("reuse-ms", 50)), std::string("--lease-ms"),
        std::to_string(args.u64("lease-ms", 1000))}) {
    child_args.push_back(s);
  }

  struct sigaction sa {};
  sa.sa_handler = &on_soak_signal;
  ::sigemptyset(&sa.sa_mask);
  struct sigaction old_int {
  }, old_term{};
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  ::signal(SIGPIPE, SIG_IGN);

  Shared shared(n_prefill);
  Stats stats;
  std::vector<Prefill> prefills(n_prefill);
  std::uint64_t gen = seed * 100000;
  std::uint64_t kills = 0, restarts = 0, deaths = 0, republished = 0;
  std::uint64_t unexpected_owner_exits = 0;
  std::string first_unexpected_owner_exit;
  std::mt19937_64 rng(seed);

  // The decode processes: one decode thread each, over a cache of its own
  // with the decode threads' geometry.
  std::vector<std::string> reader_args = layout_flags(remote_layout);
  {
    std::string list;
    for (const std::string& e : engines) list += (list.empty() ? "" : ",") + e;
    for (const std::string& s :
         {std::string("--engines"), list, std::string("--thread-pages"),
          std::to_string(thread_pages), std::string("--slots"), std::to_string(n_prefill),
          std::string("--keep"), std::to_string(2 * sequences), std::string("--timeout-ms"),
          std::to_string(dcfg.timeout.count()), std::string("--grace-ms"),
          std::to_string(dcfg.grace.count()), std::string("--seed"),
          std::to_string(seed * 7 + 1)}) {
      reader_args.push_back(s);
    }
  }
  ReaderChurn readers(n_readers, reader_args);

  auto start = [&](std::size_t i) {
    Prefill& p = prefills[i];
    std::vector<std::string> a = child_args;
    a.insert(a.end(), {"--engine", p.engine, "--gen", std::to_string(++gen)});
    auto seqs = start_prefill(p, a, 30s);
    readers.publish(i, p.engine, seqs);
    auto pub = std::make_shared<Published>(Published{p.engine, std::move(seqs)});
    std::lock_guard<std::mutex> lock(shared.mu);
    shared.slots[i] = std::move(pub);
    shared.pids[i] = p.pid();
  };
  auto stop_slot = [&](std::size_t i) {
    {
      std::lock_guard<std::mutex> lock(shared.mu);
      shared.pids[i] = -1;  // the kill hook must never signal a reaped pid
      shared.slots[i] = nullptr;
    }
    readers.clear(i);
    kill_prefill(prefills[i]);
  };
  // Prefill processes that ended, looked at without reaping (so that the
  // kill hook can never signal a recycled pid): meant when the kill hook
  // SIGKILLed them, else an unexpected owner exit. Restarted with `restart`.
  auto check_owners = [&](bool restart) {
    for (std::size_t i = 0; i < n_prefill; ++i) {
      const pid_t pid = prefills[i].pid();
      siginfo_t si{};
      if (pid <= 0 ||
          ::waitid(P_PID, static_cast<id_t>(pid), &si, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          si.si_pid != pid) {
        continue;
      }
      if (si.si_code == CLD_KILLED && si.si_status == SIGKILL && shared.killed_by_hook(pid)) {
        ++deaths;
      } else {
        ++unexpected_owner_exits;
        if (first_unexpected_owner_exit.empty()) {
          first_unexpected_owner_exit =
              "a " + prefills[i].engine + " prefill process " +
              (si.si_code == CLD_EXITED ? "exited with status " + std::to_string(si.si_status)
                                        : "was killed by signal " + std::to_string(si.si_status) +
                                              " (" + ::strsignal(si.si_status) + ")");
        }
      }
      if (!restart) continue;
      stop_slot(i);
      start(i);
      ++restarts;
    }
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
    readers.start(shared);

    cache = make_kv_cache(local_layout, MemoryKind::kHost);
    std::map<std::string, KVTransferEngine*> by_name;
    for (const std::string& e : engines) {
      auto wrapped =
          make_decode_engine(e, cache, dcfg, fault_rate, seed * 31 + decode_engines.size(),
                             [&shared, r = std::make_shared<std::mt19937_64>(seed + 99)] {
                               shared.kill_random((*r)());
                             });
      by_name[e] = wrapped.get();
      decode_engines.push_back(std::move(wrapped));
    }

    // Guard pages: nobody's; they must never change.
    std::vector<std::uint32_t> guard_pages;
    for (std::uint32_t p = 0; p < kGuard; ++p) {
      guard_pages.push_back(p);
      guard_pages.push_back(local_layout.num_pages - 1 - p);
    }
    guard = toolkit::page_ranges(local_layout, guard_pages);
    toolkit::fill_sentinel(*cache, guard, seed + 12345);
    guard_saved = toolkit::save(*cache, guard);

    for (std::size_t t = 0; t < n_threads; ++t) {
      std::vector<std::uint32_t> region;
      for (std::uint32_t p = 0; p < thread_pages; ++p) {
        region.push_back(kGuard + static_cast<std::uint32_t>(t) * thread_pages + p);
      }
      threads.emplace_back(decode_thread, t, std::cref(dcfg), std::cref(*cache),
                           std::cref(remote_layout), std::move(region), by_name, std::ref(shared),
                           std::ref(stats), std::cref(stop));
    }

    // Supervisor: kill at random, restart what died.
    std::exponential_distribution<double> next_kill(kill_ms > 0 ? 1.0 / static_cast<double>(kill_ms)
                                                                : 1.0);
    const auto t0 = Clock::now();
    const auto deadline = t0 + std::chrono::seconds(seconds);
    auto kill_at = t0 + std::chrono::milliseconds(static_cast<std::int64_t>(next_kill(rng)));
    std::exponential_distribution<double> next_reader_kill(
        reader_kill_ms > 0 ? 1.0 / static_cast<double>(reader_kill_ms) : 1.0);
    auto reader_kill_at =
        t0 + std::chrono::milliseconds(static_cast<std::int64_t>(next_reader_kill(rng)));
    while (Clock::now() < deadline && !g_interrupted.load(std::memory_order_relaxed)) {
      std::this_thread::sleep_for(5ms);
      for (std::size_t i = 0; i < n_prefill; ++i) {
        const auto fresh = take_published(prefills[i], i, 2 * sequences, shared);
        republished += fresh.size();
        readers.publish(i, prefills[i].engine, fresh);
      }
      // Killed by a fault hook, or crashed: restarted (the latter counted).
      check_owners(true);
      // Decode processes that ended (killed, or failed) are restarted;
      // after each kill the owners are looked at again.
      if (readers.poll(stats, shared) != 0) check_owners(true);
      if (n_readers > 0 && reader_kill_ms > 0 && Clock::now() >= reader_kill_at) {
        readers.kill_one(rng);
        reader_kill_at = Clock::now() + std::chrono::milliseconds(
                                            static_cast<std::int64_t>(next_reader_kill(rng)));
      }
      if (kill_ms > 0 && Clock::now() >= kill_at) {
        const std::size_t i = rng() % n_prefill;
        stop_slot(i);
        ++kills;
        start(i);
        ++restarts;
        kill_at =
            Clock::now() + std::chrono::milliseconds(static_cast<std::int64_t>(next_kill(rng)));
      }
    }
  } catch (...) {
    readers.stop(stats);
    stop.store(true);
    for (auto& th : threads) th.join();
    for (auto& e : decode_engines) e->shutdown();
    cleanup_children();
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    throw;
  }
  readers.stop(stats);
  stop.store(true);
  for (auto& th : threads) th.join();
  for (auto& e : decode_engines) {
    e->shutdown();
    add_counters(faults, e->counters());
  }
  // The owners once more, after the last readers went away.
  std::this_thread::sleep_for(100ms);
  check_owners(false);
  cleanup_children();
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  if (toolkit::changed(*cache, guard, guard_saved))
    stats.corruption("a guard page (no thread's) changed");
  if (faults.duplicates != faults.duplicates_ignored) {
    stats.corruption("a duplicate completion changed a resolved future");
  }

  SoakRun run;
  run.seconds = seconds;
  for (const auto& p : prefills) run.prefill_engines.push_back(p.engine);
  run.threads = n_threads;
  run.decode_procs = n_readers;
  run.readers = readers.counts();
  run.unexpected_owner_exits = unexpected_owner_exits;
  run.first_unexpected_owner_exit = first_unexpected_owner_exit;
  run.seed = seed;
  run.interrupted = g_interrupted.load();
  run.kills = kills;
  run.restarts = restarts;
  run.deaths = deaths;
  run.republished = republished;
  run.reuse_ms = args.u64("reuse-ms", 50);
  run.lease_ms = args.u64("lease-ms", 1000);
  run.faults = faults;
  print_soak_report(run, stats);
  std::fflush(stdout);
  if (stats.corruptions.load() != 0 || stats.wrong_sequence.load() != 0) rc = 1;
  if (unexpected_owner_exits != 0 || run.readers.unexpected_exits != 0) rc = 1;
  if (stats.ok.load() == 0) {
    std::fprintf(stderr, "mstar-kv soak: no request succeeded\n");
    rc = 1;
  }
  return rc;
}

}  // namespace mstar::kv::cli
