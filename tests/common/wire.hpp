// Copyright mstar-kv authors.
//
// How test processes talk to each other: descriptor bytes as hex on a text
// line, layouts as one comma-separated argument. Shared by every multi-process
// test (conformance, shm, cuda_ipc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mstar/kv/layout.hpp"

namespace mstar::kv::testing {

std::string to_hex(const std::vector<std::uint8_t>& bytes);
// Throws std::runtime_error on an odd length or a non-hex digit.
std::vector<std::uint8_t> from_hex(const std::string& hex);

// "layers,pages,page_size,heads,head_dim,dtype,has_v,cache_order,page_order"
std::string layout_arg(const KVLayout& l);
// Throws std::runtime_error (bad shape) or Error (invalid layout).
KVLayout parse_layout_arg(const std::string& s);

}  // namespace mstar::kv::testing
