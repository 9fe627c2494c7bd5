// Copyright mstar-kv authors.
#include "bench_tcp.hpp"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "bench_proc.hpp"
#include "testkit/ports.hpp"

namespace mstar::kv::cli::bench {

namespace {

using Clock = std::chrono::steady_clock;

// A listener on loopback for `what` ("tcp stream"), or -1 with *error set.
int listen_for(const char* what, int* port, std::string* error) {
  const int fd = testkit::listen_loopback(port);
  if (fd < 0) *error = std::string(what) + ": cannot listen: " + std::strerror(errno);
  return fd;
}

constexpr std::uint64_t kWriteBytes = 1u << 20;
constexpr std::uint64_t kRoundTripMaxBytes = 8u << 20;

}  // namespace

RttResult run_tcp_round_trip(std::uint64_t reply_bytes, std::uint32_t iters) {
  RttResult r;
  int port = 0;
  const int lfd = listen_for("tcp round trip", &port, &r.error);
  if (lfd < 0) return r;
  const int one = 1;
  // The server: a 1-byte request in, reply_bytes out, until the client closes.
  std::thread server([&] {
    const int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    std::vector<char> reply(reply_bytes, 'x');
    char req = 0;
    while (::recv(fd, &req, 1, MSG_WAITALL) == 1) {
      if (!write_all(fd, reply.data(), reply.size())) break;
    }
    ::close(fd);
  });
  const int fd = testkit::connect_loopback(port, 10);
  std::vector<double> us;
  if (fd >= 0) {
    std::vector<char> buf(reply_bytes);
    for (std::uint32_t i = 0; i < iters + 10; ++i) {
      const auto t0 = Clock::now();
      const char req = 'r';
      if (::send(fd, &req, 1, MSG_NOSIGNAL) != 1 ||
          ::recv(fd, buf.data(), buf.size(), MSG_WAITALL) != static_cast<ssize_t>(buf.size())) {
        r.error = std::string("tcp round trip failed: ") + std::strerror(errno);
        break;
      }
      if (i >= 10)
        us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
    ::close(fd);
  } else {
    r.error = "tcp round trip: cannot connect";
  }
  ::shutdown(lfd, SHUT_RDWR);
  ::close(lfd);
  server.join();
  if (us.size() == iters) {
    std::nth_element(us.begin(), us.begin() + static_cast<std::ptrdiff_t>(us.size() / 2), us.end());
    r.p50_us = us[us.size() / 2];
    r.ok = true;
  }
  return r;
}

StreamResult run_tcp_stream(std::uint64_t bytes, std::uint32_t reps) {
  StreamResult r;
  int port = 0;
  const int lfd = listen_for("tcp stream", &port, &r.error);
  if (lfd < 0) return r;
  // The sender: `reps` times every byte of its buffer, in 1 MiB writes.
  std::thread sender([&] {
    const int fd = ::accept(lfd, nullptr, nullptr);
    if (fd < 0) return;
    std::vector<char> src(bytes, 'x');
    for (std::uint32_t i = 0; i < reps; ++i) {
      bool ok = true;
      for (std::uint64_t off = 0; ok && off < bytes; off += kWriteBytes) {
        ok = write_all(fd, src.data() + off, std::min(kWriteBytes, bytes - off));
      }
      if (!ok) break;
    }
    ::close(fd);
  });
  const int fd = testkit::connect_loopback(port, 10);
  std::vector<double> gbps;
  if (fd >= 0) {
    std::vector<char> dst(bytes, 'y');
    for (std::uint32_t i = 0; i < reps && r.error.empty(); ++i) {
      const auto t0 = Clock::now();
      for (std::uint64_t off = 0; off < bytes;) {
        const ssize_t n = ::recv(fd, dst.data() + off, std::min(kWriteBytes, bytes - off), 0);
        if (n <= 0) {
          r.error = std::string("tcp stream failed: ") + (n == 0 ? "closed" : std::strerror(errno));
          break;
        }
        off += static_cast<std::uint64_t>(n);
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r.error.empty()) gbps.push_back(static_cast<double>(bytes) / s / 1e9);
    }
    ::close(fd);
  } else {
    r.error = "tcp stream: cannot connect";
  }
  ::shutdown(lfd, SHUT_RDWR);
  ::close(lfd);
  sender.join();
  if (gbps.size() == reps && reps > 0) {
    std::sort(gbps.begin(), gbps.end());
    r.gbps = gbps[gbps.size() / 2];
    r.ok = true;
  }
  return r;
}

void note_tcp_floors(Report& report, const std::set<std::string>& over_tcp, Progress& progress) {
  std::map<std::uint64_t, RttResult> rtt;
  std::map<std::uint64_t, StreamResult> stream;
  for (CaseResult& c : report.cases) {
    const std::uint64_t bytes = c.workload.bytes_per_request();
    if (!c.ok || over_tcp.count(c.engine) == 0) continue;
    char buf[256];
    if (bytes <= kRoundTripMaxBytes) {
      if (rtt.count(bytes) == 0) {
        progress.set_label("tcp round trip " + size_name(bytes));
        rtt[bytes] = run_tcp_round_trip(bytes, 200);
        if (!rtt[bytes].ok) report.notes.push_back("no tcp round trip: " + rtt[bytes].error);
      }
      if (!rtt[bytes].ok) continue;
      std::snprintf(buf, sizeof buf,
                    "%s %s: p50 %.0f us = %.2fx a TCP round trip of its %s (%.0f us)",
                    c.engine.c_str(), c.workload.name.c_str(), c.p50_us,
                    c.p50_us / rtt[bytes].p50_us, size_name(bytes).c_str(), rtt[bytes].p50_us);
    } else {
      if (stream.count(bytes) == 0) {
        progress.set_label("tcp stream " + size_name(bytes));
        stream[bytes] = run_tcp_stream(bytes, 3);
        if (!stream[bytes].ok) report.notes.push_back("no tcp stream: " + stream[bytes].error);
      }
      if (!stream[bytes].ok) continue;
      c.extra["tcp_stream_same_bytes"] = stream[bytes].gbps;
      std::snprintf(buf, sizeof buf,
                    "%s %s: %.2f GB/s = %.2f of one TCP stream carrying its %s from and into "
                    "memory of that size (%.2f GB/s)",
                    c.engine.c_str(), c.workload.name.c_str(), c.gbps.median,
                    c.gbps.median / stream[bytes].gbps, size_name(bytes).c_str(),
                    stream[bytes].gbps);
    }
    report.notes.push_back(buf);
  }
}

}  // namespace mstar::kv::cli::bench
