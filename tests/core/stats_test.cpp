// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <thread>

#include "common/layouts.hpp"
#include "mstar/kv/core/stats.hpp"
#include "mstar/kv/engines/local_only.hpp"
#include "mstar/kv/manager.hpp"
#include "mstar/kv/util/log.hpp"

#include <cstdlib>

namespace mstar::kv {
namespace {

using namespace std::chrono_literals;

TEST(LatencyHistogram, BucketsByUpperBound) {
  LatencyHistogram h;
  h.add(0.0);    // <= 1e-6
  h.add(1e-6);   // <= 1e-6 (bounds are inclusive)
  h.add(3e-3);   // <= 5e-3
  h.add(100.0);  // +Inf
  EXPECT_EQ(h.count, 4u);
  EXPECT_EQ(h.buckets[0], 2u);
  EXPECT_EQ(h.buckets[11], 1u);  // 5e-3
  EXPECT_EQ(h.buckets.back(), 1u);
  EXPECT_NEAR(h.sum_seconds, 100.003001, 1e-9);
}

// An engine whose reads the test resolves by hand, stamping phases as an
// engine does.
class HandEngine final : public KVTransferEngine {
 public:
  KVTransferInfo get_kv_transfer_info() const override { return {"hand", {}}; }
  RemoteHandle open_remote(const KVTransferInfo& info) const override {
    if (info.engine != "hand") throw Error(StatusCode::kInvalidArgument, "not a hand descriptor");
    return std::make_shared<RemoteCache>(info, std::nullopt);
  }
  std::optional<TransferFuture> read_batched_async(const RemoteCache& /*remote*/,
                                                   std::span<const KVReadInfo> reads) override {
    if (reads.empty()) return std::nullopt;
    TransferPromise p;
    p.set_peer("peer-a");
    p.mark_planned(reads.size());
    p.mark_posted();
    promises.push_back(p);
    return p.future();
  }
  void shutdown() override {}
  std::vector<TransferPromise> promises;
};

TEST(TransferStats, CountsOutcomesBytesCopiesAndPhases) {
  const KVLayout l = testing::make_layout(2, 8, 4, 1, 8);
  auto cache = KVCache::create_host(l);
  auto engine = std::make_unique<HandEngine>();
  HandEngine* hand = engine.get();
  KVTransferManager m(cache, std::move(engine));
  const std::vector<std::uint32_t> pages{0, 1};
  auto f1 = m.start_async_retrieve(0, 8, pages, pages, {"hand", {}});  // 2 layers x 2 pages
  auto f2 = m.start_async_retrieve(0, 4, pages, pages, {"hand", {}});
  auto f3 = m.start_async_retrieve(0, 4, pages, pages, {"hand", {}});
  EXPECT_THROW(m.start_async_retrieve(0, 4, pages, pages, {"other", {}}), Error);
  EXPECT_THROW(m.start_async_retrieve(0, 99, pages, pages, {"hand", {}}), Error);  // plan
  EXPECT_FALSE(m.start_async_retrieve(4, 4, pages, pages, {"hand", {}}).has_value());
  std::this_thread::sleep_for(2ms);
  hand->promises[0].complete(4096);
  hand->promises[1].fail(Status(StatusCode::kPeerFailure, "gone"));
  f3->cancel();
  hand->promises[2].fail(Status(StatusCode::kCancelled, "cancelled"));

  const TransferStats s = m.stats();
  EXPECT_EQ(s.engine, "hand");
  EXPECT_EQ(s.total.reads_started, 5u);  // 3 issued + 2 refused; the empty one is no read
  EXPECT_EQ(s.total.reads_succeeded, 1u);
  EXPECT_EQ(s.total.reads_failed[static_cast<int>(StatusCode::kPeerFailure)], 1u);
  EXPECT_EQ(s.total.reads_failed[static_cast<int>(StatusCode::kCancelled)], 1u);
  EXPECT_EQ(s.total.reads_failed[static_cast<int>(StatusCode::kInvalidArgument)], 2u);
  EXPECT_EQ(s.total.failed(), 4u);
  EXPECT_EQ(s.total.bytes, 4096u);
  EXPECT_EQ(s.total.copies, 4u + 2u + 2u);  // the engine's copies: reads per batch here
  ASSERT_EQ(s.peers.count("peer-a"), 1u);
  ASSERT_EQ(s.peers.count("unknown"), 1u);  // refused before a peer was named
  EXPECT_EQ(s.peers.at("peer-a").reads_started, 3u);
  // Histograms: one observation per phase per resolved read (refusals: plan only).
  EXPECT_EQ(s.total.latency[0].count, 5u);
  EXPECT_EQ(s.total.latency[1].count, 3u);
  EXPECT_EQ(s.total.latency[2].count, 3u);
  EXPECT_GE(s.peers.at("peer-a").latency[2].sum_seconds, 0.002);  // the 2 ms wait
}

TEST(TransferStats, RendersPrometheusText) {
  TransferStats s;
  s.engine = "shm";
  PeerStats& p = s.peers["pid \"7\""];
  p.reads_started = 3;
  p.reads_succeeded = 2;
  p.reads_failed[static_cast<int>(StatusCode::kTimeout)] = 1;
  p.bytes = 1000;
  p.copies = 12;
  p.latency[2].add(0.003);
  p.latency[2].add(0.2);
  const std::string text = render_prometheus({s}, "# extra\n");
  EXPECT_NE(text.find("# TYPE mstar_kv_reads_started_total counter"), std::string::npos);
  EXPECT_NE(text.find("mstar_kv_reads_started_total{engine=\"shm\",peer=\"pid \\\"7\\\"\"} 3"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("mstar_kv_reads_failed_total{engine=\"shm\",peer=\"pid \\\"7\\\"\","
                      "code=\"Timeout\"} 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("phase=\"transfer\",le=\"0.005\"} 1"), std::string::npos) << text;
  EXPECT_NE(text.find("phase=\"transfer\",le=\"+Inf\"} 2"), std::string::npos) << text;
  EXPECT_NE(text.find("mstar_kv_read_phase_seconds_count{engine=\"shm\",peer=\"pid \\\"7\\\"\","
                      "phase=\"transfer\"} 2"),
            std::string::npos);
  EXPECT_EQ(text.substr(text.size() - 8), "# extra\n");
}

}  // namespace
}  // namespace mstar::kv

namespace mstar::kv {
namespace {

TEST(Logger, SilentByDefaultLevelsAndSinks) {
  std::vector<std::pair<LogLevel, std::string>> lines;
  Logger quiet;
  EXPECT_FALSE(quiet.enabled(LogLevel::kError));
  quiet.error("nothing");  // no sink: no output, no crash
  Logger l(LogLevel::kWarn, [&](LogLevel lv, const std::string& m) { lines.emplace_back(lv, m); });
  l.error("e");
  l.warn("w");
  l.info("i");  // below the threshold
  l.debug("d");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0], std::make_pair(LogLevel::kError, std::string("e")));
  EXPECT_EQ(lines[1], std::make_pair(LogLevel::kWarn, std::string("w")));
  Logger throwing(LogLevel::kDebug, [](LogLevel, const std::string&) { throw 1; });
  throwing.error("dropped");  // a sink's exception never escapes
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_THROW(parse_log_level("loud"), Error);
  ::unsetenv("MSTAR_KV_LOG");
  EXPECT_FALSE(Logger::from_env().enabled(LogLevel::kError));
  ::setenv("MSTAR_KV_LOG", "info", 1);
  EXPECT_TRUE(Logger::from_env().enabled(LogLevel::kInfo));
  EXPECT_FALSE(Logger::from_env().enabled(LogLevel::kDebug));
  ::unsetenv("MSTAR_KV_LOG");
  EXPECT_FALSE(EngineOptions{}.log.enabled(LogLevel::kError));  // the library is silent
}

}  // namespace
}  // namespace mstar::kv
