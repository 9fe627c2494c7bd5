// Copyright mstar-kv authors.
//
// HOST:PORT, parsed in one place for the engines that take a network
// address (ucx session ids) and the CLI (--listen, --from). Internal.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace mstar::kv {

struct HostPort {
  std::string host;  // a name, an IPv4 address or an IPv6 address (no brackets)
  std::uint16_t port = 0;
};

// "HOST:PORT" or "[IPV6]:PORT"; "HOST" alone takes `default_port`, and is
// refused without one. Throws Error(kInvalidArgument) naming `what` (e.g.
// "--listen", "ucx session id") and the value: no port, a port outside
// [1, 65535], or no host.
HostPort parse_host_port(const std::string& s, const std::string& what,
                         std::optional<std::uint16_t> default_port = std::nullopt);

}  // namespace mstar::kv
