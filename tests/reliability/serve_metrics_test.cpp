// Copyright mstar-kv authors.
//
// `mstar-kv serve`'s owner-side metrics: GET /metrics before and
// after a `mstar-kv pull` from it. Over ucx the owner counts the read and
// exactly the bytes it sent; over shm (readers map the memory, the owner
// never sees them) the descriptors handed out and the done notices move.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <random>
#include <string>

#include "common/cli_process.hpp"
#include "mstar/kv/kv.hpp"
#include "testkit/ports.hpp"

namespace {

using namespace std::chrono_literals;
using Proc = mstar::kv::testing::CliProcess;

// The body of GET `path` on 127.0.0.1:port ("" when it fails).
std::string http_get(int port, const std::string& path) {
  const int fd = mstar::kv::testkit::connect_loopback(port);
  if (fd < 0) return "";
  const std::string req =
      "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  ::send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string all;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;)
    all.append(buf, static_cast<std::size_t>(n));
  ::close(fd);
  const auto body = all.find("\r\n\r\n");
  return body == std::string::npos ? "" : all.substr(body + 4);
}

// The value of `series` (name and labels) in Prometheus text; -1 when absent.
long long metric(const std::string& text, const std::string& series) {
  const auto at = text.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stoll(text.substr(at + series.size() + 2));
}

class ServeMetrics : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const auto b = mstar::kv::built_engines();
    if (std::find(b.begin(), b.end(), GetParam()) == b.end()) {
      GTEST_SKIP() << "engine '" << GetParam() << "' is not built";
    }
    Proc p({"serve", "--help"});
    p.wait_exit(10s);
    if (p.output().find("usage: mstar-kv serve") == std::string::npos) {
      GTEST_SKIP() << "mstar-kv serve is not built (cpp-httplib/libmicrohttpd)";
    }
  }
};

TEST_P(ServeMetrics, ServedCountersMoveWhenAReaderPulls) {
  const std::string engine = GetParam();
  const std::map<std::string, std::string> env = {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", "lo"}};
  std::random_device rd;
  const int port = 26000 + static_cast<int>(rd() % 2000) * 2;  // +1: the data port
  const std::string from = "127.0.0.1:" + std::to_string(port);
  // 1000 tokens, 4 layers, 8 heads x 128 bf16: 16,384,000 bytes a pull.
  Proc serve({"serve", "--engine", engine, "--listen", from, "--sequences", "2", "--tokens", "1000",
              "--layers", "4"},
             env);
  ASSERT_TRUE(serve.wait_for_output("/v1/sequences/", 30s)) << serve.output();
  const std::string l = "{engine=\"" + engine + "\"}";
  const std::string before = http_get(port, "/metrics");
  for (const char* m : {"reads", "bytes", "descriptors", "done_notices", "replies_dropped"}) {
    EXPECT_EQ(metric(before, "mstar_kv_served_" + std::string(m) + "_total" + l), 0) << m << "\n"
                                                                                     << before;
  }

  Proc pull({"pull", "--from", from, "--seq", "0"}, env);
  ASSERT_EQ(pull.wait_exit(60s), 0) << pull.output();
  const std::string after = http_get(port, "/metrics");
  EXPECT_EQ(metric(after, "mstar_kv_served_descriptors_total" + l), 1) << after;
  EXPECT_EQ(metric(after, "mstar_kv_served_done_notices_total" + l), 1) << after;
  EXPECT_EQ(metric(after, "mstar_kv_served_replies_dropped_total" + l), 0) << after;
  if (engine == "ucx") {
    EXPECT_EQ(metric(after, "mstar_kv_served_reads_total" + l), 1) << after;
    EXPECT_EQ(metric(after, "mstar_kv_served_bytes_total" + l), 16384000) << after;
    EXPECT_EQ(metric(after, "mstar_kv_served_readers_connected_total" + l), 1) << after;
  } else {  // the shm owner never sees its readers
    EXPECT_EQ(metric(after, "mstar_kv_served_bytes_total" + l), 0) << after;
  }
}

INSTANTIATE_TEST_SUITE_P(Engines, ServeMetrics, ::testing::Values("ucx", "shm"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
