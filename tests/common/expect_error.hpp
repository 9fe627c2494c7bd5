// Copyright mstar-kv authors.
//
// The tests' one check of a refusal: `fn` must throw Error with `code` and
// a message holding each of `needles` (what the error must name).
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>
#include <string_view>

#include "mstar/kv/status.hpp"

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

}  // namespace mstar::kv::testing
