// Copyright mstar-kv authors.
//
// The cache probe: fills and reads any cache the tests make through a host
// copy, so that one test body checks host, shared and device caches alike.
// Host and shared memory are read in place; device memory is staged with
// cudaMemcpy (in builds with the cuda_ipc engine; elsewhere the device
// calls throw Error(kUnavailable)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/read_info.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::testing {

// "" when a CUDA device can be used here, else why not (the CUDA error).
std::string no_device_reason();
// MSTAR_KV_REQUIRE_GPU=1 (scripts/gpu-check): a missing device fails.
bool gpu_required();

// Every byte of `c` set to `value`.
void fill_bytes(const KVCache& c, std::byte value);
// A host cache of c's layout holding c's bytes (c itself for host memory
// is not returned: always a copy).
std::shared_ptr<KVCache> download(const KVCache& c);
// Writes a host cache of the same layout over `c`.
void upload(const KVCache& host, const KVCache& c);
// fill_pattern / verify_pattern (pattern.hpp) on any cache; bytes outside
// [start, end) of `pages` keep their value.
void fill_pattern_any(const KVCache& c, std::uint64_t seed, std::span<const std::uint32_t> pages,
                      std::uint64_t start, std::uint64_t end);
// fill_pattern_layers (pattern.hpp) on any cache.
void fill_pattern_layers_any(const KVCache& c, std::uint64_t seed,
                             std::span<const std::uint32_t> pages, std::uint64_t start,
                             std::uint64_t end, std::uint32_t layer_begin, std::uint32_t layer_end);
// Every byte of every layer of `pages` set to `value`, on any cache.
void fill_pages_any(const KVCache& c, std::span<const std::uint32_t> pages, std::byte value);
VerifyResult verify_pattern_any(const KVCache& c, std::uint64_t seed,
                                std::span<const std::uint32_t> pages, std::uint64_t start,
                                std::uint64_t end);

// Bytes of `local` outside the destination spans of `reads` (planned
// against `remote`) that no longer hold `sentinel`; with no reads, every
// byte that does not.
std::uint64_t bytes_written_outside(const KVCache& local, const KVLayout& remote,
                                    std::span<const KVReadInfo> reads, std::byte sentinel);

// The device side, defined by cache_probe_cuda.cpp (or, without the
// cuda_ipc engine, cache_probe_nocuda.cpp): whole-cache copies and memset.
void device_to_host(const KVCache& dev, std::byte* out);
void host_to_device(const std::byte* in, const KVCache& dev);
void device_memset(const KVCache& dev, std::byte value);

}  // namespace mstar::kv::testing
