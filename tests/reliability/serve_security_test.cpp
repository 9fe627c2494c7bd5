// Copyright mstar-kv authors.
//
// `mstar-kv serve` (a real process): with no --listen it binds its HTTP
// control plane, and the ucx engine's data listener, to loopback only, and it
// answers requests for sequences it does not serve (unknown, malformed,
// oversized or path-like ids, "done" for a sequence not served) with 404
// without touching the sequences it does serve.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "common/cli_process.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/util/status.hpp"
#include "testkit/ports.hpp"

#ifndef MSTAR_KV_CLI_PATH
#error "MSTAR_KV_CLI_PATH must name the mstar-kv executable"
#endif

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;

constexpr int kDefaultHttpPort = 23480;  // `mstar-kv serve` without --listen

// One HTTP/1.0 request to 127.0.0.1:port; the status code and body.
std::pair<int, std::string> http(int port, const std::string& method, const std::string& path) {
  const int fd = mstar::kv::testkit::connect_loopback(port);
  if (fd < 0) return {-1, ""};
  const std::string req =
      method + " " + path + " HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n";
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string resp;
  char buf[4096];
  ssize_t n;
  while ((n = ::recv(fd, buf, sizeof buf, 0)) > 0) resp.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  int status = -1;
  std::sscanf(resp.c_str(), "HTTP/%*s %d", &status);
  const auto body = resp.find("\r\n\r\n");
  return {status, body == std::string::npos ? "" : resp.substr(body + 4)};
}

using testkit::tcp_listeners;

bool serve_built() {
  testing::CliProcess s({"serve", "--help"});
  s.wait_for_output("usage", 10s);
  return s.output().find("usage: mstar-kv serve") != std::string::npos;
}

class ServeSecurity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!serve_built()) GTEST_SKIP() << "mstar-kv serve is not built (cpp-httplib missing)";
    if (!tcp_listeners(kDefaultHttpPort).empty() || !tcp_listeners(kDefaultHttpPort + 1).empty()) {
      GTEST_SKIP() << "port " << kDefaultHttpPort << " or " << kDefaultHttpPort + 1
                   << " is in use: cannot start serve on its defaults";
    }
  }
};

void expect_loopback_only(int port) {
  const auto l = tcp_listeners(port);
  EXPECT_FALSE(l.empty()) << "nothing listens on port " << port;
  for (const std::string& addr : l) {
    EXPECT_EQ(addr, "0100007F") << "port " << port << " listens on " << addr
                                << " (expected 127.0.0.1 only)";
  }
}

TEST_F(ServeSecurity, DefaultsBindToLoopbackAndUnknownSequencesAre404) {
  std::string checked;
  for (const std::string eng : {"shm", "ucx"}) {
    SCOPED_TRACE(eng);
    testing::CliProcess s({"serve", "--engine", eng, "--sequences", "2", "--tokens", "40",
                           "--layers", "2", "--kv-heads", "2", "--head-dim", "64"});
    if (!s.wait_for_output("http://", 30s)) {
      if (s.output().find("not built") != std::string::npos) continue;  // engine absent
      FAIL() << "serve did not start: " << s.output();
    }
    expect_loopback_only(kDefaultHttpPort);
    if (eng == "ucx") expect_loopback_only(kDefaultHttpPort + 1);  // the data listener

    // Served: 0 and 1.
    auto [st0, body0] = http(kDefaultHttpPort, "GET", "/v1/sequences/0");
    ASSERT_EQ(st0, 200) << body0;
    const SequenceInfo seq =
        SequenceInfo::decode(std::vector<std::uint8_t>(body0.begin(), body0.end()));
    EXPECT_EQ(seq.kv_transfer_info.engine, eng);

    for (const char* path :
         {"/v1/sequences/2", "/v1/sequences/abc", "/v1/sequences/-1",
          "/v1/sequences/99999999999999999999999", "/v1/sequences/18446744073709551615",
          "/v1/sequences/2/meta", "/v1/sequences/0%2F..%2F..%2Fetc%2Fpasswd",
          "/v1/sequences/../../etc/passwd"}) {
      const auto [code, body] = http(kDefaultHttpPort, "GET", path);
      EXPECT_EQ(code, 404) << path << ": " << body;
    }
    // "done" for sequences not served changes nothing.
    for (const char* path : {"/v1/sequences/7/done", "/v1/sequences/x/done"}) {
      EXPECT_EQ(http(kDefaultHttpPort, "POST", path).first, 404) << path;
      EXPECT_EQ(http(kDefaultHttpPort, "DELETE", path).first, 404) << path;
    }
    EXPECT_EQ(http(kDefaultHttpPort, "GET", "/v1/sequences/1").first, 200);
    // Done twice: the second is for a sequence no longer served.
    EXPECT_EQ(http(kDefaultHttpPort, "POST", "/v1/sequences/1/done").first, 200);
    EXPECT_EQ(http(kDefaultHttpPort, "POST", "/v1/sequences/1/done").first, 404);
    EXPECT_EQ(http(kDefaultHttpPort, "GET", "/v1/sequences/1").first, 404);
    EXPECT_EQ(http(kDefaultHttpPort, "GET", "/v1/sequences/0").first, 200);
    checked += " " + eng;
  }
  EXPECT_FALSE(checked.empty()) << "no engine could serve";
  std::printf("engines checked:%s\n", checked.c_str());
}

}  // namespace
}  // namespace mstar::kv
