// Copyright mstar-kv authors.
#include "mstar/kv/testing/pattern.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline std::uint64_t fmix(std::uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

inline std::uint64_t row_key(std::uint64_t seed, std::uint32_t layer, std::uint32_t kv,
                             std::uint64_t token, std::uint32_t head) {
  std::uint64_t h = fmix(seed + kGolden);
  h = fmix(h ^ (std::uint64_t{layer} << 1 | kv));
  h = fmix(h ^ token);
  return fmix(h ^ head);
}

// The row's bytes: little-endian words fmix(key + j * golden), truncated.
void make_row(std::uint64_t key, std::byte* out, std::size_t n) {
  std::size_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const std::uint64_t w = fmix(key + (j / 8 + 1) * kGolden);
    std::memcpy(out + j, &w, 8);
  }
  if (j < n) {
    const std::uint64_t w = fmix(key + (j / 8 + 1) * kGolden);
    std::memcpy(out + j, &w, n - j);
  }
}

// Streaming 64-bit hash of bytes in the order they are fed.
class Hasher {
 public:
  void feed(const std::byte* p, std::size_t n) {
    std::size_t j = 0;
    for (; j + 8 <= n; j += 8) {
      std::uint64_t w;
      std::memcpy(&w, p + j, 8);
      mix(w);
    }
    if (j < n) {
      std::uint64_t w = 0;
      std::memcpy(&w, p + j, n - j);
      mix(w ^ (std::uint64_t{n - j} << 56));
    }
  }
  std::uint64_t value() const { return fmix(h_ ^ count_); }

 private:
  void mix(std::uint64_t w) {
    h_ = (h_ ^ (w * 0x87C37B91114253D5ULL));
    h_ = ((h_ << 31) | (h_ >> 33)) * 0x4CF5AD432745937FULL;
    ++count_;
  }
  std::uint64_t h_ = 0x243F6A8885A308D3ULL;
  std::uint64_t count_ = 0;
};

void check_host(const KVCache& cache) {
  if (cache.memory_kind() == MemoryKind::kDevice) {
    throw Error(StatusCode::kInvalidArgument,
                "pattern fill/verify needs host memory, the cache is on a device");
  }
}

void check_table(const KVCache& cache, std::span<const std::uint32_t> pages,
                 std::uint64_t start_len, std::uint64_t end_len) {
  const KVLayout& l = cache.layout();
  if (start_len > end_len) {
    throw Error(StatusCode::kInvalidArgument, "start_len " + std::to_string(start_len) +
                                                  " is greater than end_len " +
                                                  std::to_string(end_len));
  }
  const std::uint64_t needed = (end_len + l.page_size - 1) / l.page_size;
  if (pages.size() < needed) {
    throw Error(StatusCode::kInvalidArgument, "page table has " + std::to_string(pages.size()) +
                                                  " entries, " + std::to_string(end_len) +
                                                  " tokens need " + std::to_string(needed));
  }
  for (std::uint64_t i = start_len / l.page_size; i < needed; ++i) {
    if (pages[i] >= l.num_pages) {
      throw Error(StatusCode::kInvalidArgument, "page " + std::to_string(pages[i]) +
                                                    " out of range [0, " +
                                                    std::to_string(l.num_pages) + ")");
    }
  }
}

// Calls fn(layer, kv, seq_page_index, page, t0, t1) for every block touched.
template <typename Fn>
void for_each_block(const KVLayout& l, std::span<const std::uint32_t> pages,
                    std::uint64_t start_len, std::uint64_t end_len, Fn&& fn,
                    std::uint32_t layer_begin = 0, std::uint32_t layer_end = ~0u) {
  layer_end = std::min(layer_end, l.num_layers);
  if (start_len == end_len) return;
  const std::uint64_t ps = l.page_size;
  const std::uint64_t needed = (end_len + ps - 1) / ps;
  for (std::uint64_t i = start_len / ps; i < needed; ++i) {
    const std::uint64_t base = i * ps;
    const auto t0 = static_cast<std::uint32_t>(start_len > base ? start_len - base : 0);
    const auto t1 = static_cast<std::uint32_t>(std::min(ps, end_len - base));
    for (std::uint32_t layer = layer_begin; layer < layer_end; ++layer) {
      for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) fn(layer, kv, i, pages[i], t0, t1);
    }
  }
}

}  // namespace

void fill_pattern(const KVCache& cache, std::uint64_t seed, std::span<const std::uint32_t> pages,
                  std::uint64_t start_len, std::uint64_t end_len) {
  fill_pattern_layers(cache, seed, pages, start_len, end_len, 0, cache.layout().num_layers);
}

void fill_pattern_layers(const KVCache& cache, std::uint64_t seed,
                         std::span<const std::uint32_t> pages, std::uint64_t start_len,
                         std::uint64_t end_len, std::uint32_t layer_begin,
                         std::uint32_t layer_end) {
  if (layer_begin > layer_end || layer_end > cache.layout().num_layers) {
    throw Error(StatusCode::kInvalidArgument, "pattern layers [" + std::to_string(layer_begin) +
                                                  ", " + std::to_string(layer_end) +
                                                  ") out of range [0, " +
                                                  std::to_string(cache.layout().num_layers) + "]");
  }
  check_host(cache);
  check_table(cache, pages, start_len, end_len);
  const KVLayout& l = cache.layout();
  const std::size_t hb = l.head_bytes();
  for_each_block(
      l, pages, start_len, end_len,
      [&](std::uint32_t layer, std::uint32_t kv, std::uint64_t i, std::uint32_t page,
          std::uint32_t t0, std::uint32_t t1) {
        std::byte* block = cache.at(l.block_offset(layer, static_cast<KV>(kv), page));
        for (std::uint32_t t = t0; t < t1; ++t) {
          const std::uint64_t token = i * l.page_size + t;
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            make_row(row_key(seed, layer, kv, token, l.first_kv_head + h),
                     block + l.in_block_offset(t, h), hb);
          }
        }
      },
      layer_begin, layer_end);
}

VerifyResult verify_pattern(const KVCache& cache, std::uint64_t seed,
                            std::span<const std::uint32_t> pages, std::uint64_t start_len,
                            std::uint64_t end_len) {
  check_host(cache);
  check_table(cache, pages, start_len, end_len);
  const KVLayout& l = cache.layout();
  const std::size_t hb = l.head_bytes();
  std::vector<std::byte> row(hb);
  VerifyResult result;
  Hasher total;
  for_each_block(
      l, pages, start_len, end_len,
      [&](std::uint32_t layer, std::uint32_t kv, std::uint64_t i, std::uint32_t page,
          std::uint32_t t0, std::uint32_t t1) {
        const std::byte* block = cache.at(l.block_offset(layer, static_cast<KV>(kv), page));
        Hasher got;
        Hasher want;
        for (std::uint32_t t = t0; t < t1; ++t) {
          const std::uint64_t token = i * l.page_size + t;
          for (std::uint32_t h = 0; h < l.num_kv_heads; ++h) {
            got.feed(block + l.in_block_offset(t, h), hb);
            make_row(row_key(seed, layer, kv, token, l.first_kv_head + h), row.data(), hb);
            want.feed(row.data(), hb);
          }
        }
        const std::uint64_t g = got.value();
        ++result.blocks_checked;
        result.bytes_checked += std::uint64_t{t1 - t0} * l.token_bytes();
        std::byte tag[8];
        std::memcpy(tag, &g, 8);
        total.feed(tag, 8);
        if (g != want.value()) {
          if (result.mismatched_blocks == 0) {
            result.first_mismatch = "layer " + std::to_string(layer) + (kv == 0 ? " k" : " v") +
                                    " page " + std::to_string(page) + " (sequence page " +
                                    std::to_string(i) + ", tokens [" +
                                    std::to_string(i * l.page_size + t0) + ", " +
                                    std::to_string(i * l.page_size + t1) + ")): checksum mismatch";
          }
          ++result.mismatched_blocks;
        }
      });
  result.checksum = total.value();
  return result;
}

}  // namespace mstar::kv
