// Copyright mstar-kv authors.
//
// DeviceMemory: the KVMemory behind every cache the cuda_ipc engine serves.
// Either one cudaMalloc allocation owned by this object (freed by the
// destructor), or a range of an allocation owned elsewhere (never freed).
// Either way the legacy IPC handle of the allocation is taken once, at
// construction, so memory IPC cannot share is refused up front.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/engines/cuda_ipc.hpp"

namespace mstar::kv::cuda_ipc {

class DeviceEpochTable;  // cuda_epochs.hpp
class HostTables;        // host_tables.hpp

class DeviceMemory final : public KVMemory {
 public:
  // Zero-filled. Throws Error(kUnavailable) without a usable device,
  // Error(kRetryLater) when the device is out of memory.
  static std::unique_ptr<DeviceMemory> allocate(std::size_t size, int device);
  // See wrap_device_memory in cuda_ipc.hpp.
  static std::unique_ptr<DeviceMemory> wrap(void* ptr, std::size_t size, int device);

  ~DeviceMemory() override;
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  std::byte* data() const noexcept override { return data_; }
  std::size_t size() const noexcept override { return size_; }
  MemoryKind kind() const noexcept override { return MemoryKind::kDevice; }

  int device() const noexcept { return share_.device; }
  // Handle, device, UUID and allocation size.
  const CudaIpcShare& share() const noexcept { return share_; }
  // Byte offset of data() from the allocation's base.
  std::uint64_t offset_bytes() const noexcept { return offset_bytes_; }
  std::uint64_t generation() const noexcept { return generation_; }
  bool owned() const noexcept { return owned_; }

  // The device copy of the cache's page epochs, made when a cache binds
  // this memory (KVCache's constructor); null before.
  // Also makes the cache's host tables (host_tables.hpp) where it can: a
  // memfd that readers map to see the owner's layer readiness. Where it
  // cannot, the cache keeps private tables and host_tables_error() says why
  // (streaming from this cache is then refused with that reason).
  const EpochMirror* epoch_mirror(std::uint32_t num_pages) override;
  const DeviceEpochTable* epoch_table() const noexcept { return epochs_.get(); }
  std::uint64_t* epoch_words(std::uint32_t num_pages) const noexcept override;
  std::uint32_t* ready_words(std::uint32_t num_pages) const noexcept override;
  const HostTables* host_tables() const noexcept { return host_.get(); }
  const std::string& host_tables_error() const noexcept { return host_error_; }
  // The copier that stages this memory (device_copier.hpp), made on first
  // use and shared; nullptr when the copy kernel is not built.
  std::shared_ptr<staging::Copier> staging_copier() const override;

 private:
  DeviceMemory() = default;

  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::uint64_t offset_bytes_ = 0;
  std::uint64_t generation_ = 0;
  bool owned_ = false;
  CudaIpcShare share_;
  std::unique_ptr<DeviceEpochTable> epochs_;
  std::unique_ptr<HostTables> host_;
  std::string host_error_;
  mutable std::mutex copier_mu_;
  mutable std::shared_ptr<staging::Copier> copier_;
};

}  // namespace mstar::kv::cuda_ipc
