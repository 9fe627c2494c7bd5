// Copyright mstar-kv authors.
//
// CudaIpcKVTransferEngine::Impl: opening owners' allocations, their generations and lineages.
#include "cuda_ipc_impl.hpp"

namespace mstar::kv {

using namespace cuda_ipc_detail;

namespace {

// Opens an owner's exported allocation (`handle`, cudaIpcMemHandle_t bytes)
// on `device`; `what` names it when CUDA refuses.
void* open_ipc_handle(const std::array<std::uint8_t, CudaIpcShare::kHandleBytes>& handle,
                      int device, const std::string& what) {
  cudaIpcMemHandle_t h{};
  std::memcpy(h.reserved, handle.data(), CudaIpcShare::kHandleBytes);
  void* base = nullptr;
  cuda_ipc::DeviceGuard guard(device);
  const cudaError_t err = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    throw Error(StatusCode::kPeerFailure,
                "cudaIpcOpenMemHandle " + what + " failed: " + cuda_ipc::error_text(err));
  }
  return base;
}

}  // namespace

std::shared_ptr<RemoteMapping> CudaIpcKVTransferEngine::Impl::acquire(
    const CudaIpcKVTransferInfo& remote) {
  const std::uint32_t pid = remote.owner_pid;
  const auto key = std::make_pair(pid, remote.generation);
  std::lock_guard lk(map_mu_);
  const std::string lineage = std::to_string(pid) + " " +
                              cuda_ipc::uuid_string(remote.cuda_share.device_uuid.data()) + " " +
                              remote.layout.to_string();
  if (retired_.count(key) != 0) {
    const auto cur = current_gen_.find(lineage);
    throw Error(StatusCode::kStaleDescriptor,
                "cuda_ipc descriptor of " + gen_string(pid, remote.generation) +
                    " was replaced by a newer cache of that process on the same GPU with the "
                    "same layout" +
                    (cur != current_gen_.end()
                         ? " (generation " + std::to_string(cur->second.generation) + ")"
                         : std::string()));
  }
  // A dead owner: its memory may still be mapped here, but its pages mean
  // nothing any more. (A recycled pid passes this check; its generation
  // then differs.)
  if (check_owner_pid_ && ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) {
    for (auto it = mappings_.begin(); it != mappings_.end();) {
      it = it->first.first == pid ? mappings_.erase(it) : std::next(it);
    }
    for (auto it = current_gen_.begin(); it != current_gen_.end();) {
      it = it->second.pid == pid ? current_gen_.erase(it) : std::next(it);
    }
    throw Error(StatusCode::kNotFound, "cuda_ipc owner process " + std::to_string(pid) +
                                           " of generation " + std::to_string(remote.generation) +
                                           " is gone");
  }
  if (auto it = mappings_.find(key); it != mappings_.end()) return it->second;

  // The owner's GPU must be visible here and reachable from ours.
  const int owner_dev = cuda_ipc::device_with_uuid(remote.cuda_share.device_uuid.data());
  if (owner_dev < 0) {
    throw Error(StatusCode::kInvalidArgument,
                "cuda_ipc descriptor names GPU " +
                    cuda_ipc::uuid_string(remote.cuda_share.device_uuid.data()) + " (device " +
                    std::to_string(remote.cuda_share.device) + " of pid " + std::to_string(pid) +
                    "), which is not visible in this process (check CUDA_VISIBLE_DEVICES)");
  }
  if (owner_dev != device_) {
    int can = 0;
    const cudaError_t err = cudaDeviceCanAccessPeer(&can, device_, owner_dev);
    if (err != cudaSuccess) {
      throw Error(StatusCode::kPeerFailure,
                  "cudaDeviceCanAccessPeer: " + cuda_ipc::error_text(err));
    }
    if (can == 0) {
      throw Error(StatusCode::kInvalidArgument,
                  "cuda_ipc: device " + std::to_string(device_) + " cannot access peer device " +
                      std::to_string(owner_dev) +
                      " holding the owner's cache (no P2P between them)");
    }
  }

  void* base = open_ipc_handle(remote.cuda_share.handle, device_,
                               "for " + gen_string(pid, remote.generation));
  auto mapping = std::make_shared<RemoteMapping>(base, device_);
  if (remote.has_epoch_table) {
    void* ep = open_ipc_handle(remote.epoch_handle, device_,
                               "of the page epoch table of " + gen_string(pid, remote.generation));
    cuda_ipc::DeviceGuard guard(device_);
    mapping->set_epochs(ep);
    // Untrusted length: the table must hold epoch_pages words.
    cuda_ipc::AddressRange er;
    bool eknown = false;
    try {
      eknown = cuda_ipc::allocation_range(ep, &er);
    } catch (const Error&) {
      eknown = false;
    }
    const auto e = reinterpret_cast<std::uintptr_t>(ep);
    if (eknown &&
        (e < er.base || std::uint64_t{remote.epoch_pages} * 8 > er.size - (e - er.base))) {
      throw Error(StatusCode::kCorruptDescriptor,
                  "cuda_ipc descriptor of " + gen_string(pid, remote.generation) + " names " +
                      std::to_string(remote.epoch_pages) + " page epochs; their handle maps " +
                      std::to_string(er.size) + " bytes");
    }
  }
  // The descriptor's sizes are untrusted: check the view against what the
  // handle really maps, so that no copy can run past the mapping.
  cuda_ipc::AddressRange range;
  bool known = false;
  try {
    known = cuda_ipc::allocation_range(base, &range);
  } catch (const Error&) {
    known = false;  // the driver cannot say; the descriptor checks stand alone
  }
  const std::uint64_t view_end = remote.offset_bytes() + remote.layout.total_bytes();
  const auto b = reinterpret_cast<std::uintptr_t>(base);
  if (known &&
      (b < range.base || b - range.base > range.size || view_end > range.size - (b - range.base))) {
    throw Error(StatusCode::kCorruptDescriptor,
                "cuda_ipc descriptor of " + gen_string(pid, remote.generation) +
                    " puts the cache at bytes [" + std::to_string(remote.offset_bytes()) + ", " +
                    std::to_string(view_end) + ") of an allocation it says holds " +
                    std::to_string(remote.cuda_share.allocation_bytes) +
                    " bytes; the handle maps " + std::to_string(range.size) + " bytes");
  }
  // A new generation replaces its lineage's previous one: forget that (its
  // handle closes once reads in flight on it drain) and refuse it from now on.
  if (auto cur = current_gen_.find(lineage);
      cur != current_gen_.end() && cur->second.generation != key.second) {
    const auto old = std::make_pair(pid, cur->second.generation);
    mappings_.erase(old);
    retired_.insert(old);
    retired_order_.push_back(old);
    if (retired_order_.size() > kMaxRetired) {
      retired_.erase(retired_order_.front());
      retired_order_.erase(retired_order_.begin());
    }
  }
  current_gen_[lineage] = Current{pid, key.second};
  mappings_[key] = mapping;
  return mapping;
}

}  // namespace mstar::kv
