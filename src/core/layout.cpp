// Copyright mstar-kv authors.
#include "mstar/kv/core/layout.hpp"

#include <algorithm>
#include <array>
#include <string>

#include "mstar/kv/util/enum_names.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

constexpr std::array<std::string_view, 5> kDTypeNames{"fp32", "fp16", "bf16", "fp8_e4m3",
                                                      "fp8_e5m2"};
static_assert(kDTypeNames.size() == static_cast<std::size_t>(DType::kFloat8E5M2) + 1);
constexpr std::array<std::string_view, 3> kCacheOrderNames{"layer", "page", "layer_page"};
static_assert(kCacheOrderNames.size() == kMaxCacheOrder + 1);
constexpr std::array<std::string_view, 2> kPageOrderNames{"nhd", "hnd"};
static_assert(kPageOrderNames.size() == kMaxPageOrder + 1);

}  // namespace

std::string_view to_string(DType dtype) noexcept {
  return enum_name(dtype, kDTypeNames, "unknown");
}

std::string_view to_string(CacheOrder order) noexcept {
  return enum_name(order, kCacheOrderNames, "unknown");
}

std::string_view to_string(PageOrder order) noexcept {
  return enum_name(order, kPageOrderNames, "unknown");
}

DType parse_dtype(std::string_view name) {
  if (auto d = enum_from_name<DType>(name, kDTypeNames)) return *d;
  throw Error(StatusCode::kInvalidArgument,
              "unknown dtype '" + std::string(name) +
                  "' (expected fp32, fp16, bf16, fp8_e4m3 or fp8_e5m2)");
}

CacheOrder parse_cache_order(std::string_view name) {
  if (auto o = enum_from_name<CacheOrder>(name, kCacheOrderNames)) return *o;
  throw Error(StatusCode::kInvalidArgument, "unknown cache order '" + std::string(name) +
                                                "' (expected layer, page or layer_page)");
}

PageOrder parse_page_order(std::string_view name) {
  if (auto o = enum_from_name<PageOrder>(name, kPageOrderNames)) return *o;
  throw Error(StatusCode::kInvalidArgument,
              "unknown page order '" + std::string(name) + "' (expected nhd or hnd)");
}

namespace {

void check_field(const char* name, std::uint64_t value, std::uint64_t max) {
  if (value == 0 || value > max) {
    throw Error(StatusCode::kInvalidArgument, std::string("layout ") + name + " " +
                                                  std::to_string(value) + " out of range [1, " +
                                                  std::to_string(max) + "]");
  }
}

}  // namespace

void KVLayout::validate() const {
  check_field("num_layers", num_layers, LayoutLimits::kMaxLayers);
  check_field("num_pages", num_pages, LayoutLimits::kMaxPages);
  check_field("page_size", page_size, LayoutLimits::kMaxPageSize);
  check_field("num_kv_heads", num_kv_heads, LayoutLimits::kMaxHeads);
  check_field("head_dim", head_dim, LayoutLimits::kMaxHeadDim);
  if (static_cast<std::uint8_t>(dtype) > static_cast<std::uint8_t>(DType::kFloat8E5M2)) {
    throw Error(StatusCode::kInvalidArgument,
                "layout dtype " + std::to_string(static_cast<int>(dtype)) + " out of range [0, 4]");
  }
  if (total_kv_heads > LayoutLimits::kMaxHeads) {
    throw Error(StatusCode::kInvalidArgument,
                "layout total_kv_heads " + std::to_string(total_kv_heads) + " out of range [0, " +
                    std::to_string(LayoutLimits::kMaxHeads) + "]");
  }
  if (std::uint64_t{first_kv_head} + num_kv_heads > model_kv_heads()) {
    throw Error(StatusCode::kInvalidArgument,
                "layout heads [" + std::to_string(first_kv_head) + ", " +
                    std::to_string(std::uint64_t{first_kv_head} + num_kv_heads) +
                    ") out of range [0, " + std::to_string(model_kv_heads()) +
                    ") of the model's total_kv_heads");
  }
  if (static_cast<std::uint8_t>(cache_order) > kMaxCacheOrder) {
    throw Error(StatusCode::kInvalidArgument,
                "layout cache_order " + std::to_string(static_cast<int>(cache_order)) +
                    " out of range [0, " + std::to_string(kMaxCacheOrder) + "]");
  }
  if (static_cast<std::uint8_t>(page_order) > kMaxPageOrder) {
    throw Error(StatusCode::kInvalidArgument,
                "layout page_order " + std::to_string(static_cast<int>(page_order)) +
                    " out of range [0, " + std::to_string(kMaxPageOrder) + "]");
  }
  // Each factor is bounded, but their product may not fit in 64 bits.
  std::uint64_t total = head_bytes();
  const bool overflow = __builtin_mul_overflow(total, std::uint64_t{num_kv_heads}, &total) ||
                        __builtin_mul_overflow(total, std::uint64_t{page_size}, &total) ||
                        __builtin_mul_overflow(total, std::uint64_t{num_kv()}, &total) ||
                        __builtin_mul_overflow(total, std::uint64_t{num_layers}, &total) ||
                        __builtin_mul_overflow(total, std::uint64_t{num_pages}, &total);
  if (overflow || total > LayoutLimits::kMaxTotalBytes) {
    throw Error(
        StatusCode::kInvalidArgument,
        "layout total size " +
            (overflow ? std::string("overflows 64 bits") : std::to_string(total) + " bytes") +
            ", limit " + std::to_string(LayoutLimits::kMaxTotalBytes));
  }
}

namespace {

template <typename T>
void compare(const char* field, const T& local, const T& remote) {
  if (local != remote) {
    throw Error(StatusCode::kIncompatibleLayout, std::string("layouts differ in ") + field +
                                                     ": local " + std::to_string(local) +
                                                     ", remote " + std::to_string(remote));
  }
}

}  // namespace

void KVLayout::check_compatible(const KVLayout& remote) const {
  check_shard(remote, first_kv_head, end_kv_head());
}

void KVLayout::check_same_model(const KVLayout& remote) const {
  const std::uint32_t lo = std::max(first_kv_head, remote.first_kv_head);
  const std::uint32_t hi = std::min(end_kv_head(), remote.end_kv_head());
  if (lo >= hi) {
    compare("total_kv_heads (the model's KV heads)", model_kv_heads(), remote.model_kv_heads());
    throw Error(StatusCode::kIncompatibleLayout,
                "layouts differ in heads: the remote cache holds KV heads [" +
                    std::to_string(remote.first_kv_head) + ", " +
                    std::to_string(remote.end_kv_head()) + ") of " +
                    std::to_string(remote.model_kv_heads()) + ", none of the local [" +
                    std::to_string(first_kv_head) + ", " + std::to_string(end_kv_head()) + ")");
  }
  check_shard(remote, lo, hi);
}

void KVLayout::check_shard(const KVLayout& remote, std::uint32_t lo, std::uint32_t hi) const {
  compare("num_layers", num_layers, remote.num_layers);
  compare("total_kv_heads (the model's KV heads)", model_kv_heads(), remote.model_kv_heads());
  compare("head_dim", head_dim, remote.head_dim);
  if (dtype != remote.dtype) {
    throw Error(StatusCode::kIncompatibleLayout,
                "layouts differ in dtype: local " + std::string(kv::to_string(dtype)) +
                    ", remote " + std::string(kv::to_string(remote.dtype)));
  }
  if (has_v != remote.has_v) {
    throw Error(StatusCode::kIncompatibleLayout, std::string("layouts differ in has_v: local ") +
                                                     (has_v ? "true" : "false") + ", remote " +
                                                     (remote.has_v ? "true" : "false"));
  }
  if (lo < first_kv_head || hi > end_kv_head() || lo >= hi) {
    throw Error(StatusCode::kInvalidArgument,
                "heads [" + std::to_string(lo) + ", " + std::to_string(hi) +
                    ") to read are not a part of the local cache's heads [" +
                    std::to_string(first_kv_head) + ", " + std::to_string(end_kv_head()) + ")");
  }
  if (remote.first_kv_head > lo || remote.end_kv_head() < hi) {
    throw Error(StatusCode::kIncompatibleLayout,
                "layouts differ in heads: the remote cache holds KV heads [" +
                    std::to_string(remote.first_kv_head) + ", " +
                    std::to_string(remote.end_kv_head()) + ") of " +
                    std::to_string(remote.model_kv_heads()) + ", the read needs [" +
                    std::to_string(lo) + ", " + std::to_string(hi) +
                    ") (read the others from the peers that hold them)");
  }
}

bool KVLayout::is_compatible(const KVLayout& remote) const noexcept {
  return num_layers == remote.num_layers && model_kv_heads() == remote.model_kv_heads() &&
         head_dim == remote.head_dim && dtype == remote.dtype && has_v == remote.has_v &&
         remote.first_kv_head <= first_kv_head && remote.end_kv_head() >= end_kv_head();
}

std::array<std::uint64_t, 6> KVLayout::view_shape() const noexcept {
  const bool nhd = page_order == PageOrder::kNHD;
  const std::uint64_t p0 = nhd ? page_size : num_kv_heads;
  const std::uint64_t p1 = nhd ? num_kv_heads : page_size;
  switch (cache_order) {
    case CacheOrder::kPageMajor:
      return {num_pages, num_layers, num_kv(), p0, p1, head_dim};
    case CacheOrder::kLayerPage:
      return {num_layers, num_pages, num_kv(), p0, p1, head_dim};
    case CacheOrder::kLayerMajor:
      break;
  }
  return {num_layers, num_kv(), num_pages, p0, p1, head_dim};
}

std::string KVLayout::view_axes() const {
  const std::string p =
      page_order == PageOrder::kNHD ? "page_size, num_kv_heads" : "num_kv_heads, page_size";
  switch (cache_order) {
    case CacheOrder::kPageMajor:
      return "[num_pages, num_layers, num_kv, " + p + ", head_dim]";
    case CacheOrder::kLayerPage:
      return "[num_layers, num_pages, num_kv, " + p + ", head_dim]";
    case CacheOrder::kLayerMajor:
      break;
  }
  return "[num_layers, num_kv, num_pages, " + p + ", head_dim]";
}

std::string KVLayout::to_string() const {
  return std::to_string(num_layers) + "L x " + std::to_string(num_pages) + "P x " +
         std::to_string(page_size) + "T x " + std::to_string(num_kv_heads) + "H x " +
         std::to_string(head_dim) + "D " + std::string(kv::to_string(dtype)) +
         (has_v ? " kv " : " k-only ") +
         (cache_order == CacheOrder::kLayerPage ? std::string("layer-page")
                                                : std::string(kv::to_string(cache_order))) +
         "-major " + std::string(kv::to_string(page_order)) +
         (num_kv_heads != model_kv_heads()
              ? " heads " + std::to_string(first_kv_head) + "-" + std::to_string(end_kv_head()) +
                    " of " + std::to_string(model_kv_heads())
              : std::string());
}

}  // namespace mstar::kv
