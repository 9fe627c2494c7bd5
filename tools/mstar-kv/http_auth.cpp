// Copyright mstar-kv authors.
#include "http_auth.hpp"

#include <arpa/inet.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cli {

std::string read_token_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error(StatusCode::kInvalidArgument,
                "--token-file '" + path + "' cannot be read: " + std::strerror(errno));
  }
  std::ostringstream ss;
  ss << in.rdbuf();
  std::string token = ss.str();
  if (token.size() > 4096) {
    throw Error(StatusCode::kInvalidArgument, "--token-file '" + path + "' holds " +
                                                  std::to_string(token.size()) +
                                                  " bytes, more than a token's limit of 4096");
  }
  if (!token.empty() && token.back() == '\n') token.pop_back();
  if (!token.empty() && token.back() == '\r') token.pop_back();
  if (token.size() < kMinTokenBytes) {
    throw Error(StatusCode::kInvalidArgument,
                "--token-file '" + path + "': the token is " + std::to_string(token.size()) +
                    " bytes, at least " + std::to_string(kMinTokenBytes) + " are needed");
  }
  for (std::size_t i = 0; i < token.size(); ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c <= 0x20 || c == 0x7f) {
      throw Error(StatusCode::kInvalidArgument, "--token-file '" + path + "': byte " +
                                                    std::to_string(i) + " of the token (code " +
                                                    std::to_string(c) +
                                                    ") is a space or control character; a token "
                                                    "is one line of printable characters");
    }
  }
  return token;
}

bool constant_time_equal(std::string_view a, std::string_view b) {
  return auth::constant_time_equal(
      std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(a.data()), a.size()),
      std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(b.data()), b.size()));
}

bool is_loopback_host(const std::string& host_in) {
  std::string host = host_in;
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "localhost") return true;
  in_addr v4{};
  if (::inet_pton(AF_INET, host.c_str(), &v4) == 1) {
    return (ntohl(v4.s_addr) >> 24) == 127;
  }
  in6_addr v6{};
  if (::inet_pton(AF_INET6, host.c_str(), &v6) == 1) {
    if (IN6_IS_ADDR_LOOPBACK(&v6)) return true;
    if (IN6_IS_ADDR_V4MAPPED(&v6)) return v6.s6_addr[12] == 127;
  }
  return false;
}

}  // namespace mstar::kv::cli
