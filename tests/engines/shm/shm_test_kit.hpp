// Copyright mstar-kv authors.
//
// What the shm engine's multi-process tests share: a reader's manager, a
// page table spread over a cache, and a descriptor forged from an owner's.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "mstar/kv/engines/shm.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::testing {

// A reader's shm manager over `cache`, reads timing out after `timeout`.
inline std::unique_ptr<KVTransferManager> shm_manager(
    std::shared_ptr<KVCache> cache,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  EngineOptions o;
  o.timeout = timeout;
  return std::make_unique<KVTransferManager>(TransferEngineInfo{"test", "", "shm", o},
                                             std::move(cache));
}

// n local pages spread over a cache of num_pages (3, 10, 17, ...).
inline std::vector<std::uint32_t> spread_pages(std::size_t n, std::uint32_t num_pages) {
  std::vector<std::uint32_t> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<std::uint32_t>((3 + i * 7) % num_pages);
  return v;
}

// Re-encodes the owner's descriptor after `edit`; decoding it is the
// reader's first check.
inline KVTransferInfo forged(const SequenceInfo& seq,
                             const std::function<void(ShmKVTransferInfo&)>& edit) {
  ShmKVTransferInfo info = ShmKVTransferInfo::decode(seq.kv_transfer_info);
  edit(info);
  KVTransferInfo out = info.encode();
  out.epoch = seq.kv_transfer_info.epoch;
  return out;
}

}  // namespace mstar::kv::testing
