// Copyright mstar-kv authors.
//
// The layouts the tests use, once.
#pragma once

#include <cstdint>
#include <vector>

#include "mstar/kv/core/layout.hpp"

namespace mstar::kv::testing {

// Any layout: layers, pages, tokens per page, KV heads, head dim, then the
// element type and the orders.
inline KVLayout make_layout(std::uint32_t layers, std::uint32_t pages, std::uint32_t page_size,
                            std::uint32_t heads, std::uint32_t head_dim,
                            DType dtype = DType::kBFloat16, CacheOrder co = CacheOrder::kLayerMajor,
                            PageOrder po = PageOrder::kNHD) {
  return {.num_layers = layers,
          .num_pages = pages,
          .page_size = page_size,
          .num_kv_heads = heads,
          .head_dim = head_dim,
          .dtype = dtype,
          .cache_order = co,
          .page_order = po};
}

// The engine tests' cache: 4 layers, `pages` pages of 16 tokens, 2 heads x
// 64 bf16: 4 KiB blocks, 2 MiB at 64 pages.
inline KVLayout small_layout(CacheOrder co = CacheOrder::kLayerMajor,
                             PageOrder po = PageOrder::kNHD, std::uint32_t pages = 64) {
  return make_layout(4, pages, 16, 2, 64, DType::kBFloat16, co, po);
}

// The same with `pages` pages first.
inline KVLayout small_layout(std::uint32_t pages, CacheOrder co = CacheOrder::kLayerMajor,
                             PageOrder po = PageOrder::kNHD) {
  return small_layout(co, po, pages);
}

// A head shard of small_layout()'s shape with 32-wide heads: `heads` of the
// model's `total` KV heads from `first`, pages of `page_size` tokens.
inline KVLayout shard_layout(std::uint32_t page_size, std::uint32_t heads, std::uint32_t first,
                             std::uint32_t total, PageOrder po, CacheOrder co,
                             std::uint32_t pages) {
  KVLayout l = small_layout(co, po, pages);
  l.page_size = page_size;
  l.num_kv_heads = heads;
  l.first_kv_head = first;
  l.total_kv_heads = total;
  l.head_dim = 32;
  return l;
}

// The owner the geometry cases read: all 8 heads, 16-token HND pages,
// page-major, 64 pages.
inline KVLayout geometry_owner() {
  return shard_layout(16, 8, 0, 8, PageOrder::kHND, CacheOrder::kPageMajor, 64);
}

// A decode cache of another page size, in-page order, cache order or head
// shard than geometry_owner()'s, and the token its read starts at.
struct GeometryCase {
  const char* what;
  KVLayout local;
  std::uint64_t start;
};

inline std::vector<GeometryCase> geometry_cases() {
  return {
      {"same geometry", geometry_owner(), 0},
      {"NHD layer-major, prefix hit mid-page",
       shard_layout(16, 8, 0, 8, PageOrder::kNHD, CacheOrder::kLayerMajor, 64), 37},
      {"TP 1 -> 2, rank 1, 64-token NHD pages",
       shard_layout(64, 4, 4, 8, PageOrder::kNHD, CacheOrder::kLayerMajor, 16), 0},
      {"TP 1 -> 8, rank 5, 24-token pages, prefix hit in the first page",
       shard_layout(24, 1, 5, 8, PageOrder::kNHD, CacheOrder::kPageMajor, 20), 5},
      {"TP 1 -> 8, rank 5, 24-token pages, prefix hit mid-page",
       shard_layout(24, 1, 5, 8, PageOrder::kNHD, CacheOrder::kPageMajor, 20), 37},
      {"all heads, 128-token HND pages",
       shard_layout(128, 8, 0, 8, PageOrder::kHND, CacheOrder::kLayerMajor, 4), 0},
  };
}

// Pages first, first + 1, ..., n of them.
inline std::vector<std::uint32_t> iota_pages(std::size_t n, std::uint32_t first = 0) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = first + static_cast<std::uint32_t>(i);
  return v;
}

}  // namespace mstar::kv::testing
