// Copyright mstar-kv authors.
//
// `mstar-kv soak`'s prefill processes, seen from the supervisor: started as
// re-execs of this program, SIGKILLed and reaped, and what they publish.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>

#include "soak_shared.hpp"

namespace mstar::kv::cli::soak {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

static void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

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

}  // namespace mstar::kv::cli::soak
