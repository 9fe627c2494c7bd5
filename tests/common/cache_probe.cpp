// Copyright mstar-kv authors.
#include "common/cache_probe.hpp"

#include <cstdlib>
#include <cstring>

#include "mstar/kv/core/planner.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::testing {

bool gpu_required() {
  const char* v = std::getenv("MSTAR_KV_REQUIRE_GPU");
  return v != nullptr && std::string(v) == "1";
}

// Host memory is walked region by region (a cache of one region per layer).
void fill_bytes(const KVCache& c, std::byte value) {
  if (c.memory_kind() == MemoryKind::kDevice) return device_memset(c, value);
  c.for_each_run(0, c.size_bytes(), [&](std::byte* p, std::uint64_t, std::uint64_t n) {
    std::memset(p, static_cast<int>(value), n);
  });
}

std::shared_ptr<KVCache> download(const KVCache& c) {
  auto host = KVCache::create_host(c.layout());
  if (c.memory_kind() == MemoryKind::kDevice) {
    device_to_host(c, host->base());
  } else {
    c.for_each_run(0, c.size_bytes(), [&](std::byte* p, std::uint64_t off, std::uint64_t n) {
      std::memcpy(host->base() + off, p, n);
    });
  }
  return host;
}

void upload(const KVCache& host, const KVCache& c) {
  if (c.memory_kind() == MemoryKind::kDevice) return host_to_device(host.base(), c);
  c.for_each_run(0, c.size_bytes(), [&](std::byte* p, std::uint64_t off, std::uint64_t n) {
    std::memcpy(p, host.base() + off, n);
  });
}

void fill_pattern_any(const KVCache& c, std::uint64_t seed, std::span<const std::uint32_t> pages,
                      std::uint64_t start, std::uint64_t end) {
  if (c.memory_kind() != MemoryKind::kDevice) return fill_pattern(c, seed, pages, start, end);
  auto host = download(c);
  fill_pattern(*host, seed, pages, start, end);
  upload(*host, c);
}

void fill_pattern_layers_any(const KVCache& c, std::uint64_t seed,
                             std::span<const std::uint32_t> pages, std::uint64_t start,
                             std::uint64_t end, std::uint32_t layer_begin,
                             std::uint32_t layer_end) {
  if (c.memory_kind() != MemoryKind::kDevice) {
    return fill_pattern_layers(c, seed, pages, start, end, layer_begin, layer_end);
  }
  auto host = download(c);
  fill_pattern_layers(*host, seed, pages, start, end, layer_begin, layer_end);
  upload(*host, c);
}

void fill_pages_any(const KVCache& c, std::span<const std::uint32_t> pages, std::byte value) {
  std::shared_ptr<KVCache> copy;
  const KVCache* host = &c;
  if (c.memory_kind() == MemoryKind::kDevice) {
    copy = download(c);
    host = copy.get();
  }
  const KVLayout& l = c.layout();
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
      for (std::uint32_t p : pages) {
        auto b = host->block(layer, static_cast<KV>(kv), p);
        std::memset(b.data(), static_cast<int>(value), b.size());
      }
    }
  }
  if (copy) upload(*copy, c);
}

VerifyResult verify_pattern_any(const KVCache& c, std::uint64_t seed,
                                std::span<const std::uint32_t> pages, std::uint64_t start,
                                std::uint64_t end) {
  if (c.memory_kind() != MemoryKind::kDevice) return verify_pattern(c, seed, pages, start, end);
  return verify_pattern(*download(c), seed, pages, start, end);
}

std::uint64_t bytes_written_outside(const KVCache& local, const KVLayout& remote,
                                    std::span<const KVReadInfo> reads, std::byte sentinel) {
  std::shared_ptr<KVCache> copy;
  const KVCache* host = &local;
  if (local.memory_kind() == MemoryKind::kDevice || local.split()) {
    copy = download(local);
    host = copy.get();
  }
  std::vector<std::uint8_t> named(local.size_bytes(), 0);
  if (!reads.empty()) {
    for (const CopySpan& s : plan_copies(local.layout(), remote, reads).spans) {
      std::fill_n(named.begin() + static_cast<std::ptrdiff_t>(s.local_offset), s.length, 1);
    }
  }
  std::uint64_t n = 0;
  for (std::size_t i = 0; i < named.size(); ++i) n += !named[i] && host->base()[i] != sentinel;
  return n;
}

}  // namespace mstar::kv::testing
