// Copyright mstar-kv authors.
//
// KVLayout: the geometry of one paged KV cache and the byte arithmetic on it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace mstar::kv {

// A cache holds, for every layer, K (and V unless the model stores a single
// latent, as MLA does) for num_pages pages of page_size tokens each. Three
// axis orders are supported for the whole cache and two inside a page:
//
//   CacheOrder::kLayerMajor  [layer][k|v][page][page bytes]   torch [L, 2, P, ...]
//   CacheOrder::kPageMajor   [page][layer][k|v][page bytes]   torch [P, L, 2, ...]
//   CacheOrder::kLayerPage   [layer][page][k|v][page bytes]   torch [L, P, 2, ...]
//   PageOrder::kNHD          [token][head][dim]   (token-major)
//   PageOrder::kHND          [head][token][dim]   (head-major)
//
// kLayerPage is the older upstream mstar KVCache and vLLM FlashInfer's
// per-layer [num_blocks, 2, block_size, H, D]: K and V of one page are
// neighbours. Without V (MLA) it is byte for byte kLayerMajor, but stays a
// distinct order (a layout says what its owner declared).
//
// A "block" is the page bytes of one (layer, k|v, page). Value type; all
// methods are const and safe from any thread.
//
// DType, the element type; CacheOrder, PageOrder: the axis orders above.
enum class DType : std::uint8_t {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
};

// The values travel in descriptors (codec.cpp): never renumber.
enum class CacheOrder : std::uint8_t { kLayerMajor = 0, kPageMajor = 1, kLayerPage = 2 };
enum class PageOrder : std::uint8_t { kNHD = 0, kHND = 1 };
// The largest value of each; validate() and the decoders refuse others.
inline constexpr std::uint8_t kMaxCacheOrder = 2;
inline constexpr std::uint8_t kMaxPageOrder = 1;
enum class KV : std::uint8_t { kKey = 0, kValue = 1 };

// Bytes of one element; 0 for a value outside the enum. Inline: the planner
// computes offsets with it per copy.
constexpr std::size_t dtype_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2:
      return 1;
  }
  return 0;
}
std::string_view to_string(DType dtype) noexcept;
std::string_view to_string(CacheOrder order) noexcept;
std::string_view to_string(PageOrder order) noexcept;
// Parses "fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"; throws Error.
DType parse_dtype(std::string_view name);
// Parses "layer" / "page" / "layer_page"; throws Error.
CacheOrder parse_cache_order(std::string_view name);
// Parses "nhd" / "hnd"; throws Error.
PageOrder parse_page_order(std::string_view name);

// Limits applied to every layout, including those decoded from the wire, so
// that all byte arithmetic fits in 64 bits with room to spare.
struct LayoutLimits {
  static constexpr std::uint32_t kMaxLayers = 4096;
  static constexpr std::uint32_t kMaxPages = 1u << 26;
  static constexpr std::uint32_t kMaxPageSize = 1u << 16;
  static constexpr std::uint32_t kMaxHeads = 4096;
  static constexpr std::uint32_t kMaxHeadDim = 1u << 16;
  static constexpr std::uint64_t kMaxTotalBytes = 1ull << 46;  // 64 TiB
};

struct KVLayout {
  std::uint32_t num_layers = 0;
  std::uint32_t num_pages = 0;
  std::uint32_t page_size = 0;  // tokens per page
  std::uint32_t num_kv_heads = 0;
  std::uint32_t head_dim = 0;
  DType dtype = DType::kBFloat16;
  bool has_v = true;  // false for MLA's single latent
  CacheOrder cache_order = CacheOrder::kLayerMajor;
  PageOrder page_order = PageOrder::kNHD;
  // Head shards (tensor parallelism): the model has total_kv_heads KV heads
  // (0: num_kv_heads, the cache holds them all) and this cache holds heads
  // [first_kv_head, first_kv_head + num_kv_heads) of them; e.g. rank 1 of
  // TP=2 over Llama-3-8B's 8 KV heads: total 8, first 4, num 4. A latent
  // cache (MLA, has_v false) holds its one head on every rank: total 1.
  std::uint32_t total_kv_heads = 0;
  std::uint32_t first_kv_head = 0;

  // Throws Error(kInvalidArgument) naming the first field outside its limit.
  void validate() const;

  std::uint32_t model_kv_heads() const noexcept {
    return total_kv_heads != 0 ? total_kv_heads : num_kv_heads;
  }
  // One past the last model head this cache holds.
  std::uint32_t end_kv_head() const noexcept { return first_kv_head + num_kv_heads; }

  std::size_t element_size() const noexcept { return dtype_size(dtype); }
  std::uint32_t num_kv() const noexcept { return has_v ? 2u : 1u; }
  // Bytes of one token of one head (head_dim elements).
  std::uint64_t head_bytes() const noexcept { return std::uint64_t{head_dim} * element_size(); }
  // Bytes of one token across all heads, for one layer and one of k|v.
  std::uint64_t token_bytes() const noexcept { return head_bytes() * num_kv_heads; }
  // Bytes of one block: one page of one layer, one of k|v.
  std::uint64_t block_bytes() const noexcept { return token_bytes() * page_size; }
  // Bytes of one page across all layers and k|v.
  std::uint64_t page_bytes_all_layers() const noexcept {
    return block_bytes() * num_kv() * num_layers;
  }
  std::uint64_t total_bytes() const noexcept { return page_bytes_all_layers() * num_pages; }
  // True when every layer's bytes are one contiguous run of layer_bytes()
  // at offset layer * layer_bytes() (every order but page-major): such a
  // cache may live in one memory region per layer (cache.hpp).
  bool layer_contiguous() const noexcept { return cache_order != CacheOrder::kPageMajor; }
  // Bytes of one layer: K (and V) of every page.
  std::uint64_t layer_bytes() const noexcept { return block_bytes() * num_kv() * num_pages; }

  // Byte offset of block (layer, kv, page) from the cache base. Unchecked:
  // callers validate indices first (KVCache::block does).
  std::uint64_t block_offset(std::uint32_t layer, KV kv, std::uint32_t page) const noexcept {
    const auto k = static_cast<std::uint64_t>(kv);
    std::uint64_t index = 0;
    switch (cache_order) {
      case CacheOrder::kLayerMajor:
        index = (std::uint64_t{layer} * num_kv() + k) * num_pages + page;
        break;
      case CacheOrder::kPageMajor:
        index = (std::uint64_t{page} * num_layers + layer) * num_kv() + k;
        break;
      case CacheOrder::kLayerPage:
        index = (std::uint64_t{layer} * num_pages + page) * num_kv() + k;
        break;
    }
    return index * block_bytes();
  }

  // The cache as one C-contiguous 6-D tensor (Python's view_shape, the
  // cuda_ipc descriptor's size): layer-major [L, kv, P, P0, P1, D],
  // page-major [P, L, kv, P0, P1, D], layer_page [L, P, kv, P0, P1, D], with
  // kv = num_kv() and (P0, P1) = (page_size, num_kv_heads) in NHD,
  // (num_kv_heads, page_size) in HND.
  std::array<std::uint64_t, 6> view_shape() const noexcept;
  // The names of those axes, e.g. "[num_layers, num_pages, num_kv, page_size,
  // num_kv_heads, head_dim]".
  std::string view_axes() const;

  // Byte offset inside a block of (token, head, dim 0).
  std::uint64_t in_block_offset(std::uint32_t token, std::uint32_t head) const noexcept {
    return page_order == PageOrder::kNHD
               ? (std::uint64_t{token} * num_kv_heads + head) * head_bytes()
               : (std::uint64_t{head} * page_size + token) * head_bytes();
  }

  // Throws Error(kIncompatibleLayout) naming the first field that differs
  // between *this (local) and `remote` among those a read needs to match:
  // num_layers, head_dim, dtype, has_v and the model's head count
  // (model_kv_heads), or when the remote shard does not hold every head this
  // cache holds. num_pages, page_size, cache_order, page_order and the head
  // split may differ (the planner handles them).
  void check_compatible(const KVLayout& remote) const;
  bool is_compatible(const KVLayout& remote) const noexcept;
  // What engines check on a descriptor before looking at the reads: the
  // fields above that must match, and that the remote shard holds at least
  // one of this cache's heads (the reads say which; plan_copies checks them).
  void check_same_model(const KVLayout& remote) const;
  // The same, but the remote shard need only hold model heads [lo, hi)
  // (a part of this cache's heads read from one of several peers).
  void check_shard(const KVLayout& remote, std::uint32_t lo, std::uint32_t hi) const;
  // True when both hold the same heads in the same page size: reads then
  // map token to token and head to head (the fast path).
  bool same_geometry(const KVLayout& remote) const noexcept {
    return page_size == remote.page_size && num_kv_heads == remote.num_kv_heads &&
           first_kv_head == remote.first_kv_head && model_kv_heads() == remote.model_kv_heads();
  }

  // "32L x 1024P x 16T x 8H x 128D bf16 kv layer-major nhd" (page-major,
  // layer-page-major), with " heads 4-8 of 8" for a shard
  std::string to_string() const;

  bool operator==(const KVLayout&) const = default;
};

}  // namespace mstar::kv
