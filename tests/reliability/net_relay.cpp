// Copyright mstar-kv authors.
//
// net_relay: the network fault tests' own fault-injecting TCP relay.
//
// It runs in the router namespace of NetNamespaces(kRouted) (tests/common/
// netns.hpp), where one nft rule redirects every TCP connection that
// crosses the router, in either direction, to its port: the HTTP control
// plane, UCX's connection manager and UCX's tcp data connections (whose
// addresses the owner and the reader exchange inside UCX, which is why the
// relay is transparent rather than an address the reader is given). It
// learns where each connection was going (SO_ORIGINAL_DST), connects there
// and copies both ways, one reader and one writer thread per direction with
// a bounded queue between them (TCP's flow control reaches both ends).
//
// Its connections onward come from the router's own address, so each host
// sees the other at the router's address on its side; UCX's tcp transport
// connects back to the address a connection came from (with the port its
// peer advertised), so such a connection, to one of the router's addresses,
// is sent on to the host that address stands in for (--stand-in, one per
// side): a two-host NAT. Without it, UCX 1.13's owner retried the router's
// own address 25 times and then aborted on an assertion (tcp_ep.c:478).
//
// Usage: net_relay PORT [--stand-in ROUTER_IP=HOST_IP]... Prints "READY",
// then answers each command on stdin with one line:
//   pass            no fault (the start)
//   delay MS JIT    every chunk leaves MS +- JIT ms (uniform) after it
//                   arrived; a direction's chunks keep their order
//   stall           forward nothing until `resume` (connections stay open,
//                   queues fill, TCP pushes back on both ends)
//   resume
//   reset           reset every open connection: both of its ends get a RST
//   stats           "STATS connections N bytes B resets R"
//   quit            closes everything and exits
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;
// <linux/netfilter_ipv4.h>'s, which cannot be included beside <netinet/in.h>.
constexpr int kSoOriginalDst = 80;
constexpr std::size_t kChunk = 64 * 1024;
constexpr std::size_t kQueueCap = 8u << 20;  // bytes queued per direction at most

// What every connection obeys; changed by commands.
struct Faults {
  std::mutex mu;
  int delay_ms = 0;
  int jitter_ms = 0;
  std::mt19937_64 rng{12345};
  std::atomic<bool> stalled{false};

  // When a chunk read now may leave (not before `after`: order is kept).
  Clock::time_point due(Clock::time_point after) {
    std::lock_guard<std::mutex> lk(mu);
    int ms = delay_ms;
    if (jitter_ms > 0) {
      ms += std::uniform_int_distribution<int>(-jitter_ms, jitter_ms)(rng);
    }
    return std::max(after, Clock::now() + std::chrono::milliseconds(std::max(ms, 0)));
  }
};

Faults faults;
std::atomic<std::uint64_t> bytes_forwarded{0}, connections{0}, resets{0};

struct Chunk {
  Clock::time_point due;
  std::string bytes;  // empty: end of stream
};

struct Direction {
  int from = -1, to = -1;
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Chunk> queue;
  std::size_t queued = 0;
  Clock::time_point last_due{};
};

// One relayed connection: the client's socket, ours to the server, and the
// two directions between them. The last thread to leave closes the sockets
// (with a RST when it was reset).
struct Conn {
  int client = -1, server = -1;
  int wake = -1;  // eventfd: readable once the connection is torn down
  std::atomic<bool> dead{false};
  std::atomic<bool> rst{false};
  std::atomic<int> ends_done{0};  // directions that saw and passed on EOF
  Direction up, down;             // client -> server, server -> client

  ~Conn() {
    for (int fd : {client, server}) {
      if (fd < 0) continue;
      if (rst.load()) {
        linger l{1, 0};  // close() then sends a RST instead of a FIN
        ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
      }
      ::close(fd);
    }
    if (wake >= 0) ::close(wake);
  }
  void kill(bool with_rst) {
    if (with_rst) rst.store(true);
    if (dead.exchange(true)) return;
    const std::uint64_t one = 1;
    (void)!::write(wake, &one, sizeof one);
    for (Direction* d : {&up, &down}) {
      std::lock_guard<std::mutex> lk(d->mu);
      d->cv.notify_all();
    }
  }
};

std::mutex registry_mu;
std::vector<std::weak_ptr<Conn>> live;  // guarded by registry_mu
std::vector<std::thread> threads;       // guarded by registry_mu

// Waits until fd is ready for `events` or the connection dies; false when it died.
bool wait_fd(const Conn& c, int fd, short events) {
  pollfd p[2] = {{fd, events, 0}, {c.wake, POLLIN, 0}};
  while (true) {
    const int n = ::poll(p, 2, -1);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 || (p[1].revents & POLLIN) != 0) return false;
    if (p[0].revents != 0) return true;
  }
}

void read_side(const std::shared_ptr<Conn>& c, Direction& d) {
  std::string buf(kChunk, '\0');
  while (!c->dead.load()) {
    if (!wait_fd(*c, d.from, POLLIN)) return;
    const ssize_t n = ::recv(d.from, buf.data(), buf.size(), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n < 0) {  // reset by that end: pass the reset on
      c->kill(true);
      return;
    }
    std::unique_lock<std::mutex> lk(d.mu);
    d.cv.wait(lk, [&] { return c->dead.load() || d.queued < kQueueCap; });
    if (c->dead.load()) return;
    d.last_due = faults.due(d.last_due);
    d.queue.push_back(Chunk{d.last_due, buf.substr(0, static_cast<std::size_t>(n))});
    d.queued += static_cast<std::size_t>(n);
    d.cv.notify_all();
    if (n == 0) return;  // EOF queued
  }
}

bool send_all(const Conn& c, int fd, const std::string& bytes) {
  std::size_t off = 0;
  while (off < bytes.size()) {
    if (!wait_fd(c, fd, POLLOUT)) return false;
    const ssize_t n = ::send(fd, bytes.data() + off, bytes.size() - off, MSG_NOSIGNAL);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (n <= 0) return false;
    off += static_cast<std::size_t>(n);
  }
  return true;
}

void write_side(const std::shared_ptr<Conn>& c, Direction& d) {
  while (!c->dead.load()) {
    Chunk chunk;
    {
      std::unique_lock<std::mutex> lk(d.mu);
      d.cv.wait(lk, [&] { return c->dead.load() || !d.queue.empty(); });
      if (c->dead.load()) return;
      const auto due = d.queue.front().due;
      if (faults.stalled.load() || Clock::now() < due) {
        const auto until =
            faults.stalled.load() ? Clock::now() + std::chrono::milliseconds(2) : due;
        d.cv.wait_until(lk, until, [&] { return c->dead.load(); });
        continue;
      }
      chunk = std::move(d.queue.front());
      d.queue.pop_front();
      d.queued -= chunk.bytes.size();
      d.cv.notify_all();
    }
    if (chunk.bytes.empty()) {  // EOF: half-close towards the other end
      ::shutdown(d.to, SHUT_WR);
      if (c->ends_done.fetch_add(1) + 1 == 2) c->kill(false);
      return;
    }
    if (!send_all(*c, d.to, chunk.bytes)) {
      c->kill(true);
      return;
    }
    bytes_forwarded.fetch_add(chunk.bytes.size());
  }
}

int connect_to(const sockaddr_in& dst) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  const int flags = ::fcntl(fd, F_GETFL);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
  if (::connect(fd, reinterpret_cast<const sockaddr*>(&dst), sizeof dst) != 0 &&
      errno != EINPROGRESS) {
    ::close(fd);
    return -1;
  }
  pollfd p{fd, POLLOUT, 0};
  int err = 0;
  socklen_t len = sizeof err;
  if (::poll(&p, 1, 5000) != 1 || ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 ||
      err != 0) {
    ::close(fd);
    return -1;
  }
  ::fcntl(fd, F_SETFL, flags);
  return fd;
}

// Router address -> the host it stands in for (network byte order).
std::vector<std::pair<in_addr_t, in_addr_t>> stand_ins;

void relay(int client) {
  sockaddr_in dst{};
  socklen_t len = sizeof dst;
  const int one = 1;
  ::setsockopt(client, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  int server = -1;
  if (::getsockopt(client, SOL_IP, kSoOriginalDst, &dst, &len) == 0) {
    for (const auto& [router, host] : stand_ins) {
      if (dst.sin_addr.s_addr == router) dst.sin_addr.s_addr = host;
    }
    server = connect_to(dst);
  }
  if (server < 0) {  // refuse as the destination would: a RST
    linger l{1, 0};
    ::setsockopt(client, SOL_SOCKET, SO_LINGER, &l, sizeof l);
    ::close(client);
    return;
  }
  auto c = std::make_shared<Conn>();
  c->client = client;
  c->server = server;
  c->wake = ::eventfd(0, EFD_CLOEXEC);
  c->up.from = c->down.to = client;
  c->up.to = c->down.from = server;
  connections.fetch_add(1);
  std::lock_guard<std::mutex> lk(registry_mu);
  live.push_back(c);
  threads.emplace_back(read_side, c, std::ref(c->up));
  threads.emplace_back(write_side, c, std::ref(c->up));
  threads.emplace_back(read_side, c, std::ref(c->down));
  threads.emplace_back(write_side, c, std::ref(c->down));
}

void kill_all(bool with_rst) {
  std::lock_guard<std::mutex> lk(registry_mu);
  for (auto& w : live) {
    if (auto c = w.lock()) {
      if (with_rst && !c->dead.load()) resets.fetch_add(1);
      c->kill(with_rst);
    }
  }
  live.clear();
}

void reply(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  bool usage_ok = argc >= 2 && argc % 2 == 0;
  for (int i = 2; usage_ok && i + 1 < argc; i += 2) {
    const std::string map = argv[i + 1];
    const auto eq = map.find('=');
    in_addr router{}, host{};
    usage_ok = std::string(argv[i]) == "--stand-in" && eq != std::string::npos &&
               ::inet_pton(AF_INET, map.substr(0, eq).c_str(), &router) == 1 &&
               ::inet_pton(AF_INET, map.substr(eq + 1).c_str(), &host) == 1;
    stand_ins.emplace_back(router.s_addr, host.s_addr);
  }
  if (!usage_ok) {
    std::fprintf(stderr, "usage: net_relay PORT [--stand-in ROUTER_IP=HOST_IP]...\n");
    return 2;
  }
  ::signal(SIGPIPE, SIG_IGN);
  const int lfd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  ::setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(std::atoi(argv[1])));
  if (::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(lfd, 128) != 0) {
    std::fprintf(stderr, "net_relay: cannot listen on port %s: %s\n", argv[1],
                 std::strerror(errno));
    return 1;
  }
  const int stop = ::eventfd(0, EFD_CLOEXEC);
  std::thread acceptor([&] {
    pollfd p[2] = {{lfd, POLLIN, 0}, {stop, POLLIN, 0}};
    while (::poll(p, 2, -1) >= 0 && (p[1].revents & POLLIN) == 0) {
      if ((p[0].revents & POLLIN) == 0) continue;
      const int fd = ::accept4(lfd, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd >= 0) relay(fd);
    }
  });
  reply("READY");
  for (std::string line; std::getline(std::cin, line);) {
    std::istringstream in(line);
    std::string cmd;
    in >> cmd;
    if (cmd == "pass" || cmd == "delay") {
      int ms = 0, jit = 0;
      if (cmd == "delay" && !(in >> ms >> jit)) {
        reply("ERR delay needs MS JITTER_MS");
        continue;
      }
      {
        std::lock_guard<std::mutex> lk(faults.mu);
        faults.delay_ms = ms;
        faults.jitter_ms = jit;
      }
      faults.stalled.store(false);
      reply("OK " + cmd);
    } else if (cmd == "stall" || cmd == "resume") {
      faults.stalled.store(cmd == "stall");
      reply("OK " + cmd);
    } else if (cmd == "reset") {
      kill_all(true);
      reply("OK reset");
    } else if (cmd == "stats") {
      reply("STATS connections " + std::to_string(connections.load()) + " bytes " +
            std::to_string(bytes_forwarded.load()) + " resets " + std::to_string(resets.load()));
    } else if (cmd == "quit") {
      break;
    } else {
      reply("ERR unknown command '" + cmd + "'");
    }
  }
  const std::uint64_t v = 1;
  (void)!::write(stop, &v, sizeof v);
  acceptor.join();
  faults.stalled.store(false);
  kill_all(false);
  std::vector<std::thread> all;
  {
    std::lock_guard<std::mutex> lk(registry_mu);
    all.swap(threads);
  }
  for (auto& t : all) t.join();
  ::close(lfd);
  ::close(stop);
  return 0;
}
