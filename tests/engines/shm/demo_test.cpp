// Copyright mstar-kv authors.
//
// `mstar-kv demo` as a user runs it: real prefill and decode processes.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstdio>
#include <string>

#include "toolkit/child.hpp"

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;

struct DemoRun {
  int status = -1;
  std::string out;
};

DemoRun run_demo(std::vector<std::string> args, std::chrono::milliseconds timeout = 60s) {
  args.insert(args.begin(), {MSTAR_KV_CLI, "demo"});
  toolkit::Child child(args);
  DemoRun r;
  r.out = child.read_all(timeout);
  child.wait_exit(5s);
  r.status = child.wait_status();
  return r;
}

// The child pids the demo printed are all gone (reaped, not running).
void expect_children_gone(const std::string& out) {
  const std::string a = "started prefill pid ";
  const std::string b = ", decode pid ";
  const auto pa = out.find(a);
  const auto pb = out.find(b, pa);
  ASSERT_TRUE(pa != std::string::npos && pb != std::string::npos) << out;
  for (const pid_t pid :
       {std::stoi(out.substr(pa + a.size())), std::stoi(out.substr(pb + b.size()))}) {
    EXPECT_NE(::kill(pid, 0), 0) << "process " << pid << " is still there";
    EXPECT_EQ(errno, ESRCH);
  }
}

TEST(Demo, SmallGeometryPullsVerifiesAndReportsTheBaseline) {
  const DemoRun r =
      run_demo({"--layers", "4", "--tokens", "1000", "--repeat", "2", "--timeout-ms", "10000"});
  ASSERT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) << r.out;
  EXPECT_NE(r.out.find("result: OK"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("request 1: 1000 tokens, 63 pages scattered"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("prefix of 750 tokens"), std::string::npos) << r.out;
  const auto at = r.out.find("summary: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  double gbs = 0;
  double mem = 0;
  double ratio = 0;
  ASSERT_EQ(std::sscanf(r.out.c_str() + at, "summary: %lf GB/s, memcpy %lf GB/s, ratio %lf", &gbs,
                        &mem, &ratio),
            3)
      << r.out;
  EXPECT_GT(gbs, 0);
  EXPECT_GT(mem, 0);
  EXPECT_GT(ratio, 0);
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
    const DemoRun r = run_demo(
        {"--layers", "2", "--tokens", "256", "--crash", role, "--timeout-ms", "5000"}, 30s);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 1) << role << ": " << r.out;
    EXPECT_NE(r.out.find("FAILED"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("result: OK"), std::string::npos) << r.out;
    expect_children_gone(r.out);
  }
}

TEST(Demo, LayerwiseStreamsAndReportsTheBaselineInTheSameRun) {
  const DemoRun r = run_demo({"--layerwise", "--prefill-ms-per-layer", "1", "--layers", "8",
                              "--tokens", "512", "--repeat", "2", "--timeout-ms", "10000"});
  ASSERT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0) << r.out;
  EXPECT_NE(r.out.find("result: OK"), std::string::npos) << r.out;
  const auto at = r.out.find("summary: ");
  ASSERT_NE(at, std::string::npos) << r.out;
  double stream = 0, pull = 0, compute = 0, hidden = -1;
  ASSERT_EQ(std::sscanf(r.out.c_str() + at,
                        "summary: layerwise stream %lf ms, pull-after-prefill %lf ms, compute "
                        "%lf ms, hidden %lf%%",
                        &stream, &pull, &compute, &hidden),
            4)
      << r.out;
  // 8 layers of at least 1 ms of compute each: no mode ends before that.
  EXPECT_GE(compute, 8.0) << r.out;
  EXPECT_GE(stream, 8.0) << r.out;
  EXPECT_GE(pull, 8.0) << r.out;
  EXPECT_GE(hidden, 0.0);
  EXPECT_LE(hidden, 100.0);
  EXPECT_NE(r.out.find("mark_layers_ready"), std::string::npos) << r.out;
  expect_children_gone(r.out);
}

TEST(Demo, BadArgumentsFailBeforeStartingAnything) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"--engine", "carrier-pigeon"},
        {"--tokens", "0"},
        {"--prefix-hit", "1.5"},
        {"--workers", "0"},
        {"--bogus"},
        {"--prefill-ms-per-layer", "2"},
        {"--layerwise", "--prefill-ms-per-layer", "-1"},
        // Every engine that crosses processes streams now (mooncake since
        // this stop, by polling): a layer-wise run over one that cannot.
        {"--layerwise", "--engine", "local"}}) {
    const DemoRun r = run_demo(args, 10s);
    EXPECT_TRUE(WIFEXITED(r.status) && WEXITSTATUS(r.status) != 0) << r.out;
    EXPECT_NE(r.out.find("error"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("started prefill"), std::string::npos) << r.out;
  }
}

}  // namespace
}  // namespace mstar::kv
