// Copyright mstar-kv authors.
//
// The CUDA IPC engine ("cuda_ipc"): the spec's CudaIpcKVTransferEngine. Same
// host, GPU memory: the reader copies device to device out of the owner's
// cache through a legacy CUDA IPC handle. This header includes no CUDA header;
// the engine is built only where the CUDA toolkit is. docs/engines/cuda_ipc.md.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"
#include "mstar/kv/core/layout.hpp"

namespace mstar::kv {

class KVCachePool;  // pool.hpp

// Memory: make_kv_cache(layout, MemoryKind::kDevice, device) makes one
// cudaMalloc for the whole cache (one IPC handle, one open per reader, one
// bounds check); wrap_device_memory / wrap_device_cache serve memory owned
// elsewhere (a PyTorch tensor). Only memory legacy CUDA IPC can share is
// accepted (cudaMalloc'd, e.g. PyTorch's default caching allocator); VMM
// allocations (cuMemCreate + cuMemMap, e.g. PyTorch's expandable_segments)
// and stream-ordered pools (cudaMallocAsync) are refused with
// Error(kInvalidArgument) saying so.
//
// Page epochs (epochs.hpp): a device cache keeps a device copy of its epoch
// table (its own allocation and IPC handle, named in the descriptor), which
// KVCachePool's stamps reach before allocate / release return. A read of a
// SequenceInfo's descriptor (epoch != 0) checks the epochs of its remote pages
// before enqueuing its copies and once they completed (kStaleDescriptor); a
// descriptor without an epoch table cannot be read with an epoch
// (kInvalidArgument).
//
// Layer readiness (readiness.hpp, streaming.hpp): the host tables (page
// epochs and readiness words) live in a sealed memfd of the owner, named in
// the descriptor, which a streaming reader on the same host maps read-only
// through /proc/<owner pid>/fd/<fd>. The owner marks a layer only once the
// kernels that wrote it completed: KVCachePool::mark_layers_ready after
// synchronising, or mark_layers_ready_after below. Where the owner has no
// tables, or lives in another pid namespace, streaming is refused
// (kUnavailable, kNotFound) and a pull of the finished request still works.
//
// Authentication is the driver's (an IPC handle opens only on the same host):
// extra["auth_token"] is accepted and ignored.

// The spec's cuda_share: the legacy IPC handle of the allocation plus the
// device it lives on. Value type.
struct CudaIpcShare {
  static constexpr std::size_t kHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)

  std::array<std::uint8_t, kHandleBytes> handle{};  // cudaIpcMemHandle_t bytes
  std::int32_t device = 0;                          // ordinal in the owner's process
  std::array<std::uint8_t, 16> device_uuid{};       // cudaDeviceProp::uuid: names
                                                    // the GPU whatever the ordinals
  std::uint64_t allocation_bytes = 0;               // size of the allocation the
                                                    // handle opens (from its base)

  bool operator==(const CudaIpcShare&) const = default;
};

// The spec's CudaIpcKVTransferInfo: what a reader needs to open the owner's
// cache. size / stride / offset describe the cache as a tensor view of the
// allocation, with PyTorch's storage semantics: size and stride in elements,
// offset in elements from the allocation's base. The view is the contiguous
// tensor of the layout's axis order, always 6-dimensional (a K|V axis of 1
// for MLA's single latent):
//   layer-major: [num_layers, num_kv, num_pages, P0, P1, head_dim]
//   page-major:  [num_pages, num_layers, num_kv, P0, P1, head_dim]
//   layer_page:  [num_layers, num_pages, num_kv, P0, P1, head_dim]
// (KVLayout::view_shape) with (P0, P1) = (page_size, num_kv_heads) for NHD pages and
// (num_kv_heads, page_size) for HND pages. Value type.
struct CudaIpcKVTransferInfo {
  static constexpr const char* kEngineName = "cuda_ipc";
  static constexpr std::size_t kViewDims = 6;

  CudaIpcShare cuda_share;
  std::vector<std::int64_t> size;
  std::vector<std::int64_t> stride;
  std::int64_t offset = 0;
  // The layout's dtype by name: "bf16" (also accepted when decoding:
  // PyTorch's "torch.bfloat16" and the like).
  std::string dtype;
  // Carried for compatibility with PyTorch-produced descriptors; a KV cache
  // never requires grad, so decode() refuses true.
  bool requires_grad = false;
  KVLayout layout;
  // Random, non-zero, chosen when the memory was allocated or wrapped; with
  // owner_pid it names one allocation of one process. A reader that sees a
  // new generation for the same (pid, GPU, layout) closes the old handle and
  // refuses the old descriptor.
  std::uint64_t generation = 0;
  std::uint32_t owner_pid = 0;
  // The owner's device page epoch table ("Page epochs" above): the legacy
  // IPC handle of its own allocation and its length in pages, which must be
  // layout.num_pages. Absent (false, zeros) in a descriptor made from a bare
  // torch cuda_share: a read naming an epoch is then refused.
  bool has_epoch_table = false;
  std::array<std::uint8_t, CudaIpcShare::kHandleBytes> epoch_handle{};
  std::uint32_t epoch_pages = 0;
  // The owner's host tables ("Layer readiness" above): its page epochs and
  // layer readiness words in a sealed memfd, open in the owner as fd
  // `host_tables_fd`, owned by uid `host_tables_uid`. Needs an epoch table;
  // absent (false, zeros) where the owner could not make them or the
  // descriptor came from a bare torch cuda_share: streaming is then refused.
  bool has_host_tables = false;
  std::uint32_t host_tables_fd = 0;
  std::uint32_t host_tables_uid = 0;

  // The contiguous view (size, stride) of `layout`, in elements.
  static std::vector<std::int64_t> view_size(const KVLayout& layout);
  static std::vector<std::int64_t> view_stride(const KVLayout& layout);

  // KVTransferInfo{engine = "cuda_ipc", payload}. Throws Error(kInvalidArgument)
  // when the info would not pass decode() (the same checks as validate()).
  KVTransferInfo encode() const;
  // Treats the bytes as untrusted: throws Error(kInvalidArgument) when
  // info.engine is not "cuda_ipc", Error(kCorruptDescriptor) naming the field
  // when the payload is truncated or oversized, the handle is not 64 bytes,
  // size/stride are not the layout's contiguous view, offset + extent falls
  // outside the allocation, requires_grad is true, dtype differs from the
  // layout's, or generation / owner_pid are 0. Needs no GPU.
  static CudaIpcKVTransferInfo decode(const KVTransferInfo& info);
  // The consistency checks of decode() on a value; throws
  // Error(kCorruptDescriptor) naming the field.
  void validate() const;

  // Byte offset of the cache from the allocation's base.
  std::uint64_t offset_bytes() const noexcept {
    return static_cast<std::uint64_t>(offset) * layout.element_size();
  }

  bool operator==(const CudaIpcKVTransferInfo&) const = default;
};

// Empty when at least one CUDA device is visible to this process; else why
// not, with the CUDA error name ("cudaGetDeviceCount: cudaErrorNoDevice ...").
// Safe from any thread.
std::string cuda_unavailable_reason();

// Wraps device memory owned by someone else, e.g. the storage of a PyTorch
// tensor: `device_ptr` must point into a cudaMalloc allocation on `device`,
// with `size_bytes` bytes from it inside that allocation. NOT owned: the
// returned memory never frees it; the caller keeps the allocation alive
// while the memory, any cache and engine over it, and any reader that opened
// its handle use it (a reader holds the handle open until it shuts down or
// sees a new generation of this process).
// Throws Error(kInvalidArgument) for a null / host / other-device pointer, a
// range outside its allocation, or memory legacy CUDA IPC cannot share (VMM
// or pool allocations, see "Memory" above); Error(kUnavailable) when no CUDA
// device or driver is usable (with the CUDA error name).
std::unique_ptr<KVMemory> wrap_device_memory(void* device_ptr, std::size_t size_bytes, int device);
// Marks layers [0, layers) of sequence seq_id ready (KVCachePool::
// mark_layers_ready) once the work enqueued so far on `cuda_stream` (a
// cudaStream_t; nullptr: the legacy default stream) has completed, through
// cudaLaunchHostFunc: returns at once, the mark runs on CUDA's callback
// thread. The pool must outlive the stream's progress to that point (it is
// held by shared_ptr until then). A mark the pool refuses there (sequence
// freed meanwhile, layers going backwards) is logged and dropped: readers
// then time out or see the sequence's pages change owner. Throws
// Error(kInternal) naming the CUDA error when the mark cannot be enqueued.
void mark_layers_ready_after(std::shared_ptr<KVCachePool> pool, std::uint64_t seq_id,
                             std::uint32_t layers, void* cuda_stream);
// A cache over wrapped memory (make_kv_cache for memory owned elsewhere).
std::shared_ptr<KVCache> wrap_device_cache(const KVLayout& layout, void* device_ptr,
                                           std::size_t size_bytes, int device);

// Reads pages of another process's device cache into this engine's device
// cache.
//
// * Two copy paths (options.extra["cuda_ipc_copy"]):
//   "kernel": a read is one launch of a copy kernel that moves every span
//   and strided span of its plan (any geometry: page sizes, head shards,
//   NHD <-> HND, every cache order), on one of the max_workers streams: its
//   span table (32 bytes a span) is written into a pinned buffer, uploaded
//   with one cudaMemcpyAsync, the kernel launched, one event recorded.
//   "memcpy": cudaMemcpyAsync device-to-device (or cudaMemcpyBatchAsync,
//   CUDA >= 13, one call per stream) spread round-robin, span by span, over
//   max_workers non-blocking streams, one event recorded per stream used;
//   strided spans are one cudaMemcpy2DAsync each (rows at the two sides'
//   pitches), never one copy per (token, head) row.
//   Either way read_batched_async only enqueues: it never waits for the GPU.
// * One completion thread (joined by shutdown) polls the events of every
//   read in flight with a short backoff (20 us doubling to 1 ms) and
//   resolves the futures; no thread blocks per copy.
// * Ordering: the copies are not ordered against other streams. The owner
//   must have finished writing the pages (synchronised its streams) before
//   publishing them, and the reader must not touch the destination pages
//   before the future resolves.
// * Remote handles are opened once per (owner pid, generation), with
//   cudaIpcMemLazyEnablePeerAccess, on this cache's device, and cached; the
//   cache's view (offset + layout bytes) is checked against what the handle
//   really maps (cuMemGetAddressRange), not only the claimed allocation size.
//   A new generation for the same (owner pid, GPU, layout) replaces the old
//   one: its handle closes (after reads in flight on it drain) and its
//   descriptor is kStaleDescriptor from then on. So one owner process may
//   export several caches (a draft and a target model's) as long as they
//   differ in GPU or layout. A dead owner's descriptor (kill(pid, 0) gives
//   ESRCH) is kNotFound. All handles close on shutdown. An owner must not
//   free an exported cache while a reader may hold it open (CUDA leaves
//   that undefined): readers close on shutdown or on seeing the new
//   generation.
// * Errors: bad arguments throw Error before anything is enqueued (engine
//   name, corrupt descriptor, incompatible layout, page / token bounds, a
//   GPU that is not visible here or cannot reach the owner's GPU). CUDA
//   runtime failures (opening the handle, enqueueing, or a copy) resolve the
//   future with the CUDA error name, e.g. "cudaErrorMapBufferObjectFailed".
// * Timeout (options.timeout) and cancel: a copy already enqueued cannot be
//   withdrawn. A read past its deadline, or cancelled, resolves with
//   kTimeout / kCancelled only once its queued copies have drained, so that
//   no byte lands after the future resolved: the deadline is honoured as
//   "resolves once the queued copies drain", normally within microseconds
//   to milliseconds of it. (A GPU that never finishes a copy never resolves
//   its read; shutdown then blocks in cudaStreamSynchronize.)
// * shutdown(): synchronises every stream, resolves reads still in flight
//   with kShutdown, closes every opened handle, destroys streams and events;
//   later reads throw Error(kShutdown). Idempotent; run by the destructor.
// Thread safety: every method is safe from any thread. The calling thread's
// current CUDA device is set to the cache's device for each call and then
// restored (restoring initialises the previous device's primary context if
// the thread had never used it, as cudaSetDevice does since CUDA 12).
class CudaIpcKVTransferEngine final : public KVTransferEngine {
 public:
  // kv_cache must be device memory from make_kv_cache(..., kDevice) or
  // wrap_device_memory; options.max_workers in [1, 64] streams;
  // options.timeout > 0. options.extra["cuda_ipc_batch"] = "0" turns the
  // cudaMemcpyBatchAsync path off (default "1": used where the runtime is
  // CUDA >= 13 and the driver accepts it, else one cudaMemcpyAsync per span;
  // a refused batch falls back for good, re-issuing its copies).
  // options.extra["cuda_ipc_copy"] = "kernel" | "memcpy" chooses the copy
  // path (above); without it, the environment's MSTAR_KV_CUDA_IPC_COPY,
  // else the build's default (CMake MSTAR_KV_CUDA_IPC_COPY_DEFAULT, "memcpy"
  // until a measurement on a GPU says otherwise); "kernel" is refused in a
  // build without the kernel (no CUDA compiler at configure time).
  // options.extra["cuda_ipc_check_owner_pid"] = "0" stops refusing
  // descriptors whose owner pid does not exist here (for owners in another
  // pid namespace, e.g. another container sharing the GPU). Any other key
  // starting with "cuda_ipc_" is refused with Error(kInvalidArgument) naming
  // the known ones (checked first); keys of other engines' prefixes and
  // shared keys are ignored. The engine shares ownership of the cache.
  // Throws Error(kInvalidArgument) for other memory or limits, Error(kUnavailable) (CUDA error
  // named) when streams or the handle cannot be made.
  explicit CudaIpcKVTransferEngine(std::shared_ptr<KVCache> kv_cache,
                                   const EngineOptions& options = {});
  // Every engine's shape (what make_engine calls): info.options as above.
  CudaIpcKVTransferEngine(std::shared_ptr<KVCache> kv_cache, const TransferEngineInfo& info);
  // The spec's CudaIpcKVTransferEngine(kv_cache, max_workers=3).
  CudaIpcKVTransferEngine(std::shared_ptr<KVCache> kv_cache, std::uint32_t max_workers);
  ~CudaIpcKVTransferEngine() override;

  CudaIpcKVTransferEngine(const CudaIpcKVTransferEngine&) = delete;
  CudaIpcKVTransferEngine& operator=(const CudaIpcKVTransferEngine&) = delete;

  // This cache's CudaIpcKVTransferInfo, encoded. Computed once.
  KVTransferInfo get_kv_transfer_info() const override;
  // The same, decoded.
  const CudaIpcKVTransferInfo& info() const noexcept;

  using KVTransferEngine::read_batched_async;
  std::string name() const override { return "cuda_ipc"; }
  // Decodes a cuda_ipc descriptor and checks its layout against the local
  // cache's; opens no IPC handle yet.
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;

  void shutdown() override;
  // Layer-wise streaming ("Layer readiness" above): a watch on the owner's
  // readiness words in its host tables. Throws as a read would, and
  // Error(kNotSupported) when the descriptor carries no host tables.
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> read_info) override;

  // Remote allocations currently open (for tests and tools).
  std::size_t open_handles() const;
  // The copy path in use: "kernel" or "memcpy" (cuda_ipc_copy above).
  std::string copy_path() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mstar::kv
