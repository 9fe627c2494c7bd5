// Copyright mstar-kv authors.
//
// Helpers for the cuda_ipc engine tests: device availability, staging the
// pattern through host memory, and the owner process (cuda_ipc_owner), a
// real second process that exports a device cache.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/wire.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::cuda_test {

// Empty when a device is visible. Tests skip with this reason, or fail
// when MSTAR_KV_REQUIRE_GPU=1 (scripts/gpu-check sets it).
std::string no_device_reason();
bool gpu_required();

// Host copy of a device cache (whole cache).
std::shared_ptr<KVCache> download(const KVCache& device_cache);
// Writes a host cache of the same layout over the device cache.
void upload(const KVCache& host_cache, const KVCache& device_cache);
// fill_pattern on a device cache, staged through host memory; bytes outside
// [start, end) of `pages` keep their value.
void fill_device_pattern(const KVCache& device_cache, std::uint64_t seed,
                         std::span<const std::uint32_t> pages, std::uint64_t start,
                         std::uint64_t end);
VerifyResult verify_device_pattern(const KVCache& device_cache, std::uint64_t seed,
                                   std::span<const std::uint32_t> pages, std::uint64_t start,
                                   std::uint64_t end);
// Every byte of the device cache set to `value`.
void fill_device_bytes(const KVCache& device_cache, std::uint8_t value);

using testing::from_hex;
using testing::layout_arg;
using testing::parse_layout_arg;
using testing::to_hex;

struct OwnerSpec {
  KVLayout layout;
  std::uint64_t tokens = 0;
  std::uint64_t seed = 1;
  std::uint64_t scatter_seed = 7;  // 0: contiguous pages
  std::uint64_t wrap_offset = 0;   // > 0: wrap a cudaMalloc at this byte offset
};

// cuda_ipc_owner as a child process (fork + exec, device 0 unless
// CUDA_VISIBLE_DEVICES says otherwise). It allocates a device cache, fills
// one sequence with the pattern and prints its SequenceInfo. The destructor
// kills and reaps it.
class OwnerProcess {
 public:
  explicit OwnerProcess(const OwnerSpec& spec,
                        std::chrono::milliseconds timeout = std::chrono::seconds(60));
  ~OwnerProcess();
  OwnerProcess(const OwnerProcess&) = delete;
  OwnerProcess& operator=(const OwnerProcess&) = delete;

  const SequenceInfo& sequence() const { return seq_; }
  pid_t pid() const { return pid_; }
  // A new allocation (new generation) filled with `seed`; the old one stays
  // allocated (an owner must not free memory a reader may still map).
  const SequenceInfo& regenerate(std::uint64_t seed);
  // A second cache of another layout in the same process.
  const SequenceInfo& add_cache(std::uint64_t seed, const KVLayout& layout);
  // Page reuse: the owner releases the current sequence of its newest cache
  // and allocates the next sequence id on the freed pages, filled with
  // `seed`. send_reuse returns at once (the owner works while the caller
  // reads); await_sequence then waits for the new SequenceInfo.
  const SequenceInfo& reuse(std::uint64_t seed);
  void send_reuse(std::uint64_t seed);
  const SequenceInfo& await_sequence();
  void kill_now();

 private:
  SequenceInfo wait_for_sequence(std::chrono::milliseconds timeout);
  const SequenceInfo& command(const std::string& line);

  pid_t pid_ = -1;
  int to_child_ = -1;
  int from_child_ = -1;
  std::string buf_;
  SequenceInfo seq_;
};

}  // namespace mstar::kv::cuda_test
