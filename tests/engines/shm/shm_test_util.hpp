// Copyright mstar-kv authors.
//
// Helpers of the shm engine tests (the shared ones live in tests/common).
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "common/child_process.hpp"
#include "common/wire.hpp"
#include "mstar/kv/layout.hpp"

namespace mstar::kv::shmtest {

using testing::from_hex;
using testing::to_hex;
using testing::layout_arg;
inline KVLayout parse_layout(const std::string& s) { return testing::parse_layout_arg(s); }

using testing::Child;

}  // namespace mstar::kv::shmtest
