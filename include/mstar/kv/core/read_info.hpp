// Copyright mstar-kv authors.
//
// KVReadInfo: one page of one layer to read, what the planner hands engines.
#pragma once

#include <cstdint>

namespace mstar::kv {

// One page of one layer to read, K and V both (V only when the layout has
// it): tokens [token_start, token_end) of local page `local_page_idx` come
// from remote page `remote_page_idx`.
// The spec's five fields say it all when both caches share a geometry: the
// tokens sit at the same positions of the remote page. For caches of
// different geometry (layout.hpp: page sizes, head shards) two more, which
// the planner sets (plan_reads with both layouts) and callers may leave:
// * remote_token_start: where the tokens start in the remote page when the
//   page sizes differ; -1 (the default): at token_start.
// * [head_start, head_end): the model's KV heads to read (layout.hpp,
//   first_kv_head); 0, 0 (the default): every head the local cache holds.
// Valid when 0 <= token_start < token_end <= the local page size and the
// remote tokens and heads lie inside the remote page and shard.
struct KVReadInfo {
  std::int64_t layer_idx = 0;
  std::int64_t local_page_idx = 0;
  std::int64_t remote_page_idx = 0;
  std::int64_t token_start = 0;
  std::int64_t token_end = 0;
  std::int64_t remote_token_start = -1;
  std::int64_t head_start = 0;
  std::int64_t head_end = 0;

  // The spec's form: same positions, every head.
  bool plain() const noexcept { return remote_token_start < 0 && head_start == 0 && head_end == 0; }
  bool operator==(const KVReadInfo&) const = default;
};

}  // namespace mstar::kv
