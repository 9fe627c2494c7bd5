// Copyright mstar-kv authors.
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "mstar/kv/core/epochs.hpp"

namespace mstar::kv {
namespace {

KVReadInfo read_of(std::int64_t remote_page) { return {0, 0, remote_page, 0, 1}; }

TEST(PageEpochs, StampAndCheckBeforeAndAfter) {
  std::vector<std::uint64_t> words(8, 0);
  PageEpochs ep(words.data(), 8);
  const std::vector<std::uint32_t> pages = {1, 3, 5};
  ep.stamp(pages, 42);
  EXPECT_EQ(ep.load(3), 42u);
  EXPECT_EQ(ep.load(2), 0u);
  EXPECT_EQ(ep.load(9), 0u);  // out of range reads as free
  EXPECT_TRUE(check_page_epochs(words.data(), 8, pages, 42, "before the copy", false).is_ok());
  ep.stamp(std::vector<std::uint32_t>{5}, 43);  // page 5 went to another request
  const Status s = check_page_epochs(words.data(), 8, pages, 42, "during the copy", true);
  EXPECT_EQ(s.code(), StatusCode::kStaleDescriptor);
  EXPECT_NE(s.message().find("remote page 5 changed owner during the copy (epoch 43, the "
                             "descriptor's 42)"),
            std::string::npos)
      << s.message();
  EXPECT_TRUE(is_page_epoch_failure(s));
  EXPECT_TRUE(is_page_epoch_failure(Status(s.code(), "read of 3 bytes failed: " + s.message())));
  EXPECT_FALSE(is_page_epoch_failure(Status(StatusCode::kStaleDescriptor, "generation 7")));
  // A page outside the table never passes.
  EXPECT_EQ(check_page_epochs(words.data(), 8, std::vector<std::uint32_t>{8}, 0, "x", false).code(),
            StatusCode::kStaleDescriptor);
}

TEST(PageEpochs, RemotePagesOfAReadEachOnceSmallAndLarge) {
  const std::vector<KVReadInfo> small = {read_of(3),  read_of(1),  read_of(3),
                                         read_of(-1), read_of(99), read_of(1)};
  EXPECT_EQ(remote_pages_of(small, 8), (std::vector<std::uint32_t>{3, 1, 0xFFFFFFFFu}));
  std::vector<KVReadInfo> large;
  for (int layer = 0; layer < 32; ++layer) {
    for (int p = 0; p < 16; ++p) large.push_back(read_of(15 - p));
  }
  std::vector<std::uint32_t> want(16);
  std::iota(want.rbegin(), want.rend(), 0u);
  EXPECT_EQ(remote_pages_of(large, 16), want);
}

}  // namespace
}  // namespace mstar::kv

namespace mstar::kv {
namespace {

// The hook device caches use (cuda_ipc's DeviceEpochTable): every stamp
// reaches the mirror before stamp() returns, with the whole table and the
// pages stamped.
class CopyMirror final : public EpochMirror {
 public:
  explicit CopyMirror(std::size_t n) : copy(n, 0) {}
  void push(const std::uint64_t* words,
            std::span<const std::uint32_t> pages) const noexcept override {
    for (std::uint32_t p : pages) copy[p] = words[p];
    ++pushes;
  }
  mutable std::vector<std::uint64_t> copy;
  mutable int pushes = 0;
};

TEST(PageEpochs, StampsReachTheMirrorBeforeStampReturns) {
  std::vector<std::uint64_t> words(8, 0);
  CopyMirror mirror(8);
  PageEpochs ep(words.data(), 8, &mirror);
  const std::vector<std::uint32_t> pages = {6, 1};
  ep.stamp(pages, 9);
  EXPECT_EQ(mirror.pushes, 1);
  EXPECT_EQ(mirror.copy[6], 9u);
  EXPECT_EQ(mirror.copy[1], 9u);
  EXPECT_EQ(mirror.copy[0], 0u);
  ep.stamp(pages, 0);  // freed
  EXPECT_EQ(mirror.copy[6], 0u);
  // A reader of the mirror sees what a reader of the table sees.
  EXPECT_EQ(check_page_epochs(mirror.copy.data(), 8, pages, 9, "before the copy", false).code(),
            StatusCode::kStaleDescriptor);
}

}  // namespace
}  // namespace mstar::kv
