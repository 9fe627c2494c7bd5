// Copyright mstar-kv authors.
//
// The ucx engine's addresses (internal to the engine): a session id is
// HOST:PORT (an IPv6 host in brackets), resolved for UCX's sockaddr
// connection manager. Errors are kInvalidArgument naming the value.
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "mstar/kv/status.hpp"

namespace mstar::kv::ucx {

struct HostPort {
  std::string host;
  std::uint16_t port = 0;
};

inline HostPort parse_host_port(const std::string& s) {
  const auto colon = s.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == s.size()) {
    throw Error(StatusCode::kInvalidArgument,
                "ucx session id '" + s + "' is not HOST:PORT");
  }
  HostPort hp;
  hp.host = s.substr(0, colon);
  if (hp.host.size() > 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  const std::string port = s.substr(colon + 1);
  unsigned long v = 0;
  for (char c : port) {
    if (c < '0' || c > '9' || v > 65535) {
      throw Error(StatusCode::kInvalidArgument,
                  "ucx session id '" + s + "': port '" + port + "' is not in [1, 65535]");
    }
    v = v * 10 + static_cast<unsigned>(c - '0');
  }
  if (v == 0 || v > 65535) {
    throw Error(StatusCode::kInvalidArgument,
                "ucx session id '" + s + "': port " + port + " is not in [1, 65535]");
  }
  hp.port = static_cast<std::uint16_t>(v);
  return hp;
}

inline sockaddr_storage resolve(const HostPort& hp, socklen_t* len) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string port = std::to_string(hp.port);
  const int rc = ::getaddrinfo(hp.host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0 || res == nullptr) {
    throw Error(StatusCode::kInvalidArgument,
                "cannot resolve ucx host '" + hp.host + "': " + ::gai_strerror(rc));
  }
  sockaddr_storage ss{};
  std::memcpy(&ss, res->ai_addr, res->ai_addrlen);
  *len = res->ai_addrlen;
  ::freeaddrinfo(res);
  return ss;
}

}  // namespace mstar::kv::ucx
