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

#include "mstar/kv/util/status.hpp"
#include "util/host_port.hpp"

namespace mstar::kv::ucx {

using mstar::kv::HostPort;

// A ucx session id, "HOST:PORT" (util/host_port.hpp, shared with the CLI).
inline HostPort parse_host_port(const std::string& s) {
  return mstar::kv::parse_host_port(s, "ucx session id");
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
