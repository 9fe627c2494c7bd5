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

std::string layout_arg(const KVLayout& l) {
  std::ostringstream o;
  o << l.num_layers << ',' << l.num_pages << ',' << l.page_size << ',' << l.num_kv_heads << ','
    << l.head_dim << ',' << to_string(l.dtype) << ',' << (l.has_v ? 1 : 0) << ','
    << to_string(l.cache_order) << ',' << to_string(l.page_order);
  return o.str();
}

KVLayout parse_layout_arg(const std::string& s) {
  std::vector<std::string> f;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) f.push_back(part);
  if (f.size() != 9) throw std::runtime_error("bad layout argument '" + s + "'");
  KVLayout l;
  l.num_layers = static_cast<std::uint32_t>(std::stoul(f[0]));
  l.num_pages = static_cast<std::uint32_t>(std::stoul(f[1]));
  l.page_size = static_cast<std::uint32_t>(std::stoul(f[2]));
  l.num_kv_heads = static_cast<std::uint32_t>(std::stoul(f[3]));
  l.head_dim = static_cast<std::uint32_t>(std::stoul(f[4]));
  l.dtype = parse_dtype(f[5]);
  l.has_v = f[6] == "1";
  l.cache_order = parse_cache_order(f[7]);
  l.page_order = parse_page_order(f[8]);
  l.validate();
  return l;
}

std::string to_hex(const std::vector<std::uint8_t>& bytes) {
  static const char* d = "0123456789abcdef";
  std::string out;
  out.reserve(bytes.size() * 2);
  for (auto b : bytes) {
    out.push_back(d[b >> 4]);
    out.push_back(d[b & 15]);
  }
  return out;
}

std::vector<std::uint8_t> from_hex(const std::string& hex) {
  auto nib = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw std::runtime_error("bad hex digit");
  };
  if (hex.size() % 2 != 0) throw std::runtime_error("odd hex length");
  std::vector<std::uint8_t> out(hex.size() / 2);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = static_cast<std::uint8_t>(nib(hex[2 * i]) << 4 | nib(hex[2 * i + 1]));
  }
  return out;
}

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
