// Copyright mstar-kv authors.
#include "util/host_port.hpp"

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

HostPort parse_host_port(const std::string& s, const std::string& what,
                         std::optional<std::uint16_t> default_port) {
  // The port follows the last ':' outside brackets ("[::1]:80", "h:80").
  const auto bracket = s.rfind(']');
  auto colon = s.rfind(':');
  if (colon != std::string::npos && bracket != std::string::npos && colon < bracket) {
    colon = std::string::npos;  // "[::1]": the colons are the address's
  }
  HostPort hp;
  if (colon == std::string::npos) {
    if (!default_port) {
      throw Error(StatusCode::kInvalidArgument, what + " '" + s + "' is not HOST:PORT");
    }
    hp.host = s;
    hp.port = *default_port;
  } else {
    hp.host = s.substr(0, colon);
    const std::string port = s.substr(colon + 1);
    unsigned long v = 0;
    bool ok = !port.empty() && port.size() <= 5;
    for (char c : port) {
      if (c < '0' || c > '9') ok = false;
      if (ok) v = v * 10 + static_cast<unsigned>(c - '0');
    }
    if (!ok || v == 0 || v > 65535) {
      throw Error(StatusCode::kInvalidArgument,
                  what + " '" + s + "': port '" + port + "' is not in [1, 65535]");
    }
    hp.port = static_cast<std::uint16_t>(v);
  }
  if (hp.host.size() >= 2 && hp.host.front() == '[' && hp.host.back() == ']') {
    hp.host = hp.host.substr(1, hp.host.size() - 2);
  }
  if (hp.host.empty()) {
    throw Error(StatusCode::kInvalidArgument, what + " '" + s + "' has no host");
  }
  return hp;
}

}  // namespace mstar::kv
