// Copyright mstar-kv authors.
#include "shm_test_util.hpp"

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

namespace mstar::kv::shmtest {

std::string to_hex(const std::vector<std::uint8_t>& bytes) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (auto b : bytes) {
    s += d[b >> 4];
    s += d[b & 15];
  }
  return s;
}

std::vector<std::uint8_t> from_hex(const std::string& hex) {
  auto v = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    throw std::runtime_error("bad hex");
  };
  std::vector<std::uint8_t> out;
  for (std::size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<std::uint8_t>(v(hex[i]) << 4 | v(hex[i + 1])));
  }
  return out;
}

std::string layout_arg(const KVLayout& l) {
  std::ostringstream s;
  s << l.num_layers << ',' << l.num_pages << ',' << l.page_size << ',' << l.num_kv_heads << ','
    << l.head_dim << ',' << to_string(l.cache_order) << ',' << to_string(l.page_order);
  return s.str();
}

KVLayout parse_layout(const std::string& s) {
  std::vector<std::string> f;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');) f.push_back(x);
  if (f.size() != 7) throw std::runtime_error("bad layout argument '" + s + "'");
  KVLayout l;
  l.num_layers = static_cast<std::uint32_t>(std::stoul(f[0]));
  l.num_pages = static_cast<std::uint32_t>(std::stoul(f[1]));
  l.page_size = static_cast<std::uint32_t>(std::stoul(f[2]));
  l.num_kv_heads = static_cast<std::uint32_t>(std::stoul(f[3]));
  l.head_dim = static_cast<std::uint32_t>(std::stoul(f[4]));
  l.dtype = DType::kBFloat16;
  l.cache_order = parse_cache_order(f[5]);
  l.page_order = parse_page_order(f[6]);
  l.validate();
  return l;
}

Child::Child(const std::vector<std::string>& argv) {
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
    ::dup2(from[1], 2);
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

}  // namespace mstar::kv::shmtest
