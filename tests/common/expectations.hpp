// Copyright mstar-kv authors.
//
// Checks the tests share: a refusal (`fn` throws Error with `code` and a
// message naming each of `needles`), and a cache that no byte lands in any
// more (after a read resolved).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <initializer_list>
#include <string>
#include <string_view>
#include <thread>

#include "common/cache_probe.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::testing {

// Returns the message ("" when nothing was thrown, a test failure).
template <typename Fn>
std::string expect_error(Fn&& fn, StatusCode code,
                         std::initializer_list<std::string_view> needles = {}) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.code(), code) << what;
    for (std::string_view n : needles) {
      EXPECT_NE(what.find(n), std::string::npos) << "'" << n << "' is not in: " << what;
    }
    return what;
  }
  ADD_FAILURE() << "no Error thrown (expected " << to_string(code) << ")";
  return "";
}

// Two snapshots of `cache` `wait` apart (through a host copy: any memory)
// are equal: nothing lands in it any more.
inline void expect_quiet(const KVCache& cache, std::chrono::milliseconds wait) {
  const auto before = download(cache);
  std::this_thread::sleep_for(wait);
  const auto after = download(cache);
  EXPECT_EQ(std::memcmp(before->base(), after->base(), cache.size_bytes()), 0)
      << "bytes landed in the cache after the read resolved";
}

}  // namespace mstar::kv::testing
