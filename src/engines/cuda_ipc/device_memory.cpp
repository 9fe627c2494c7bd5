// Copyright mstar-kv authors.
#include "device_memory.hpp"

#include <cstring>
#include <random>
#include <string>

#include "cuda_epochs.hpp"
#include "cuda_util.hpp"
#include "device_copier.hpp"
#include "host_tables.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace cuda_ipc {

namespace {

std::uint64_t new_generation() {
  std::random_device rd;
  std::uint64_t g = 0;
  while (g == 0) g = (std::uint64_t{rd()} << 32) ^ rd();
  return g;
}

std::string ptr_string(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}

const char* kIpcHint =
    "legacy CUDA IPC can share only cudaMalloc allocations; memory from the "
    "virtual memory management API (cuMemCreate/cuMemMap, e.g. PyTorch with "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True) or from a memory pool "
    "(cudaMallocAsync) cannot be shared this way: allocate the KV cache with "
    "cudaMalloc (PyTorch: expandable_segments:False) or use another engine";

void export_handle(void* base, CudaIpcShare* share, const char* what) {
  cudaIpcMemHandle_t h{};
  const cudaError_t err = cudaIpcGetMemHandle(&h, base);
  if (err != cudaSuccess) {
    throw Error(StatusCode::kInvalidArgument, std::string(what) + ": cudaIpcGetMemHandle(" +
                                                  ptr_string(base) +
                                                  ") failed: " + error_text(err) + "; " + kIpcHint);
  }
  static_assert(sizeof(h.reserved) == CudaIpcShare::kHandleBytes);
  std::memcpy(share->handle.data(), h.reserved, CudaIpcShare::kHandleBytes);
}

}  // namespace

std::unique_ptr<DeviceMemory> DeviceMemory::allocate(std::size_t size, int device) {
  check_device(device);
  DeviceGuard guard(device);
  std::unique_ptr<DeviceMemory> m(new DeviceMemory());
  m->size_ = size;
  m->owned_ = true;
  m->generation_ = new_generation();
  m->share_.device = device;
  m->share_.allocation_bytes = size == 0 ? 1 : size;
  device_uuid(device, m->share_.device_uuid.data());
  void* p = nullptr;
  cudaError_t err = cudaMalloc(&p, m->share_.allocation_bytes);
  if (err != cudaSuccess) {
    const StatusCode code =
        err == cudaErrorMemoryAllocation ? StatusCode::kRetryLater : StatusCode::kUnavailable;
    fail(code,
         "cudaMalloc of " + std::to_string(size) + " bytes on device " + std::to_string(device),
         err);
  }
  m->data_ = static_cast<std::byte*>(p);  // owned from here: the destructor frees
  // Zero-fill, and wait: the engine's streams are non-blocking, so they would
  // not wait for work on the default stream.
  err = cudaMemsetAsync(p, 0, m->share_.allocation_bytes, 0);
  if (err == cudaSuccess) err = cudaStreamSynchronize(0);
  if (err != cudaSuccess) fail(StatusCode::kInternal, "zero-filling device memory", err);
  export_handle(p, &m->share_, "device KV cache");
  return m;
}

std::shared_ptr<staging::Copier> DeviceMemory::staging_copier() const {
  if (!span_kernel_built()) return nullptr;
  std::lock_guard lk(copier_mu_);
  if (!copier_) copier_ = DeviceCopier::create(share_.device);
  return copier_;
}

std::unique_ptr<DeviceMemory> DeviceMemory::wrap(void* ptr, std::size_t size, int device) {
  if (ptr == nullptr) {
    throw Error(StatusCode::kInvalidArgument, "wrap_device_memory: null device pointer");
  }
  if (size == 0) {
    throw Error(StatusCode::kInvalidArgument, "wrap_device_memory: size 0 out of range [1, ...)");
  }
  check_device(device);
  DeviceGuard guard(device);
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    fail(StatusCode::kInvalidArgument, "cudaPointerGetAttributes(" + ptr_string(ptr) + ")", err);
  }
  if (attr.type != cudaMemoryTypeDevice) {
    throw Error(StatusCode::kInvalidArgument,
                "wrap_device_memory: " + ptr_string(ptr) +
                    " is not device memory (cudaMemoryType " +
                    std::to_string(static_cast<int>(attr.type)) + ", expected " +
                    std::to_string(static_cast<int>(cudaMemoryTypeDevice)) + ")");
  }
  if (attr.device != device) {
    throw Error(StatusCode::kInvalidArgument,
                "wrap_device_memory: " + ptr_string(ptr) + " lives on device " +
                    std::to_string(attr.device) + ", not device " + std::to_string(device));
  }
  if (legacy_ipc_capable(ptr) == 0) {
    throw Error(StatusCode::kInvalidArgument,
                "wrap_device_memory: " + ptr_string(ptr) +
                    " is not in an allocation legacy CUDA IPC can share "
                    "(CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE is 0); " +
                    kIpcHint);
  }
  AddressRange range;
  if (!allocation_range(ptr, &range)) {
    throw Error(StatusCode::kUnavailable,
                "wrap_device_memory: the CUDA driver does not provide cuMemGetAddressRange");
  }
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  const std::uint64_t offset = p - range.base;
  if (p < range.base || offset > range.size || size > range.size - offset) {
    throw Error(StatusCode::kInvalidArgument,
                "wrap_device_memory: [" + ptr_string(ptr) + ", +" + std::to_string(size) +
                    ") outside its allocation [" + ptr_string(reinterpret_cast<void*>(range.base)) +
                    ", +" + std::to_string(range.size) + ")");
  }
  std::unique_ptr<DeviceMemory> m(new DeviceMemory());
  m->data_ = static_cast<std::byte*>(ptr);
  m->size_ = size;
  m->owned_ = false;
  m->offset_bytes_ = offset;
  m->generation_ = new_generation();
  m->share_.device = device;
  m->share_.allocation_bytes = range.size;
  device_uuid(device, m->share_.device_uuid.data());
  export_handle(reinterpret_cast<void*>(range.base), &m->share_, "wrap_device_memory");
  return m;
}

const EpochMirror* DeviceMemory::epoch_mirror(std::uint32_t num_pages) {
  if (epochs_ && epochs_->num_pages() != num_pages) {
    throw Error(StatusCode::kInvalidArgument, "this device memory already backs a cache of " +
                                                  std::to_string(epochs_->num_pages()) +
                                                  " pages, not " + std::to_string(num_pages) +
                                                  ": one cache per memory");
  }
  if (!epochs_) {
    epochs_ = std::make_unique<DeviceEpochTable>(num_pages, share_.device);
    try {
      host_ = std::make_unique<HostTables>(num_pages, generation_);
    } catch (const Error& e) {
      host_error_ = e.status().message();
    }
  }
  return epochs_.get();
}

std::uint64_t* DeviceMemory::epoch_words(std::uint32_t num_pages) const noexcept {
  (void)num_pages;  // epoch_mirror checked it
  return host_ ? host_->epochs() : nullptr;
}

std::uint32_t* DeviceMemory::ready_words(std::uint32_t num_pages) const noexcept {
  (void)num_pages;
  return host_ ? host_->ready() : nullptr;
}

DeviceMemory::~DeviceMemory() {
  epochs_.reset();
  host_.reset();
  if (owned_ && data_ != nullptr) {
    try {
      DeviceGuard guard(share_.device);
      if (cudaFree(data_) != cudaSuccess) (void)cudaGetLastError();
    } catch (const Error&) {
      // The device is gone (driver torn down at exit): nothing left to free.
    }
  }
}

}  // namespace cuda_ipc

std::unique_ptr<KVMemory> wrap_device_memory(void* device_ptr, std::size_t size_bytes, int device) {
  return cuda_ipc::DeviceMemory::wrap(device_ptr, size_bytes, device);
}

std::shared_ptr<KVCache> wrap_device_cache(const KVLayout& layout, void* device_ptr,
                                           std::size_t size_bytes, int device) {
  layout.validate();
  return std::make_shared<KVCache>(layout, wrap_device_memory(device_ptr, size_bytes, device));
}

std::string cuda_unavailable_reason() {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) return "cudaGetDeviceCount: " + cuda_ipc::error_text(err);
  if (count <= 0) return "cudaGetDeviceCount: 0 CUDA devices visible";
  return {};
}

}  // namespace mstar::kv
