// Copyright mstar-kv authors.
#include "demo_proc.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cli::demo {

namespace {

constexpr std::uint32_t kMaxFrame = 64u << 20;

[[noreturn]] void sys_fail(const std::string& what) {
  throw Error(StatusCode::kInternal, what + ": " + std::strerror(errno));
}

// Reads exactly n bytes before the deadline.
void read_exact(int fd, std::uint8_t* out, std::size_t n,
                std::chrono::steady_clock::time_point deadline, const std::string& peer,
                std::chrono::milliseconds timeout) {
  std::size_t got = 0;
  while (got < n) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      throw Error(StatusCode::kTimeout, "no message from the " + peer + " process within " +
                                            std::to_string(timeout.count()) + " ms");
    }
    pollfd p{fd, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1000)));
    if (r < 0) {
      if (errno == EINTR) continue;
      sys_fail("poll on the demo channel");
    }
    if (r == 0) continue;
    const ssize_t k = ::read(fd, out + got, n - got);
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw Error(StatusCode::kPeerFailure,
                  "the " + peer + " process's channel failed: " + std::strerror(errno));
    }
    if (k == 0) {
      throw Error(StatusCode::kPeerFailure,
                  "the " + peer + " process closed the channel (it exited or died)");
    }
    got += static_cast<std::size_t>(k);
  }
}

void write_all(int fd, const std::uint8_t* p, std::size_t n) {
  while (n > 0) {
    // MSG_NOSIGNAL: a dead peer is an error here, not a SIGPIPE.
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0) {
      if (errno == EINTR) continue;
      throw Error(StatusCode::kPeerFailure,
                  std::string("the other demo process is gone: ") + std::strerror(errno));
    }
    p += k;
    n -= static_cast<std::size_t>(k);
  }
}

}  // namespace

void write_frame(int fd, const std::vector<std::uint8_t>& bytes) {
  const auto n = static_cast<std::uint32_t>(bytes.size());
  const std::uint8_t len[4] = {static_cast<std::uint8_t>(n), static_cast<std::uint8_t>(n >> 8),
                               static_cast<std::uint8_t>(n >> 16),
                               static_cast<std::uint8_t>(n >> 24)};
  write_all(fd, len, 4);
  write_all(fd, bytes.data(), bytes.size());
}

std::vector<std::uint8_t> read_frame(int fd, std::chrono::milliseconds timeout,
                                     const std::string& peer) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::uint8_t len[4];
  read_exact(fd, len, 4, deadline, peer, timeout);
  const std::uint32_t n = std::uint32_t{len[0]} | std::uint32_t{len[1]} << 8 |
                          std::uint32_t{len[2]} << 16 | std::uint32_t{len[3]} << 24;
  if (n > kMaxFrame) {
    throw Error(StatusCode::kCorruptDescriptor, "the " + peer + " process sent a frame of " +
                                                    std::to_string(n) + " bytes, limit " +
                                                    std::to_string(kMaxFrame));
  }
  std::vector<std::uint8_t> out(n);
  read_exact(fd, out.data(), n, deadline, peer, timeout);
  return out;
}

void write_byte(int fd, std::uint8_t b) { write_all(fd, &b, 1); }

std::uint8_t read_byte(int fd, std::chrono::milliseconds timeout, const std::string& peer) {
  std::uint8_t b = 0;
  read_exact(fd, &b, 1, std::chrono::steady_clock::now() + timeout, peer, timeout);
  return b;
}

}  // namespace mstar::kv::cli::demo
