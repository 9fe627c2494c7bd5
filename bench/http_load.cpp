// Copyright mstar-kv authors.
//
// A small keep-alive HTTP/1.1 load generator for `mstar-kv serve`'s control
// plane (no dependencies; one thread, epoll). N connections each carry one
// request at a time.
//   closed loop (--rate 0): every connection sends its next request as soon
//     as the previous reply is in: the most the server gives;
//   open loop (--rate R): requests are due at a fixed R per second over all
//     connections; a latency counts from when its request was due, so a
//     stalled server is not hidden (no coordinated omission).
// Prints requests/s, p50 / p90 / p99 / p99.9 / max latency and non-200s.
//
//   mstar_kv_http_load --port 23480 --path /v1/sequences/0 --connections 32
//                      --seconds 5 [--rate 5000] [--token-file F]
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Conn {
  int fd = -1;
  bool busy = false;
  Clock::time_point due;  // when its current request was due (or sent)
  std::string in;
};

[[noreturn]] void die(const std::string& what) {
  std::fprintf(stderr, "http_load: %s\n", what.c_str());
  std::exit(1);
}

// Parses one complete response at the front of `in`; returns its length
// (0: not complete yet) and its status.
std::size_t parse(const std::string& in, int* status) {
  const auto end = in.find("\r\n\r\n");
  if (end == std::string::npos) return 0;
  std::sscanf(in.c_str(), "HTTP/%*s %d", status);
  std::size_t len = 0;
  for (const char* key : {"Content-Length:", "content-length:"}) {
    const auto at = in.find(key);
    if (at != std::string::npos && at < end) len = std::strtoul(in.c_str() + at + 15, nullptr, 10);
  }
  return in.size() >= end + 4 + len ? end + 4 + len : 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string host = "127.0.0.1", path = "/v1/sequences/0", token_file;
  int port = 23480, conns = 32;
  double seconds = 5, rate = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--host")
      host = v;
    else if (k == "--port")
      port = std::atoi(v.c_str());
    else if (k == "--path")
      path = v;
    else if (k == "--connections")
      conns = std::atoi(v.c_str());
    else if (k == "--seconds")
      seconds = std::atof(v.c_str());
    else if (k == "--rate")
      rate = std::atof(v.c_str());
    else if (k == "--token-file")
      token_file = v;
    else
      die("unknown option " + k +
          " (--host --port --path --connections --seconds --rate "
          "--token-file)");
  }
  if (conns < 1 || conns > 10000 || seconds <= 0 || rate < 0) die("bad options");
  std::string auth;
  if (!token_file.empty()) {
    std::ifstream f(token_file);
    std::stringstream ss;
    ss << f.rdbuf();
    std::string t = ss.str();
    while (!t.empty() && (t.back() == '\n' || t.back() == '\r')) t.pop_back();
    auth = "Authorization: Bearer " + t + "\r\n";
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: " + host + "\r\n" + auth + "\r\n";

  const int ep = ::epoll_create1(EPOLL_CLOEXEC);
  std::vector<Conn> cs(static_cast<std::size_t>(conns));
  for (std::size_t i = 0; i < cs.size(); ++i) {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<std::uint16_t>(port));
    if (::inet_pton(AF_INET, host.c_str(), &a.sin_addr) != 1) die("--host must be IPv4: " + host);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      die("connect " + host + ":" + std::to_string(port) + ": " + std::strerror(errno));
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    cs[i].fd = fd;
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.u64 = i;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev);
  }

  std::vector<double> lat_us;
  lat_us.reserve(1 << 20);
  std::uint64_t non200 = 0, scheduled = 0;
  std::deque<Clock::time_point> backlog;  // open loop: due, not yet sent
  std::vector<std::size_t> idle;
  for (std::size_t i = 0; i < cs.size(); ++i) idle.push_back(i);
  auto send_on = [&](std::size_t i, Clock::time_point due) {
    cs[i].busy = true;
    cs[i].due = due;
    if (::send(cs[i].fd, req.data(), req.size(), MSG_NOSIGNAL) !=
        static_cast<ssize_t>(req.size())) {
      die("send failed (server closed the connection?)");
    }
  };
  const auto t0 = Clock::now();
  const auto t_end =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  const auto period =
      rate > 0 ? std::chrono::duration<double>(1.0 / rate) : std::chrono::duration<double>(0);
  if (rate == 0) {
    for (std::size_t i : idle) send_on(i, Clock::now());
    idle.clear();
  }
  std::vector<epoll_event> evs(static_cast<std::size_t>(conns));
  char buf[65536];
  for (;;) {
    auto now = Clock::now();
    if (now >= t_end) break;
    if (rate > 0) {  // queue what fell due; send on idle connections
      for (;;) {
        const auto due = t0 + std::chrono::duration_cast<Clock::duration>(
                                  period * static_cast<double>(scheduled));
        if (due > now) break;
        backlog.push_back(due);
        ++scheduled;
      }
      while (!backlog.empty() && !idle.empty()) {
        send_on(idle.back(), backlog.front());
        idle.pop_back();
        backlog.pop_front();
      }
    }
    timespec ts{0, 1000000};  // 1 ms at most
    if (rate > 0) {
      const auto next =
          t0 + std::chrono::duration_cast<Clock::duration>(period * static_cast<double>(scheduled));
      const auto wait = std::chrono::duration_cast<std::chrono::nanoseconds>(next - now).count();
      ts.tv_nsec = std::clamp<long>(static_cast<long>(wait), 0, 1000000);
    }
    const int n = ::epoll_pwait2(ep, evs.data(), conns, &ts, nullptr);
    for (int e = 0; e < n; ++e) {
      const std::size_t i = evs[static_cast<std::size_t>(e)].data.u64;
      const ssize_t got = ::recv(cs[i].fd, buf, sizeof buf, 0);
      if (got <= 0) die("connection " + std::to_string(i) + " closed by the server");
      cs[i].in.append(buf, static_cast<std::size_t>(got));
      int status = 0;
      const std::size_t len = parse(cs[i].in, &status);
      if (len == 0) continue;
      cs[i].in.erase(0, len);
      now = Clock::now();
      lat_us.push_back(std::chrono::duration<double, std::micro>(now - cs[i].due).count());
      if (status != 200) ++non200;
      cs[i].busy = false;
      if (rate == 0) {
        send_on(i, now);
      } else if (!backlog.empty()) {
        send_on(i, backlog.front());
        backlog.pop_front();
      } else {
        idle.push_back(i);
      }
    }
  }
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  std::sort(lat_us.begin(), lat_us.end());
  auto pct = [&](double p) {
    return lat_us.empty()
               ? 0.0
               : lat_us[std::min(lat_us.size() - 1, static_cast<std::size_t>(p * lat_us.size()))] /
                     1e3;
  };
  std::printf("%zu requests in %.2f s over %d keep-alive connections (%s): %.0f requests/s\n",
              lat_us.size(), took, conns,
              rate > 0
                  ? ("open loop, " + std::to_string(static_cast<long>(rate)) + "/s due").c_str()
                  : "closed loop",
              static_cast<double>(lat_us.size()) / took);
  std::printf(
      "latency ms: p50 %.3f  p90 %.3f  p99 %.3f  p99.9 %.3f  max %.3f; non-200: %llu; "
      "still due at the end: %zu\n",
      pct(0.5), pct(0.9), pct(0.99), pct(0.999), lat_us.empty() ? 0.0 : lat_us.back() / 1e3,
      static_cast<unsigned long long>(non200), backlog.size());
  return non200 == 0 ? 0 : 1;
}
