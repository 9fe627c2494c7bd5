// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <string>

#include "mstar/kv/util/status.hpp"
#include "util/host_port.hpp"

namespace mstar::kv {
namespace {

std::string refusal(const std::string& s, std::optional<std::uint16_t> def = std::nullopt) {
  try {
    parse_host_port(s, "--from", def);
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    return e.status().message();
  }
  return "accepted";
}

TEST(HostPort, ParsesNamesAddressesAndBracketedIpv6) {
  HostPort hp = parse_host_port("node-7.example:23480", "x");
  EXPECT_EQ(hp.host, "node-7.example");
  EXPECT_EQ(hp.port, 23480);
  hp = parse_host_port("10.0.0.7:1", "x");
  EXPECT_EQ(hp.host, "10.0.0.7");
  EXPECT_EQ(hp.port, 1);
  hp = parse_host_port("[fe80::1]:65535", "x");
  EXPECT_EQ(hp.host, "fe80::1");
  EXPECT_EQ(hp.port, 65535);
  hp = parse_host_port("[::1]", "x", 80);  // brackets, no port: the default
  EXPECT_EQ(hp.host, "::1");
  EXPECT_EQ(hp.port, 80);
  hp = parse_host_port("127.0.0.1", "x", 23480);
  EXPECT_EQ(hp.host, "127.0.0.1");
  EXPECT_EQ(hp.port, 23480);
}

TEST(HostPort, RefusalsNameTheValueAndTheLimit) {
  EXPECT_EQ(refusal("127.0.0.1"), "--from '127.0.0.1' is not HOST:PORT");
  EXPECT_EQ(refusal("h:0"), "--from 'h:0': port '0' is not in [1, 65535]");
  EXPECT_EQ(refusal("h:65536"), "--from 'h:65536': port '65536' is not in [1, 65535]");
  EXPECT_EQ(refusal("h:99999999999999999999"),
            "--from 'h:99999999999999999999': port '99999999999999999999' is not in [1, 65535]");
  EXPECT_EQ(refusal("h:8x"), "--from 'h:8x': port '8x' is not in [1, 65535]");
  EXPECT_EQ(refusal("h:"), "--from 'h:': port '' is not in [1, 65535]");
  EXPECT_EQ(refusal(":80"), "--from ':80' has no host");
  EXPECT_EQ(refusal("", 80), "--from '' has no host");
  EXPECT_EQ(refusal("[]:80"), "--from '[]:80' has no host");
}

}  // namespace
}  // namespace mstar::kv
