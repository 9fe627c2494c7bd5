// Copyright mstar-kv authors.
#include "engine_suite.hpp"

#include <algorithm>

#include "common/geometry_pulls.hpp"

namespace mstar::kv::testing {

const std::map<std::string, std::optional<std::string>>& EngineSuite::case_env_at_start() {
  static const auto start = [] {
    std::map<std::string, std::optional<std::string>> m;
    for (const EngineCase& c : engine_cases()) {
      for (const auto& kv : c.env) m.emplace(kv.first, ScopedEnv::get(kv.first));
    }
    return m;
  }();
  return start;
}

void EngineSuite::SetUp() {
  // Every variable some case sets is as it was before the first case: the
  // case before this one, in this process, put its own back.
  for (const auto& [k, v] : case_env_at_start()) {
    if (ScopedEnv::get(k) != v) {
      ADD_FAILURE() << "the environment of an earlier case is still set: " << k << "='"
                    << ScopedEnv::get(k).value_or("(unset)") << "', before the first case '"
                    << v.value_or("(unset)") << "'";
    }
  }
  const EngineCase& c = GetParam();
  if (!c.skip_reason.empty()) GTEST_SKIP() << c.skip_reason;
  for (const auto& [k, v] : c.env) env_.set(k, v);
}

PeerSpec EngineSuite::peer_spec(const KVLayout& layout, std::uint64_t tokens) const {
  PeerSpec s;
  s.engine = engine();
  s.layout = layout;
  s.tokens = tokens;
  s.seed = kSeed;
  s.env = GetParam().env;
  s.extra = GetParam().extra;
  s.setup = GetParam().setup;
  return s;
}

std::unique_ptr<KVTransferManager> EngineSuite::manager(std::shared_ptr<KVCache> cache,
                                                        std::chrono::milliseconds timeout) const {
  EngineOptions o;
  o.timeout = timeout;
  o.extra = GetParam().extra;
  return make_manager(TransferEngineInfo{"decode", "", engine(), o}, std::move(cache),
                      GetParam().fault_wrapper);
}

std::shared_ptr<KVCache> EngineSuite::local_cache(const KVLayout& l) const {
  auto c = make_loopback_cache(GetParam().traits, GetParam().setup, l, /*owner=*/false);
  EXPECT_EQ(c->split(), GetParam().setup.layer_regions && l.layer_contiguous() &&
                            GetParam().traits.reader_memory == MemoryKind::kHost);
  fill_bytes(*c, kSentinel);
  return c;
}

std::vector<std::uint32_t> EngineSuite::local_pages(std::size_t n, std::uint32_t first) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint32_t>((first + i * 5) % 64);
  return v;
}

void EngineSuite::expect_only_named_bytes_written(const KVCache& local, const KVLayout& remote,
                                                  std::span<const KVReadInfo> reads) {
  testing::expect_only_named_bytes_written(local, remote, reads, kSentinel);
}

void EngineSuite::expect_quiet_after(const KVCache& cache, const TransferFuture& f) {
  ASSERT_TRUE(f.wait_for(std::chrono::seconds(10))) << "the read did not resolve in 10 s";
  SCOPED_TRACE("after " + f.status().to_string());
  expect_quiet(cache, std::chrono::milliseconds(100));
}

}  // namespace mstar::kv::testing
