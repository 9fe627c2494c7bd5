// Copyright mstar-kv authors.
//
// Inputs the fuzzers found, pinned as tests (the crash inputs themselves are
// kept in fuzz/corpus/<target>/regress-*).
#include <gtest/gtest.h>

#include <limits>

#include "common/layouts.hpp"
#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {
namespace {

// plan_reads computed the pages needed as (end_len + page_size - 1) /
// page_size, which wraps near 2^64: a huge end_len then passed the page
// table checks and reserve() threw std::length_error instead of Error.
TEST(PlannerRegression, EndLenNear2To64IsRejectedWithError) {
  const KVLayout l = testing::make_layout(2, 8, 16, 1, 8);
  const std::vector<std::uint32_t> pages = {0, 1, 2};
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  // The empty range [kMax, kMax) is validated as any other: its
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

// What fuzz_plan feeds since its harness stopped computing v() - 1 on a wild
// value (INT64_MIN - 1 overflowed in the harness): any int64 in
// every field of a read, remote_token_start included, is refused with
// kInvalidArgument by both planners (a negative remote_token_start means
// "at token_start"), with no overflow on the way (the planners are built
// with UBSan in the asan and fuzz presets).
TEST(PlannerRegression, ExtremeReadFieldsAreRefusedNotOverflowed) {
  const KVLayout l = testing::make_layout(2, 8, 16, 1, 8);
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const KVReadInfo good{1, 2, 3, 0, 16, -1, 0, 0};
  ASSERT_NO_THROW((void)plan_copies(l, l, std::vector<KVReadInfo>{good}));
  for (std::int64_t v : {kMin, kMin + 1, std::int64_t{-2}, kMax - 1, kMax}) {
    for (int field = 0; field < 8; ++field) {
      KVReadInfo r = good;
      std::int64_t* f[] = {&r.layer_idx, &r.local_page_idx,     &r.remote_page_idx, &r.token_start,
                           &r.token_end, &r.remote_token_start, &r.head_start,      &r.head_end};
      *f[field] = v;
      if (field == 7) r.head_start = 0;  // a head range needs both ends
      for (bool strided : {false, true}) {
        SCOPED_TRACE("field " + std::to_string(field) + " = " + std::to_string(v) +
                     (strided ? " (strided)" : ""));
        const std::vector<KVReadInfo> reads{r};
        if (field == 5 && v < 0) {  // any negative remote_token_start: at token_start
          if (strided) {
            EXPECT_NO_THROW((void)plan_strided_copies(l, l, reads));
          } else {
            EXPECT_EQ(plan_copies(l, l, reads).spans,
                      plan_copies(l, l, std::vector<KVReadInfo>{good}).spans);
          }
          continue;
        }
        try {
          if (strided) {
            (void)plan_strided_copies(l, l, reads);
          } else {
            (void)plan_copies(l, l, reads);
          }
          ADD_FAILURE() << "accepted";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), StatusCode::kInvalidArgument) << e.what();
        }
      }
    }
  }
}

}  // namespace
}  // namespace mstar::kv
