// Copyright mstar-kv authors.
//
// What the cuda_ipc engine and kernel cases share: a fixture that skips
// without a visible CUDA device (fails under MSTAR_KV_REQUIRE_GPU=1), the
// owner's spec, the reader's device cache and the checks of what a read
// wrote; and the cancel-and-timeout case both copy paths run.
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cuda_ipc_test_util.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::cuda_test {

inline constexpr std::byte kSentinel{0xA5};
inline constexpr std::uint64_t kSeed = 1234;

class DeviceTest : public ::testing::Test {
 public:
  // An owner of `tokens` tokens of `l`, filled with kSeed's pattern.
  static OwnerSpec spec(const KVLayout& l, std::uint64_t tokens);
  // A reader's device cache, every byte kSentinel.
  static std::shared_ptr<KVCache> local_cache(const KVLayout& l);
  // Every byte outside the destination spans of `reads` (planned against
  // `remote`) still holds kSentinel.
  static void expect_only_named_bytes_written(const KVCache& local, const KVLayout& remote,
                                              std::span<const KVReadInfo> reads);

 protected:
  void SetUp() override;
};

// A large read of many small copies: 32 layers x 1024 pages, layer-major,
// every page, onto local pages scattered (one span per block), so that the
// read is still queued when a cancel or a 1 ms deadline hits.
KVLayout many_copies_layout();
std::vector<std::uint32_t> scattered_pages(std::size_t n);

// A reader's manager over `cache` with this timeout.
using MakeManager = std::function<std::unique_ptr<KVTransferManager>(std::shared_ptr<KVCache>,
                                                                     std::chrono::milliseconds)>;

// The many-copies read of a real owner, cancelled at once and then under a
// 1 ms deadline, through the managers `make` returns: each resolves only
// once its copies drained (no byte lands after), or, done first, byte-exact.
void expect_cancel_and_timeout_drain(const std::string& what, const MakeManager& make);

}  // namespace mstar::kv::cuda_test
