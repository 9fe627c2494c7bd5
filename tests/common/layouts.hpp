// Copyright mstar-kv authors.
//
// The small layout most engine tests use: 4 layers, `pages` pages of 16
// tokens, 2 KV heads of 64 bf16 (4 KiB per page and layer, K and V).
#pragma once

#include <cstdint>

#include "mstar/kv/layout.hpp"

namespace mstar::kv::testing {

inline KVLayout small_layout(CacheOrder co = CacheOrder::kLayerMajor,
                             PageOrder po = PageOrder::kNHD, std::uint32_t pages = 64) {
  KVLayout l;
  l.num_layers = 4;
  l.num_pages = pages;
  l.page_size = 16;
  l.num_kv_heads = 2;
  l.head_dim = 64;
  l.dtype = DType::kBFloat16;
  l.cache_order = co;
  l.page_order = po;
  return l;
}

// The same with `pages` pages.
inline KVLayout small_layout(std::uint32_t pages, CacheOrder co = CacheOrder::kLayerMajor,
                             PageOrder po = PageOrder::kNHD) {
  return small_layout(co, po, pages);
}

}  // namespace mstar::kv::testing
