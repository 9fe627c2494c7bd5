// Copyright mstar-kv authors.
//
// Where a read's time went: at debug level both sides of a ucx read log its
// steps, stamped with CLOCK_MONOTONIC seconds (one clock for every process
// of a host), so a slow read's gap shows between the reader asking, the
// owner serving and its sends completing, and the reader's verdict. An
// owner and a reader of this process over tcp on loopback; the bytes are
// checked as in every read; below debug nothing is logged.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <string>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/layouts.hpp"
#include "engines/ucx/ucx_fixture.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::ucx_test {
namespace {

using namespace std::chrono_literals;

struct Lines {
  std::mutex mu;
  std::vector<std::string> all;
  Logger logger(LogLevel level) {
    return Logger(level, [this](LogLevel, const std::string& m) {
      std::lock_guard<std::mutex> lk(mu);
      all.push_back(m);
    });
  }
  // The stamp of the first line of `what` (a regex), or -1.
  double first(const std::string& what) {
    std::lock_guard<std::mutex> lk(mu);
    const std::regex re("^ucx t=([0-9.]+) " + what);
    for (const std::string& l : all) {
      std::smatch m;
      if (std::regex_search(l, m, re)) return std::stod(m[1]);
    }
    return -1;
  }
};

std::unique_ptr<KVTransferManager> manager(const std::string& name, std::shared_ptr<KVCache> cache,
                                           Logger log) {
  EngineOptions o;
  o.timeout = 20000ms;
  o.log = std::move(log);
  return std::make_unique<KVTransferManager>(TransferEngineInfo{name, "", "ucx", o},
                                             std::move(cache));
}

class UcxTrace : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ucx_built()) GTEST_SKIP() << "ucx engine not built";
    use_loopback_tcp();
  }
};

TEST_F(UcxTrace, ADebugLogShowsEveryStepOfAReadInOrderOnOneClock) {
  const KVLayout l = testing::small_layout(64);
  auto owner_cache = make_kv_cache(l, MemoryKind::kHost);
  std::vector<std::uint32_t> pages = {3, 9, 10, 11, 40};
  const std::uint64_t tokens = pages.size() * l.page_size;
  fill_pattern(*owner_cache, 7, pages, 0, tokens);
  Lines owner_lines, reader_lines;
  auto owner = manager("prefill", owner_cache, owner_lines.logger(LogLevel::kDebug));
  auto cache = make_kv_cache(l, MemoryKind::kHost);
  auto reader = manager("decode", cache, reader_lines.logger(LogLevel::kDebug));
  EXPECT_EQ(reader->sync_retrieve(0, tokens, pages, pages, owner->get_kv_transfer_info()),
            tokens * l.token_bytes() * l.num_layers * l.num_kv());
  EXPECT_TRUE(testing::verify_pattern_any(*cache, 7, pages, 0, tokens).ok());

  // One read: every line below is about it.
  const double asking = reader_lines.first("read [0-9]+: asking");
  const double asked = reader_lines.first("read [0-9]+: asked .* for [0-9]+ spans");
  const double served = owner_lines.first("serve [0-9]+: [0-9]+ spans");
  const double sent = owner_lines.first("serve [0-9]+: every send completed");
  const double resolved = reader_lines.first("read [0-9]+: resolved \\(ok\\)");
  ASSERT_GT(asking, 0) << "no 'asking' line";
  ASSERT_GT(served, 0) << "the owner logged no serve";
  ASSERT_GT(sent, 0) << "the owner logged no completed sends";
  ASSERT_GT(resolved, 0) << "no 'resolved' line";
  EXPECT_LE(asking, asked);
  EXPECT_LE(asking, served) << "the owner served before the reader asked: two clocks";
  EXPECT_LE(served, sent);
  EXPECT_LE(sent, resolved) << "resolved before the owner's last send completed";
}

TEST_F(UcxTrace, BelowDebugNothingIsLogged) {
  const KVLayout l = testing::small_layout(16);
  auto owner_cache = make_kv_cache(l, MemoryKind::kHost);
  const std::vector<std::uint32_t> pages = {1, 2, 3};
  const std::uint64_t tokens = pages.size() * l.page_size;
  fill_pattern(*owner_cache, 5, pages, 0, tokens);
  Lines lines;
  auto owner = manager("prefill", owner_cache, lines.logger(LogLevel::kInfo));
  auto reader =
      manager("decode", make_kv_cache(l, MemoryKind::kHost), lines.logger(LogLevel::kInfo));
  EXPECT_EQ(reader->sync_retrieve(0, tokens, pages, pages, owner->get_kv_transfer_info()),
            tokens * l.token_bytes() * l.num_layers * l.num_kv());
  std::lock_guard<std::mutex> lk(lines.mu);
  EXPECT_TRUE(lines.all.empty()) << lines.all.front();
}

}  // namespace
}  // namespace mstar::kv::ucx_test
