// Copyright mstar-kv authors.
//
// `mstar-kv serve` and `mstar-kv pull` as real processes over UCX's tcp
// transport: on loopback, and across two network namespaces joined by a
// veth pair (skipped, with the reason, where `ip netns add` is not allowed).
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/netns.hpp"
#include "toolkit/child.hpp"

#ifndef MSTAR_KV_CLI_PATH
#error "MSTAR_KV_CLI_PATH must name the mstar-kv executable"
#endif

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A child process with its stdout+stderr on a pipe; the destructor kills
// (SIGKILL) and reaps it if it still runs.
using mstar::kv::toolkit::Child;

int random_port() {
  std::random_device rd;
  return 20000 + static_cast<int>(rd() % 4000) * 2;  // even; +1 is the data port
}

std::map<std::string, std::string> tcp_env(const std::string& dev) {
  return {{"UCX_TLS", "tcp"}, {"UCX_NET_DEVICES", dev}};
}

const std::vector<std::string> kSmall = {"--layers", "4", "--tokens", "1000"};

std::vector<std::string> serve_args(const std::string& listen) {
  std::vector<std::string> a = {MSTAR_KV_CLI_PATH, "serve", "--engine",    "ucx",
                                "--listen",        listen,  "--sequences", "2",
                                "--exit-when-done"};
  a.insert(a.end(), kSmall.begin(), kSmall.end());
  return a;
}

TEST(ServePull, LoopbackPullVerifiesEveryPageAndFreesTheServer) {
  const int port = random_port();
  const std::string http = "127.0.0.1:" + std::to_string(port);
  Child serve(serve_args(http), tcp_env("lo"));
  ASSERT_TRUE(serve.wait_for_output("/v1/sequences/", 20s)) << serve.output();

  Child pull0({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", "0", "--repeat", "2"},
              tcp_env("lo"));
  ASSERT_EQ(pull0.wait_exit(60s), 0) << pull0.output();
  EXPECT_NE(pull0.output().find("every page verified"), std::string::npos) << pull0.output();
  EXPECT_NE(pull0.output().find("result: OK"), std::string::npos);

  // An unknown sequence: non-zero exit naming the problem.
  Child bad({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", "9"}, tcp_env("lo"));
  EXPECT_NE(bad.wait_exit(30s), 0);
  EXPECT_NE(bad.output().find("not served here"), std::string::npos) << bad.output();

  // Sequence 0 was freed by the first pull: pulling it again fails cleanly.
  Child again({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", "0"}, tcp_env("lo"));
  EXPECT_NE(again.wait_exit(30s), 0);

  // Sequence 1 into a cache of other orders; then the server exits by itself.
  Child pull1({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", "1", "--cache-order", "page"},
              tcp_env("lo"));
  ASSERT_EQ(pull1.wait_exit(60s), 0) << pull1.output();
  EXPECT_EQ(serve.wait_exit(20s), 0) << serve.output();
  EXPECT_NE(serve.output().find("all sequences done"), std::string::npos) << serve.output();
}

// With --token-file the UCX serve answers only the bearer token; the same
// token on pull works end to end (and reaches both engines as auth_token).
TEST(ServePull, TokenOnServeAndPullOverUcx) {
  const int port = random_port();
  const std::string http = "127.0.0.1:" + std::to_string(port);
  const std::string token = ::testing::TempDir() + "/ucx_token" + std::to_string(::getpid());
  std::ofstream(token) << "ucx-loopback-secret-0123456789\n";
  auto sargs = serve_args(http);
  sargs.insert(sargs.end(), {"--token-file", token});
  Child serve(sargs, tcp_env("lo"));
  ASSERT_TRUE(serve.wait_for_output("/v1/sequences/", 20s)) << serve.output();
  Child none({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", "0"}, tcp_env("lo"));
  EXPECT_NE(none.wait_exit(30s), 0);
  EXPECT_NE(none.output().find("refused with HTTP 401"), std::string::npos) << none.output();
  for (const char* seq : {"0", "1"}) {
    Child pull({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", seq, "--token-file", token},
               tcp_env("lo"));
    ASSERT_EQ(pull.wait_exit(60s), 0) << pull.output();
    EXPECT_NE(pull.output().find("every page verified"), std::string::npos) << pull.output();
  }
  EXPECT_EQ(serve.wait_exit(20s), 0) << serve.output();
}

TEST(ServePull, PullFromNobodyFailsWithAMessage) {
  Child pull({MSTAR_KV_CLI_PATH, "pull", "--from", "127.0.0.1:" + std::to_string(random_port())},
             tcp_env("lo"));
  EXPECT_NE(pull.wait_exit(30s), 0);
  EXPECT_NE(pull.output().find("cannot reach server"), std::string::npos) << pull.output();
}

TEST(ServePull, ServerKilledMidPullFailsThePullInTime) {
  const int port = random_port();
  const std::string http = "127.0.0.1:" + std::to_string(port);
  std::vector<std::string> a = {MSTAR_KV_CLI_PATH, "serve", "--listen", http,
                                "--tokens",        "2048"};  // 256 MiB
  Child serve(a, tcp_env("lo"));
  ASSERT_TRUE(serve.wait_for_output("/v1/sequences/", 30s)) << serve.output();
  Child pull({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--repeat", "50", "--timeout-ms", "3000"},
             tcp_env("lo"));
  ASSERT_TRUE(pull.wait_for_output("pull 1:", 30s)) << pull.output();
  serve.signal(SIGKILL);
  const auto t0 = Clock::now();
  EXPECT_NE(pull.wait_exit(20s), 0) << pull.output();
  EXPECT_LT(Clock::now() - t0, 3000ms + 5s);
  EXPECT_NE(pull.output().find("failed"), std::string::npos) << pull.output();
}

TEST(ServePull, AcrossTwoNetworkNamespacesOverTcp) {
  mstar::kv::testing::NetNamespaces ns(mstar::kv::testing::NetNamespaces::Shape::kPair, "mskv");
  if (!ns.skip_reason().empty()) GTEST_SKIP() << ns.skip_reason();
  const int port = random_port();
  const std::string http = ns.addr_a() + ":" + std::to_string(port);
  // A non-loopback --listen needs a token: serve and pull share one, and
  // both hand it to the UCX engine (EngineOptions.extra["auth_token"]).
  const std::string token = ::testing::TempDir() + "/serve_pull_token" + std::to_string(::getpid());
  std::ofstream(token) << "netns-shared-secret-0123456789\n";
  auto sargs = serve_args(http);
  sargs.insert(sargs.end(), {"--token-file", token});
  Child serve(ns.in_a(sargs), tcp_env(ns.veth_a()));
  ASSERT_TRUE(serve.wait_for_output("/v1/sequences/", 20s)) << serve.output();
  for (const char* seq : {"0", "1"}) {
    Child pull(
        ns.in_b({MSTAR_KV_CLI_PATH, "pull", "--from", http, "--seq", seq, "--repeat", "2",
                 "--listen", ns.addr_b() + ":" + std::to_string(port + 1), "--token-file", token}),
        tcp_env(ns.veth_b()));
    ASSERT_EQ(pull.wait_exit(60s), 0) << pull.output();
    EXPECT_NE(pull.output().find("every page verified"), std::string::npos) << pull.output();
  }
  EXPECT_EQ(serve.wait_exit(20s), 0) << serve.output();
  // The puller's namespace cannot reach the server's loopback: the data
  // really crossed the veth pair.
  Child lo(ns.in_b({MSTAR_KV_CLI_PATH, "pull", "--from", "127.0.0.1:" + std::to_string(port)}),
           tcp_env("lo"));
  EXPECT_NE(lo.wait_exit(30s), 0);
}

}  // namespace
