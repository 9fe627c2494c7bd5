// Copyright mstar-kv authors.
#include "common/child_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <utility>

namespace mstar::kv::testing {

Child::Child(const std::vector<std::string>& argv,
             const std::map<std::string, std::string>& env, bool merge_stderr) {
  int to[2];
  int from[2];
  if (::pipe2(to, O_CLOEXEC) != 0 || ::pipe2(from, O_CLOEXEC) != 0) {
    throw std::runtime_error("pipe2 failed");
  }
  std::vector<std::string> a = argv;
  std::vector<char*> args;
  for (auto& s : a) args.push_back(s.data());
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(to[0], 0);
    ::dup2(from[1], 1);
    if (merge_stderr) ::dup2(from[1], 2);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  ::close(to[0]);
  ::close(from[1]);
  in_ = to[1];
  out_ = from[0];
}

Child::~Child() {
  if (pid_ > 0) kill_now();
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
}

std::string Child::read_line(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    if (auto nl = buf_.find('\n'); nl != std::string::npos) {
      std::string line = buf_.substr(0, nl);
      buf_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) throw std::runtime_error("timed out waiting for a line from the peer");
    pollfd p{out_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char tmp[65536];
    const ssize_t n = ::read(out_, tmp, sizeof tmp);
    if (n <= 0) throw std::runtime_error("peer closed its output: '" + buf_ + "'");
    buf_.append(tmp, static_cast<std::size_t>(n));
  }
}

std::string Child::read_all(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{out_, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    char tmp[65536];
    const ssize_t n = ::read(out_, tmp, sizeof tmp);
    if (n <= 0) break;
    buf_.append(tmp, static_cast<std::size_t>(n));
  }
  return std::exchange(buf_, std::string());
}

void Child::write_line(const std::string& line) {
  const std::string s = line + "\n";
  const char* p = s.data();
  std::size_t n = s.size();
  ::signal(SIGPIPE, SIG_IGN);
  while (n > 0) {
    const ssize_t k = ::write(in_, p, n);
    if (k <= 0) throw std::runtime_error("cannot write to the peer");
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

void Child::kill_now() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int Child::wait(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (pid_ > 0) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return status;
    }
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  kill_now();
  return -1;
}

}  // namespace mstar::kv::testing
