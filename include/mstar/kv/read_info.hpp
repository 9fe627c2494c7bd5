// Copyright mstar-kv authors.
#pragma once

#include <cstdint>

namespace mstar::kv {

// One page of one layer to read, K and V both (V only when the layout has
// it): tokens [token_start, token_end) of remote page `remote_page_idx` land
// at the same token positions of local page `local_page_idx`.
// Valid when 0 <= token_start < token_end <= page_size.
struct KVReadInfo {
  std::int64_t layer_idx = 0;
  std::int64_t local_page_idx = 0;
  std::int64_t remote_page_idx = 0;
  std::int64_t token_start = 0;
  std::int64_t token_end = 0;

  bool operator==(const KVReadInfo&) const = default;
};

}  // namespace mstar::kv
