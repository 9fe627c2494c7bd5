// Copyright mstar-kv authors.
//
// How test processes talk to each other: descriptor bytes as hex on a text
// line (the kit's SEQ-line codec, src/toolkit/seq_line.hpp), layouts as one
// comma-separated argument. Shared by every multi-process test.
#pragma once

#include <string>

#include "mstar/kv/core/layout.hpp"
#include "toolkit/seq_line.hpp"

namespace mstar::kv::testing {

using toolkit::from_hex;
using toolkit::parse_seq_line;
using toolkit::seq_line;
using toolkit::to_hex;

// "layers,pages,page_size,heads,head_dim,dtype,has_v,cache_order,page_order"
// [",total_kv_heads,first_kv_head"]
std::string layout_arg(const KVLayout& l);
// Throws std::runtime_error (bad shape) or Error (invalid layout).
KVLayout parse_layout_arg(const std::string& s);

}  // namespace mstar::kv::testing
