// Copyright mstar-kv authors.
//
// What the conformance and streaming suites share: the cases
// (common/engine_cases.hpp) and a fixture that makes the reader's
// cache in the memory the engine reads into, filled and checked through the
// cache probe (host, shared and device caches alike), the peer's spec and
// the reader's manager.
//
// A case that cannot run here skips with the reason: an engine not built,
// Mooncake without MSTAR_KV_MOONCAKE_LIB, CUDA IPC without a device (the CUDA
// error; with MSTAR_KV_REQUIRE_GPU=1 it runs and fails instead). The local
// engine reads no remote cache: the cases that need a peer skip for it
// (MSTAR_KV_NEED_REMOTE()), the others run.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "common/cache_probe.hpp"
#include "common/engine_cases.hpp"
#include "common/expectations.hpp"
#include "common/layouts.hpp"
#include "common/managers.hpp"
#include "common/peer_process.hpp"
#include "common/scoped_env.hpp"
#include "mstar/kv/factory.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::testing {

inline constexpr std::byte kSentinel{0xA5};
inline constexpr std::uint64_t kSeed = 1234;

class EngineSuite : public ::testing::TestWithParam<EngineCase> {
 protected:
  // Sets the case's environment (its peers inherit it) for the case alone:
  // put back when the fixture ends, and checked at the start of each case.
  void SetUp() override;

  // Each variable any case sets, as the process had it before the first case.
  static const std::map<std::string, std::optional<std::string>>& case_env_at_start();

  const std::string& engine() const { return GetParam().traits.name; }
  // False for the local engine, which reads no peer's cache
  // (MSTAR_KV_NEED_REMOTE below).
  bool remote_reads() const { return GetParam().traits.crosses_processes; }

  PeerSpec peer_spec(const KVLayout& layout, std::uint64_t tokens) const;
  std::unique_ptr<KVTransferManager> manager(
      std::shared_ptr<KVCache> cache,
      std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) const;
  // A reader's cache in the engine's reader memory, every byte the sentinel.
  std::shared_ptr<KVCache> local_cache(const KVLayout& l) const;
  // n distinct local pages of a 64-page cache, scattered.
  static std::vector<std::uint32_t> local_pages(std::size_t n, std::uint32_t first = 3);
  // Every byte outside the destination spans of `reads` (planned against
  // `remote`) still holds the sentinel.
  static void expect_only_named_bytes_written(const KVCache& local, const KVLayout& remote,
                                              std::span<const KVReadInfo> reads);
  // After `f` resolved, no byte lands in `cache` (a snapshot, a wait, a compare).
  static void expect_quiet_after(const KVCache& cache, const TransferFuture& f);

 private:
  ScopedEnv env_;  // the case's variables; restored when the fixture ends
};

// The start of a case that reads a peer's cache: skips for the local engine.
#define MSTAR_KV_NEED_REMOTE()                                  \
  do {                                                          \
    if (!remote_reads()) {                                      \
      GTEST_SKIP() << "the local engine reads no remote cache"; \
    }                                                           \
  } while (0)

}  // namespace mstar::kv::testing
