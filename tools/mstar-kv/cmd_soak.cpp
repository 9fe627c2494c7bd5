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

namespace mstar::kv::cli {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

std::atomic<bool> g_interrupted{false};
static_assert(std::atomic<bool>::is_always_lock_free);

extern "C" void on_soak_signal(int) { g_interrupted.store(true, std::memory_order_relaxed); }

std::uint64_t pattern_seed(std::uint64_t seq_id) { return seq_id * 0x9E3779B97F4A7C15ULL + 17; }

std::string to_hex(const std::vector<std::uint8_t>& b) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(b.size() * 2);
  for (std::uint8_t x : b) {
    s.push_back(d[x >> 4]);
    s.push_back(d[x & 15]);
  }
  return s;
}

std::vector<std::uint8_t> from_hex(const std::string& s) {
  auto v = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  if (s.size() % 2 != 0) throw Error(StatusCode::kCorruptDescriptor, "odd hex length");
  std::vector<std::uint8_t> out(s.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    const int hi = v(s[2 * i]);
    const int lo = v(s[2 * i + 1]);
    if (hi < 0 || lo < 0) throw Error(StatusCode::kCorruptDescriptor, "bad hex digit");
    out[i] = static_cast<std::uint8_t>(hi << 4 | lo);
  }
  return out;
}

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
  auto cache = make_kv_cache(l, engine == "shm" ? MemoryKind::kSharedHost : MemoryKind::kHost);
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
    std::printf("SEQ %s\n", to_hex(pool.publish(seq_id).encode()).c_str());
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
                             std::printf("SEQ %s\n", to_hex(s.encode()).c_str());
                             std::fflush(stdout);
                           });
  m.cleanup();
  return 0;
}

// ---- prefill processes, seen from the soak ----------------------------------

struct Prefill {
  std::string engine;
  pid_t pid = -1;
  int to_child = -1;    // its stdin: closing it asks it to exit
  int from_child = -1;  // its stdout
  std::string buf;      // what it printed after READY, not yet a whole line
};

void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// SIGKILL and reap (bounded: a SIGKILLed process always exits).
void kill_prefill(Prefill& p) {
  if (p.pid > 0) {
    ::kill(p.pid, SIGKILL);
    int st = 0;
    while (::waitpid(p.pid, &st, 0) < 0 && errno == EINTR) {
    }
  }
  p.pid = -1;
  close_fd(p.to_child);
  close_fd(p.from_child);
}

// Starts `mstar-kv soak --role prefill ...` and reads its sequences.
// Throws Error(kPeerFailure) if it does not get ready within `timeout`.
std::vector<SequenceInfo> start_prefill(Prefill& p, const std::vector<std::string>& args,
                                        std::chrono::milliseconds timeout) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0) throw Error(StatusCode::kInternal, "pipe2 failed");
  if (::pipe2(out, O_CLOEXEC) != 0) {
    ::close(in[0]);
    ::close(in[1]);
    throw Error(StatusCode::kInternal, "pipe2 failed");
  }
  // Everything the child needs is built before fork(): after it, only
  // async-signal-safe calls (other threads of this process keep running).
  std::vector<std::string> full = {"mstar-kv", "soak", "--role", "prefill"};
  full.insert(full.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : full) argv.push_back(s.data());
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    for (int fd : {in[0], in[1], out[0], out[1]}) ::close(fd);
    throw Error(StatusCode::kInternal, "fork failed");
  }
  if (pid == 0) {
    ::dup2(in[0], STDIN_FILENO);
    ::dup2(out[1], STDOUT_FILENO);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  p.pid = pid;
  p.to_child = in[1];
  p.from_child = out[0];

  std::vector<SequenceInfo> seqs;
  std::string buf;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    std::size_t nl;
    while ((nl = buf.find('\n')) != std::string::npos) {
      const std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      if (line == "READY") {
        p.buf = std::move(buf);  // sequences it published since (page reuse)
        return seqs;
      }
      if (line.rfind("SEQ ", 0) == 0) seqs.push_back(SequenceInfo::decode(from_hex(line.substr(4))));
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) break;
    pollfd pfd{p.from_child, POLLIN, 0};
    const int r = ::poll(&pfd, 1, static_cast<int>(left.count()));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    char tmp[4096];
    const ssize_t n = ::read(p.from_child, tmp, sizeof tmp);
    if (n <= 0) break;
    buf.append(tmp, static_cast<std::size_t>(n));
  }
  kill_prefill(p);
  throw Error(StatusCode::kPeerFailure, "a " + p.engine + " prefill process did not get ready");
}

// ---- shared state between the supervisor and the decode threads -------------

struct Published {
  std::string engine;
  std::vector<SequenceInfo> seqs;
};

struct Stats {
  std::atomic<std::uint64_t> requests{0}, ok{0}, failed{0}, rejected{0}, bytes_verified{0},
      corruptions{0}, hangs{0}, wrong_sequence{0};
  std::mutex mu;
  std::map<std::string, std::uint64_t> failures_by_code;  // guarded by mu
  std::string first_corruption;                            // guarded by mu

  void failure(StatusCode c) {
    std::lock_guard<std::mutex> lock(mu);
    ++failures_by_code[std::string(to_string(c))];
  }
  void corruption(const std::string& what) {
    corruptions.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu);
    if (first_corruption.empty()) first_corruption = what;
  }
};

struct Shared {
  std::mutex mu;
  std::vector<std::shared_ptr<const Published>> slots;  // guarded by mu; null while restarting
  std::vector<pid_t> pids;                              // guarded by mu

  std::shared_ptr<const Published> get(std::size_t i) {
    std::lock_guard<std::mutex> lock(mu);
    return slots[i];
  }
  // The kill hook of the fault injectors: SIGKILL one prefill at random
  // (the supervisor notices and restarts it).
  void kill_random(std::uint64_t r) {
    std::lock_guard<std::mutex> lock(mu);
    if (pids.empty()) return;
    const pid_t pid = pids[r % pids.size()];
    if (pid > 0) ::kill(pid, SIGKILL);
  }
};

// Sequences a prefill published since READY (page reuse, expired leases):
// appended to its slot, which keeps the newest `keep`, freed ones included,
// so that readers also pull sequences whose pages went to others.
std::size_t take_published(Prefill& p, std::size_t i, std::size_t keep, Shared& shared) {
  for (;;) {
    pollfd pfd{p.from_child, POLLIN, 0};
    if (p.from_child < 0 || ::poll(&pfd, 1, 0) <= 0) break;
    char tmp[8192];
    const ssize_t n = ::read(p.from_child, tmp, sizeof tmp);
    if (n <= 0) break;
    p.buf.append(tmp, static_cast<std::size_t>(n));
  }
  std::vector<SequenceInfo> fresh;
  for (std::size_t nl; (nl = p.buf.find('\n')) != std::string::npos;) {
    const std::string line = p.buf.substr(0, nl);
    p.buf.erase(0, nl + 1);
    if (line.rfind("SEQ ", 0) == 0) fresh.push_back(SequenceInfo::decode(from_hex(line.substr(4))));
  }
  if (fresh.empty()) return 0;
  std::lock_guard<std::mutex> lock(shared.mu);
  if (!shared.slots[i]) return 0;
  auto pub = std::make_shared<Published>(*shared.slots[i]);
  pub->seqs.insert(pub->seqs.end(), fresh.begin(), fresh.end());
  if (pub->seqs.size() > keep) {
    pub->seqs.erase(pub->seqs.begin(),
                    pub->seqs.begin() + static_cast<std::ptrdiff_t>(pub->seqs.size() - keep));
  }
  shared.slots[i] = std::move(pub);
  return fresh.size();
}

// Byte ranges [begin, end) of the local cache, merged.
using Ranges = std::vector<std::pair<std::uint64_t, std::uint64_t>>;

Ranges merged(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (const auto& [b, e] : r) {
    if (!out.empty() && b <= out.back().second) {
      out.back().second = std::max(out.back().second, e);
    } else {
      out.emplace_back(b, e);
    }
  }
  return out;
}

// Blocks of `pages` (every layer, k and v): the bytes a thread owns.
Ranges page_ranges(const KVLayout& l, const std::vector<std::uint32_t>& pages) {
  Ranges r;
  for (std::uint32_t p : pages) {
    for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
      for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
        const std::uint64_t off = l.block_offset(layer, static_cast<KV>(kv), p);
        r.emplace_back(off, off + l.block_bytes());
      }
    }
  }
  return merged(std::move(r));
}

// Copies of the bytes of `ranges`.
std::vector<std::byte> save(const KVCache& c, const Ranges& ranges) {
  std::vector<std::byte> out;
  for (const auto& [b, e] : ranges) out.insert(out.end(), c.base() + b, c.base() + e);
  return out;
}

// First offset inside `ranges` but outside `allowed` where the cache differs
// from `saved` (the bytes of `ranges`); -1 when none.
std::int64_t changed(const KVCache& c, const Ranges& ranges, const std::vector<std::byte>& saved,
                     const Ranges& allowed) {
  std::size_t pos = 0;
  std::size_t a = 0;
  for (const auto& [b, e] : ranges) {
    std::uint64_t x = b;
    while (x < e) {
      while (a < allowed.size() && allowed[a].second <= x) ++a;
      std::uint64_t stop = e;
      if (a < allowed.size() && allowed[a].first <= x) {
        x = std::min(e, allowed[a].second);  // skip the allowed part
        continue;
      }
      if (a < allowed.size()) stop = std::min(stop, allowed[a].first);
      const std::byte* now = c.base() + x;
      const std::byte* was = saved.data() + pos + (x - b);
      if (std::memcmp(now, was, stop - x) != 0) {
        for (std::uint64_t i = 0; i < stop - x; ++i) {
          if (now[i] != was[i]) return static_cast<std::int64_t>(x + i);
        }
      }
      x = stop;
    }
    pos += e - b;
  }
  return -1;
}

void fill_sentinel(const KVCache& c, const Ranges& ranges, std::uint64_t seed) {
  std::uint64_t x = seed * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
  for (const auto& [b, e] : ranges) {
    std::uint64_t i = b;
    for (; i + 8 <= e; i += 8) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      std::memcpy(c.base() + i, &x, 8);
    }
    for (; i < e; ++i) c.base()[i] = std::byte{0xA5};
  }
}

struct DecodeConfig {
  std::chrono::milliseconds timeout;
  std::chrono::milliseconds grace;
  std::uint64_t seed;
};

void decode_thread(std::size_t t, const DecodeConfig& cfg, const KVCache& cache,
                   const KVLayout& remote_layout, std::vector<std::uint32_t> region,
                   std::map<std::string, KVTransferEngine*> engines, Shared& shared, Stats& stats,
                   const std::atomic<bool>& stop) {
  const KVLayout& l = cache.layout();
  std::mt19937_64 rng(cfg.seed * 1000003 + t);
  const Ranges mine = page_ranges(l, region);
  std::uint64_t n = 0;
  while (!stop.load(std::memory_order_relaxed)) {
    const std::size_t slot = rng() % shared.slots.size();
    auto pub = shared.get(slot);
    if (!pub || pub->seqs.empty()) {
      std::this_thread::sleep_for(1ms);
      continue;
    }
    const SequenceInfo& seq = pub->seqs[rng() % pub->seqs.size()];
    KVTransferEngine* engine = engines.at(pub->engine);
    std::shuffle(region.begin(), region.end(), rng);
    std::vector<std::uint32_t> lp(region.begin(),
                                  region.begin() + static_cast<std::ptrdiff_t>(seq.page_indices.size()));
    const std::uint64_t start = rng() % 4 == 0 ? rng() % seq.num_tokens : 0;
    const auto reads = plan_reads(l, start, seq.num_tokens, lp, seq.page_indices);
    Ranges allowed;
    for (const CopySpan& s : plan_copies(l, remote_layout, reads).spans) {
      allowed.emplace_back(s.local_offset, s.local_offset + s.length);
    }
    allowed = merged(std::move(allowed));
    fill_sentinel(cache, mine, cfg.seed ^ (t << 40) ^ ++n);
    const std::vector<std::byte> before = save(cache, mine);
    stats.requests.fetch_add(1, std::memory_order_relaxed);
    const std::string what = "thread " + std::to_string(t) + " request " + std::to_string(n) +
                             " (" + pub->engine + ", seq " + std::to_string(seq.seq_id) + ")";

    std::optional<TransferFuture> f;
    try {
      f = engine->read_batched_async(seq.kv_transfer_info, reads);
    } catch (const Error& e) {
      stats.rejected.fetch_add(1, std::memory_order_relaxed);
      stats.failure(e.code());
      if (changed(cache, mine, before, {}) >= 0) stats.corruption(what + ": rejected read wrote");
      continue;
    }
    if (!f || !f->wait_for(cfg.timeout + 5s)) {
      // Its pages may still be written: this thread stops using them.
      stats.hangs.fetch_add(1, std::memory_order_relaxed);
      stats.corruption(what + ": the future did not resolve within the timeout + 5 s");
      return;
    }
    const Status st = f->status();
    if (st.is_ok()) {
      const VerifyResult v = verify_pattern(cache, pattern_seed(seq.seq_id), lp, start, seq.num_tokens);
      if (v.ok()) {
        stats.ok.fetch_add(1, std::memory_order_relaxed);
        stats.bytes_verified.fetch_add(v.bytes_checked, std::memory_order_relaxed);
      } else {
        // Another request's KV (or garbage) reported as this one's: the bug
        // page epochs exist to prevent.
        stats.wrong_sequence.fetch_add(1, std::memory_order_relaxed);
        stats.corruption(what + ": success reported but " + v.first_mismatch);
      }
    } else {
      stats.failed.fetch_add(1, std::memory_order_relaxed);
      stats.failure(st.code());
      const std::vector<std::byte> at_resolution = save(cache, mine);
      std::this_thread::sleep_for(cfg.grace);
      const std::int64_t late = changed(cache, mine, at_resolution, {});
      if (late >= 0) {
        stats.corruption(what + ": byte " + std::to_string(late) + " changed after the future resolved with " +
                         st.to_string());
      }
    }
    const std::int64_t outside = changed(cache, mine, before, allowed);
    if (outside >= 0) {
      stats.corruption(what + ": byte " + std::to_string(outside) +
                       " outside the read's destination spans changed");
    }
  }
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
    const auto built = built_engines();
    std::string list = args.str("engines", "");
    if (list.empty()) {
      for (const char* e : {"shm", "ucx"}) {
        if (std::find(built.begin(), built.end(), e) != built.end()) engines.emplace_back(e);
      }
    } else {
      for (std::size_t pos = 0; pos <= list.size();) {
        const std::size_t comma = std::min(list.find(',', pos), list.size());
        const std::string e = list.substr(pos, comma - pos);
        if (e != "shm" && e != "ucx") {
          throw Error(StatusCode::kInvalidArgument, "--engines: '" + e + "' is not shm or ucx");
        }
        if (std::find(built.begin(), built.end(), e) == built.end()) {
          throw Error(StatusCode::kUnavailable, "--engines: engine '" + e + "' is not built");
        }
        engines.push_back(e);
        pos = comma + 1;
      }
    }
    if (engines.empty()) throw Error(StatusCode::kUnavailable, "neither shm nor ucx is built");
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

  Shared shared;
  Stats stats;
  std::vector<Prefill> prefills(n_prefill);
  shared.slots.resize(n_prefill);
  shared.pids.resize(n_prefill, -1);
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
    shared.pids[i] = p.pid;
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
    guard = page_ranges(local_layout, guard_pages);
    fill_sentinel(*cache, guard, seed + 12345);
    guard_saved = save(*cache, guard);

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
        if (prefills[i].pid > 0 &&
            ::waitid(P_PID, static_cast<id_t>(prefills[i].pid), &si,
                     WEXITED | WNOHANG | WNOWAIT) == 0 &&
            si.si_pid == prefills[i].pid) {
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
  if (changed(*cache, guard, guard_saved, {}) >= 0) stats.corruption("a guard page (no thread's) changed");
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
                static_cast<unsigned long long>(stats.failed.load() + stats.rejected.load()),
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
