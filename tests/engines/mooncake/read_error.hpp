// Copyright mstar-kv authors.
//
// For the Mooncake gtest suites (not the peer programs, which have no gtest).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "mooncake_test_util.hpp"

namespace mstar::kv::testing {

// The Error of an attempted read of `info` (tokens [0, 64) into local pages
// 0..3); fails the test if the read is accepted.
inline Error read_error(KVTransferManager& m, const std::vector<std::uint32_t>& remote,
                        const KVTransferInfo& info) {
  try {
    auto f = m.start_async_retrieve(0, 64, iota_pages(4), remote, info);
    if (f) f->wait_for(std::chrono::seconds(10));
    ADD_FAILURE() << "the read was accepted; status "
                  << (f ? f->status().to_string() : std::string("none"));
  } catch (const Error& e) {
    return e;
  }
  return Error(StatusCode::kOk, "");
}

}  // namespace mstar::kv::testing
