// Copyright mstar-kv authors.
#include "testkit/ports.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cerrno>
#include <fstream>
#include <random>
#include <sstream>

namespace mstar::kv::testkit {

std::vector<std::string> tcp_listeners(int port) {
  std::vector<std::string> out;
  for (const char* file : {"/proc/net/tcp", "/proc/net/tcp6"}) {
    std::ifstream in(file);
    std::string line;
    std::getline(in, line);  // header
    while (std::getline(in, line)) {
      std::istringstream ss(line);
      std::string slot, local, remote, state;
      ss >> slot >> local >> remote >> state;
      const auto colon = local.rfind(':');
      if (state != "0A" || colon == std::string::npos) continue;  // 0A = LISTEN
      if (std::stoi(local.substr(colon + 1), nullptr, 16) != port) continue;
      out.push_back(std::string(file).find('6') != std::string::npos ? "v6:" + local
                                                                     : local.substr(0, colon));
    }
  }
  return out;
}

bool tcp_port_listening(int port) { return !tcp_listeners(port).empty(); }

int pick_port() {
  std::random_device rd;
  std::mt19937 gen(rd());
  std::uniform_int_distribution<int> dist(20000, 29999);
  for (int i = 0; i < 100; ++i) {
    const int p = dist(gen);
    if (!tcp_port_listening(p)) return p;
  }
  return dist(gen);
}

int listen_loopback(int* port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 1) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int saved = errno;
    ::close(fd);
    errno = saved;
    return -1;
  }
  *port = ntohs(a.sin_port);
  return fd;
}

int connect_loopback(int port, int recv_timeout_s) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{recv_timeout_s, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace mstar::kv::testkit
