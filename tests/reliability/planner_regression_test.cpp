// Copyright mstar-kv authors.
//
// Inputs the fuzzers found, pinned as tests (the crash inputs themselves are
// kept in fuzz/corpus/<target>/regress-*).
#include <gtest/gtest.h>

#include <limits>

#include "mstar/kv/planner.hpp"
#include "mstar/kv/status.hpp"
#include "common/layouts.hpp"

namespace mstar::kv {
namespace {

// plan_reads computed the pages needed as (end_len + page_size - 1) /
// page_size, which wraps near 2^64: a huge end_len then passed the page
// table checks and reserve() threw std::length_error instead of Error.
TEST(PlannerRegression, EndLenNear2To64IsRejectedWithError) {
  const KVLayout l = testing::make_layout(2, 8, 16, 1, 8);
  const std::vector<std::uint32_t> pages = {0, 1, 2};
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  // The empty range [kMax, kMax) is validated as any other (issue 14): its
  // tables must cover end_len too, and the count (2^60) must not wrap.
  for (std::uint64_t start : {std::uint64_t{0}, kMax - 20, kMax - 1, kMax}) {
    try {
      plan_reads(l, start, kMax, pages, pages);
      FAIL() << "start " << start;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("local page table has 3 entries"), std::string::npos)
          << e.what();
      EXPECT_NE(std::string(e.what()).find("need 1152921504606846976"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_TRUE(plan_reads(l, 48, 48, pages, pages).empty());
}

}  // namespace
}  // namespace mstar::kv
