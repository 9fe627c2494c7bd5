// Copyright mstar-kv authors.
#include "peer_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <stdexcept>

#ifndef KV_CONFORMANCE_PEER_PATH
#error "KV_CONFORMANCE_PEER_PATH must name the peer executable"
#endif

namespace mstar::kv::testing {

PeerProcess::PeerProcess(const PeerSpec& spec, std::chrono::milliseconds timeout) {
  int in_pipe[2];
  int out_pipe[2];
  if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0) {
    throw std::runtime_error("pipe failed");
  }
  std::vector<std::string> args = {KV_CONFORMANCE_PEER_PATH,
                                   "--engine", spec.engine,
                                   "--layout", layout_arg(spec.layout),
                                   "--tokens", std::to_string(spec.tokens),
                                   "--seed", std::to_string(spec.seed),
                                   "--scatter", std::to_string(spec.scatter_seed)};
  for (const auto& [k, v] : spec.extra) {
    args.push_back("--extra");
    args.push_back(k + "=" + v);
  }
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    ::dup2(in_pipe[0], 0);
    ::dup2(out_pipe[1], 1);
    for (const auto& [k, v] : spec.env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(argv[0], argv.data());
    std::perror("execv kv_conformance_peer");
    ::_exit(127);
  }
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  to_child_ = in_pipe[1];
  from_child_ = out_pipe[0];

  // Read lines until "SEQ <hex>" or "ERR <message>".
  std::string buf;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto nl = buf.find('\n');
    if (nl != std::string::npos) {
      const std::string line = buf.substr(0, nl);
      buf.erase(0, nl + 1);
      if (line.rfind("SEQ ", 0) == 0) {
        seq_ = SequenceInfo::decode(from_hex(line.substr(4)));
        return;
      }
      if (line.rfind("ERR ", 0) == 0) {
        kill_now();
        throw std::runtime_error("peer failed: " + line.substr(4));
      }
      continue;
    }
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      kill_now();
      throw std::runtime_error("peer did not publish its sequence in time");
    }
    pollfd p{from_child_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    char chunk[4096];
    const ssize_t n = ::read(from_child_, chunk, sizeof chunk);
    if (n <= 0) {
      kill_now();
      throw std::runtime_error("peer exited before publishing its sequence");
    }
    buf.append(chunk, static_cast<std::size_t>(n));
  }
}

void PeerProcess::kill_now() {
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int status = 0;
    while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
  }
}

void PeerProcess::quit() {
  if (pid_ <= 0) return;
  static const char msg[] = "quit\n";
  if (::write(to_child_, msg, sizeof msg - 1) < 0) {
    kill_now();
    return;
  }
  // Give it a moment to shut down cleanly, then insist.
  for (int i = 0; i < 200; ++i) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return;
    }
    ::usleep(10000);
  }
  kill_now();
}

PeerProcess::~PeerProcess() {
  kill_now();
  if (to_child_ >= 0) ::close(to_child_);
  if (from_child_ >= 0) ::close(from_child_);
}

}  // namespace mstar::kv::testing
