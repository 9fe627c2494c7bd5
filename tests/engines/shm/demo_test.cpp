// Copyright mstar-kv authors.
//
// `mstar-kv demo` as a user runs it: real prefill and decode processes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <regex>

#include "shm_test_util.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;

struct DemoRun {
  int status = -1;
  std::string out;
};

DemoRun run_demo(std::vector<std::string> args, std::chrono::milliseconds timeout = 60s) {
  args.insert(args.begin(), {MSTAR_KV_CLI, "demo"});
  shmtest::Child child(args);
  DemoRun r;
  r.out = child.read_all(timeout);
  r.status = child.wait(5s);
  return r;
}

// The child pids the demo printed are all gone (reaped, not running).
void expect_children_gone(const std::string& out) {
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("started prefill pid (\\d+), decode pid (\\d+)")))
      << out;
  for (int i = 1; i <= 2; ++i) {
    const pid_t pid = std::stoi(m[i]);
    EXPECT_NE(::kill(pid, 0), 0) << "process " << pid << " is still there";
    EXPECT_EQ(errno, ESRCH);
  }
}

TEST(Demo, SmallGeometryPullsVerifiesAndReportsTheBaseline) {
  const DemoRun r = run_demo({"--layers", "4", "--tokens", "1000", "--repeat", "2", "--timeout-ms",
                          "10000"});
  ASSERT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) << r.out;
  EXPECT_NE(r.out.find("result: OK"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("request 1: 1000 tokens, 63 pages scattered"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefix of 750 tokens"), std::string::npos) << r.out;
  EXPECT_TRUE(std::regex_search(r.out, std::regex("summary: [0-9.]+ GB/s, memcpy [0-9.]+ GB/s, "
                                                  "ratio [0-9.]+")))
      << r.out;
  expect_children_gone(r.out);
}

TEST(Demo, ContiguousPagesAndOtherOrdersWork) {
  const DemoRun r = run_demo({"--model", "qwen2.5-7b", "--layers", "2", "--tokens", "333",
                          "--contiguous", "--cache-order", "page", "--page-order", "hnd",
                          "--workers", "2", "--prefix-hit", "0.5"});
  ASSERT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) << r.out;
  EXPECT_NE(r.out.find("pages contiguous"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("result: OK"), std::string::npos) << r.out;
}

TEST(Demo, DeathOfEitherProcessFailsClearlyAndLeavesNothing) {
  for (const char* role : {"prefill", "decode"}) {
    const DemoRun r = run_demo({"--layers", "2", "--tokens", "256", "--crash", role,
                            "--timeout-ms", "5000"}, 30s);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 1) << role << ": " << r.out;
    EXPECT_NE(r.out.find("FAILED"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("result: OK"), std::string::npos) << r.out;
    expect_children_gone(r.out);
  }
}

TEST(Demo, BadArgumentsFailBeforeStartingAnything) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"--engine", "carrier-pigeon"}, {"--tokens", "0"},
        {"--prefix-hit", "1.5"}, {"--workers", "0"}, {"--bogus"}}) {
    const DemoRun r = run_demo(args, 10s);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) != 0) << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("started prefill"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace mstar::kv
