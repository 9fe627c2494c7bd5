// Copyright mstar-kv authors.
//
// `mstar-kv soak`'s decode processes: the process (run_soak_decode) and the
// supervisor's side (ReaderChurn). See soak_readers.hpp.
#include "soak_readers.hpp"

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <mutex>
#include <sstream>
#include <thread>

#include "soak_prefill.hpp"
#include "toolkit/seq_line.hpp"

namespace mstar::kv::cli::soak {

namespace {

constexpr std::uint32_t kGuard = 4;  // pages at each end of its cache no read may touch

std::mutex g_out_mu;  // the decode process's stdout: its main and decode threads

void out_line(const std::string& line) {
  std::lock_guard<std::mutex> lock(g_out_mu);
  std::fwrite(line.data(), 1, line.size(), stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

// "code=n,code=n" of `m`, or "-".
std::string codes_of(const std::map<std::string, std::uint64_t>& m) {
  std::string s;
  for (const auto& [code, n] : m) s += (s.empty() ? "" : ",") + code + "=" + std::to_string(n);
  return s.empty() ? "-" : s;
}

// The decode process's side of a PUB / CLEAR line.
void take_line(const std::string& line, Shared& shared, std::size_t keep, std::atomic<bool>& die) {
  std::istringstream in(line);
  std::string verb;
  std::size_t slot = 0;
  in >> verb;
  if (verb == "DIE") {
    die.store(true);
    return;
  }
  if (!(in >> slot) || slot >= shared.size()) return;
  if (verb == "CLEAR") {
    std::lock_guard<std::mutex> lock(shared.mu);
    shared.slots[slot] = nullptr;
    return;
  }
  std::string engine, hex;
  if (verb != "PUB" || !(in >> engine >> hex)) return;
  auto seq = toolkit::parse_seq_line("SEQ " + hex);
  if (!seq) return;
  std::lock_guard<std::mutex> lock(shared.mu);
  auto pub = shared.slots[slot] ? std::make_shared<Published>(*shared.slots[slot])
                                : std::make_shared<Published>(Published{engine, {}});
  pub->engine = engine;
  pub->seqs.push_back(std::move(*seq));
  if (pub->seqs.size() > keep) pub->seqs.erase(pub->seqs.begin());
  shared.slots[slot] = std::move(pub);
}

}  // namespace

int run_soak_decode(const Args& args) {
  const std::vector<std::string> engines = soak_engines(args.str("engines", ""));
  const KVLayout remote_layout = soak_layout(args, 1);
  const auto thread_pages = static_cast<std::uint32_t>(args.u64("thread-pages", 20));
  KVLayout local = remote_layout;
  local.num_pages = 2 * kGuard + thread_pages;
  local.validate();
  const std::size_t keep = args.u64("keep", 12);
  DecodeConfig cfg{std::chrono::milliseconds(args.u64("timeout-ms", 2000)),
                   std::chrono::milliseconds(args.u64("grace-ms", 50)),
                   args.u64("seed", 1),
                   {}};
  auto cache = make_kv_cache(local, MemoryKind::kHost);
  std::vector<std::unique_ptr<KVTransferEngine>> owned;
  std::map<std::string, KVTransferEngine*> by_name;
  for (const std::string& e : engines) {
    EngineOptions o;
    o.timeout = cfg.timeout;
    owned.push_back(make_engine(TransferEngineInfo{"soak-reader", "", e, o}, cache));
    by_name[e] = owned.back().get();
  }
  Shared shared(args.u64("slots", 1));
  Stats stats;
  stats.on_corruption = [](bool wrong, const std::string& what) {
    out_line(std::string("CORRUPT ") + (wrong ? "1 " : "0 ") + one_line(what));
  };
  std::atomic<bool> die{false};
  std::atomic<bool> stop{false};
  // Asked to die: SIGKILL inside this read, a random moment (up to 2 ms)
  // after it was issued.
  cfg.after_issue = [&die, rng = std::mt19937_64(cfg.seed)]() mutable {
    if (!die.load()) return;
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % 2000));
    ::raise(SIGKILL);
  };
  std::vector<std::uint32_t> region;
  for (std::uint32_t p = 0; p < thread_pages; ++p) region.push_back(kGuard + p);
  std::thread reader(decode_thread, 0, std::cref(cfg), std::cref(*cache), std::cref(remote_layout),
                     region, by_name, std::ref(shared), std::ref(stats), std::cref(stop));
  auto report = [&] {
    std::map<std::string, std::uint64_t> codes;
    {
      std::lock_guard<std::mutex> lock(stats.mu);
      codes = stats.failures_by_code;
    }
    out_line("STATS " + std::to_string(stats.requests.load()) + " " +
             std::to_string(stats.ok.load()) + " " + std::to_string(stats.failed.load()) + " " +
             std::to_string(stats.rejected.load()) + " " +
             std::to_string(stats.bytes_verified.load()) + " " + codes_of(codes));
  };
  std::string buf;
  for (;;) {
    pollfd pfd{STDIN_FILENO, POLLIN, 0};
    if (::poll(&pfd, 1, 20) > 0) {
      char tmp[1 << 16];
      const ssize_t n = ::read(STDIN_FILENO, tmp, sizeof tmp);
      if (n <= 0) break;  // the supervisor closed our stdin: stop
      buf.append(tmp, static_cast<std::size_t>(n));
      for (auto nl = buf.find('\n'); nl != std::string::npos; nl = buf.find('\n')) {
        take_line(buf.substr(0, nl), shared, keep, die);
        buf.erase(0, nl + 1);
      }
    }
    report();
  }
  stop.store(true);
  reader.join();
  for (auto& e : owned) e->shutdown();
  report();
  return 0;
}

// ---- the supervisor's side ----------------------------------------------------

ReaderChurn::ReaderChurn(std::size_t count, std::vector<std::string> args)
    : args_(std::move(args)), readers_(count) {}

ReaderChurn::~ReaderChurn() = default;  // each Child kills and reaps its process

void ReaderChurn::start(Shared& shared) {
  for (Reader& r : readers_) start_one(r, shared);
}

void ReaderChurn::start_one(Reader& r, Shared& shared) {
  toolkit::ChildOptions o;
  o.argv = {toolkit::self_exe(), "soak", "--role", "decode"};
  o.argv.insert(o.argv.end(), args_.begin(), args_.end());
  o.in_fd = 0;
  o.out_fd = 1;
  r = Reader{};
  r.child = std::make_unique<toolkit::Child>(o);
  ++counts_.started;
  for (std::size_t i = 0; i < shared.size(); ++i) {
    if (auto pub = shared.get(i)) publish_to(r, i, pub->engine, pub->seqs);
  }
}

void ReaderChurn::publish_to(Reader& r, std::size_t slot, const std::string& engine,
                             const std::vector<SequenceInfo>& seqs) {
  for (const SequenceInfo& s : seqs) {
    send(r, "PUB " + std::to_string(slot) + " " + engine + " " + toolkit::seq_line(s).substr(4));
  }
}

void ReaderChurn::send(Reader& r, const std::string& line) {
  if (!r.child) return;
  try {
    r.child->write_line(line);
  } catch (const Error&) {
    // It is gone: poll() reaps it.
  }
}

void ReaderChurn::clear(std::size_t slot) {
  for (Reader& r : readers_) send(r, "CLEAR " + std::to_string(slot));
}

void ReaderChurn::publish(std::size_t slot, const std::string& engine,
                          const std::vector<SequenceInfo>& seqs) {
  for (Reader& r : readers_) publish_to(r, slot, engine, seqs);
}

void ReaderChurn::read_lines(Reader& r, Stats& stats) {
  while (r.child) {
    const auto line = r.child->poll_line();
    if (!line) return;
    std::istringstream in(*line);
    std::string verb;
    in >> verb;
    if (verb == "STATS") {
      std::string codes;
      in >> r.requests >> r.ok >> r.failed >> r.rejected >> r.bytes >> codes;
      r.codes.clear();
      for (std::size_t pos = 0; codes != "-" && pos < codes.size();) {
        const std::size_t comma = std::min(codes.find(',', pos), codes.size());
        const std::string kv = codes.substr(pos, comma - pos);
        const std::size_t eq = kv.find('=');
        if (eq != std::string::npos) r.codes[kv.substr(0, eq)] = std::stoull(kv.substr(eq + 1));
        pos = comma + 1;
      }
    } else if (verb == "CORRUPT") {
      int wrong = 0;
      in >> wrong;
      std::string what;
      std::getline(in, what);
      stats.corruption("decode process " + std::to_string(r.child->pid()) + ":" + what, wrong != 0);
    }
  }
}

void ReaderChurn::account(Reader& r, Stats& stats) {
  counts_.requests += r.requests;
  stats.requests.fetch_add(r.requests);
  stats.ok.fetch_add(r.ok);
  stats.failed.fetch_add(r.failed);
  stats.rejected.fetch_add(r.rejected);
  stats.bytes_verified.fetch_add(r.bytes);
  std::lock_guard<std::mutex> lock(stats.mu);
  for (const auto& [code, n] : r.codes) stats.failures_by_code[code] += n;
}

std::size_t ReaderChurn::poll(Stats& stats, Shared& shared) {
  std::size_t ended = 0;
  for (Reader& r : readers_) {
    if (!r.child) continue;
    read_lines(r, stats);
    const auto rc = r.child->wait_for(std::chrono::milliseconds(0));
    if (!rc) continue;
    read_lines(r, stats);  // what it wrote last
    ++ended;
    const bool sigkill =
        WIFSIGNALED(r.child->wait_status()) && WTERMSIG(r.child->wait_status()) == SIGKILL;
    if (sigkill && (r.asked_to_die || r.killed_now)) {
      ++counts_.kills;
      if (!r.killed_now) ++counts_.kills_in_read;
    } else {
      ++counts_.unexpected_exits;
      if (counts_.first_unexpected.empty()) {
        counts_.first_unexpected =
            "a decode process " + toolkit::describe_wait_status(r.child->wait_status());
      }
    }
    account(r, stats);
    start_one(r, shared);
  }
  return ended;
}

void ReaderChurn::kill_one(std::mt19937_64& rng) {
  std::vector<Reader*> live;
  for (Reader& r : readers_) {
    if (r.child && !r.killed_now) live.push_back(&r);
  }
  if (live.empty()) return;
  Reader& r = *live[rng() % live.size()];
  if (!r.asked_to_die && rng() % 2 == 0) {
    r.asked_to_die = true;  // it SIGKILLs itself inside its next read
    send(r, "DIE");
  } else {
    r.killed_now = true;
    r.child->signal(SIGKILL);
  }
}

void ReaderChurn::stop(Stats& stats) {
  for (Reader& r : readers_) {
    if (!r.child) continue;
    r.child->close_to_child();
  }
  for (Reader& r : readers_) {
    if (!r.child) continue;
    r.child->wait_exit(std::chrono::seconds(10));
    read_lines(r, stats);
    const bool clean =
        WIFEXITED(r.child->wait_status()) && WEXITSTATUS(r.child->wait_status()) == 0;
    const bool killed = WIFSIGNALED(r.child->wait_status()) &&
                        WTERMSIG(r.child->wait_status()) == SIGKILL &&
                        (r.asked_to_die || r.killed_now);
    if (killed) {
      ++counts_.kills;
      if (!r.killed_now) ++counts_.kills_in_read;
    } else if (!clean) {
      ++counts_.unexpected_exits;
      if (counts_.first_unexpected.empty()) {
        counts_.first_unexpected =
            "a decode process " + toolkit::describe_wait_status(r.child->wait_status());
      }
    }
    account(r, stats);
    r.child.reset();
  }
}

}  // namespace mstar::kv::cli::soak
