// Copyright mstar-kv authors.
//
// TCP ports as the kernel lists them (/proc/net/tcp, tcp6): who listens
// where, a free port for a benchmark server, a client connection.
#pragma once

#include <string>
#include <vector>

namespace mstar::kv::testkit {

// The sockets listening on TCP `port`: for IPv4 the local address as the
// kernel writes it (hex, e.g. "0100007F" for 127.0.0.1), for IPv6
// "v6:" + address:port.
std::vector<std::string> tcp_listeners(int port);
// True when some socket listens on TCP `port` (any address).
bool tcp_port_listening(int port);
// A random TCP port in [20000, 30000) that nothing listens on (outside the
// kernel's ephemeral range).
int pick_port();
// A socket listening on 127.0.0.1 at a port the kernel picks (*port); -1
// (errno set) when it cannot.
int listen_loopback(int* port);
// A TCP connection to 127.0.0.1:port (TCP_NODELAY, receives time out after
// `recv_timeout_s`); -1 when it cannot connect.
int connect_loopback(int port, int recv_timeout_s = 5);

}  // namespace mstar::kv::testkit
