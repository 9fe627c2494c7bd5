// Copyright mstar-kv authors.
//
// The shared-memory engine ("shm"): two processes of one user on one host;
// the reader maps the owner's cache read-only (a shared cache) or copies out
// of the owner's memory with process_vm_readv (a private one), with a pool of
// worker threads. The CPU twin of the spec's CudaIpcKVTransferEngine.
// docs/engines/shm.md.
#pragma once

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
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

// Shared memory (make_kv_cache(layout, MemoryKind::kSharedHost)) is an
// anonymous memfd: nothing is left behind when either process exits, even by
// kill -9. Its size is sealed, so a reader's mapping never faults with SIGBUS
// and stays valid as long as it is mapped, even after the owner died. Its
// first 4 KiB hold a header (magic, a random 64-bit nonce, size); the cache
// starts after it.
//
// A reader opens the memfd through /proc/<pid>/fd/<fd>, which the kernel
// allows only to the owner's user, O_RDONLY, and maps it PROT_READ: a reader
// can never write the owner's cache. A descriptor of a dead owner
// (kNotFound), a restarted owner or a freed and re-allocated cache
// (kStaleDescriptor), or another user (kPermissionDenied) is rejected before
// any byte moves. Authentication is the kernel's: extra["auth_token"] is
// accepted and ignored.
//
// A private cache (kHost: a tensor the application allocated, vLLM's
// per-layer tensors; one region or one per layer, cache.hpp) has no file to
// map: it is served through cross-memory attach. The owner keeps an anchor
// page (magic, a random nonce, its regions, where its page epochs and
// readiness words are); its descriptor (access kCma) names them, and a
// reader of the same user copies straight out of the owner's memory with
// process_vm_readv (one copy, up to IOV_MAX runs a call, on the same worker
// pool). The reader compares the anchor with the descriptor before any byte
// moves and re-reads its nonce with the page epochs before and after every
// copy: a restarted owner, a re-allocated cache or an engine shut down (the
// anchor goes with it) is kStaleDescriptor. The kernel allows it with ptrace
// read access (the same user, a dumpable owner, Yama's ptrace_scope 0 or the
// owner's prctl(PR_SET_PTRACER), no seccomp rule against process_vm_readv);
// where it refuses, the read fails with kPermissionDenied naming which and
// what to change. Unlike a memfd, the owner's memory dies with it: a read
// running when the owner dies fails with kNotFound.
//
// With the option map_private (ShmEngineOptions), the owner's engine
// re-backs a private cache in place, once, when it is made: the whole pages
// of each region move into one anonymous, size-sealed memfd mapped at the
// same addresses (the bytes copied first, 64 MiB at a time), so the
// application's pointers and bytes stay as they were and readers map those
// pages read-only as they map a shared cache (a memcpy, not a system call
// per batch of runs); a region's partial first and last pages, the page
// epochs and the readiness words stay private and go through cross-memory
// attach with every check above. Nothing may write the cache while its
// engine is made, and a process forked after that shares those pages with
// its parent instead of copying them.

// What a reader needs to reach an owner's cache. Value type. Two kinds
// (`access`):
//   kMemfd  a shared cache (make_kv_cache(kSharedHost)): the reader maps the
//           owner's memfd (pid, fd) read-only.
//   kCma    a private host cache (kHost: one region, or one region per
//           layer), which the reader copies out of the owner's memory with
//           process_vm_readv (cross-memory attach): the owner's anchor page
//           (nonce, regions, tables), the regions' addresses in the owner,
//           and where its page epochs and readiness words are.
struct ShmKVTransferInfo {
  static constexpr const char* kEngineName = "shm";
  enum class Access : std::uint8_t { kMemfd = 0, kCma = 1 };

  Access access = Access::kMemfd;
  std::uint32_t pid = 0;         // owner process
  std::uint32_t fd = 0;          // kMemfd: the memfd in the owner (/proc/<pid>/fd/<fd>)
  std::uint32_t uid = 0;         // owner's effective uid
  std::uint64_t start_time = 0;  // owner's start time (/proc/<pid>/stat field 22)
  std::uint64_t nonce = 0;       // random, chosen when the memory (kCma: the anchor) was made
  std::uint64_t size = 0;        // cache bytes (kMemfd: after the header page)
  KVLayout layout;
  // kCma only (all 0 / empty for kMemfd):
  std::uint64_t anchor = 0;            // the owner's anchor page (page-aligned)
  std::uint64_t epochs_addr = 0;       // layout.num_pages 8-byte page epochs
  std::uint64_t ready_addr = 0;        // layout.num_pages 4-byte readiness words
  std::uint64_t region_bytes = 0;      // bytes of each region
  std::vector<std::uint64_t> regions;  // one address, or one per layer
  // kCma with map_private: `fd` is the owner's memfd holding the regions'
  // whole pages (a 4 KiB header page naming this nonce, then each region's
  // pages in order), which the reader maps read-only.
  bool backed = false;
  // backed, and the page epoch and readiness tables are the cache's own
  // page-aligned allocations: their pages follow the regions' in the memfd,
  // so a reader checks epochs in its mapping, without a system call.
  bool backed_tables = false;

  // At most this many regions (LayoutLimits::kMaxLayers).
  static constexpr std::uint32_t kMaxRegions = LayoutLimits::kMaxLayers;

  // KVTransferInfo{engine = "shm", payload}.
  KVTransferInfo encode() const;
  // Treats the bytes as untrusted: throws Error(kInvalidArgument) when
  // info.engine is not "shm", Error(kCorruptDescriptor) naming the field when
  // the payload is truncated, oversized or out of range (pid, fd, nonce 0,
  // size smaller than layout.total_bytes(), invalid layout; kCma: a region
  // count other than 1 or one per layer of a layer-contiguous layout, or
  // beyond kMaxRegions, region bytes other than the layout's (a layer's for
  // one region per layer), null or misaligned addresses, and regions,
  // tables and anchor that overlap or run past the address space).
  static ShmKVTransferInfo decode(const KVTransferInfo& info);

  bool operator==(const ShmKVTransferInfo&) const = default;
};

// The bytes of a same-host owner's cache, mapped read-only from one of its
// shm descriptors: what the shm engine reads, for tools that compare with a
// memcpy over the same memory (mstar-kv demo's baseline). `data` keeps the
// mapping alive (unmapped when its last copy goes) and holds
// layout.total_bytes() bytes. map_shm_cache throws the Errors a read of that
// descriptor would (kInvalidArgument for another engine's descriptor or a
// private cache's (kCma: nothing to map), kCorruptDescriptor,
// kPermissionDenied, kNotFound, kStaleDescriptor).
struct ShmCacheView {
  std::shared_ptr<const std::byte> data;
  KVLayout layout;
};
ShmCacheView map_shm_cache(const KVTransferInfo& info);

struct ShmEngineOptions {
  std::uint32_t max_workers = 3;  // copy threads, 1..256
  // A read not finished after this long resolves with kTimeout (once no
  // worker is still writing its pages).
  std::chrono::milliseconds timeout{30000};
  // Page epoch checks (epochs.hpp); off only to measure what they cost.
  bool check_epochs = true;
  // A private cache (kHost) this engine serves: its whole pages re-backed
  // in place by a memfd that readers map (the class comment above).
  // extra["shm_map_private"] = "on" | "off".
  bool map_private = false;

  // From the engine-independent options (every engine's options parse the
  // same way: XOptions::parse(EngineOptions)) and options.extra's
  // "shm_map_private"; any other "shm_*" key is a typo and throws
  // Error(kInvalidArgument) naming it, as does a value other than on, off.
  static ShmEngineOptions parse(const EngineOptions& options);
};

// Reads pages of other processes' shared caches into the local cache.
//
// * The local cache may be kSharedHost (get_kv_transfer_info() describes its
//   memfd) or kHost, one region or one per layer (get_kv_transfer_info()
//   describes it for cross-memory attach); either reads others' caches of
//   either kind. kDevice is rejected with Error(kInvalidArgument).
// * open_remote decodes and validates the descriptor; read_batched_async
//   opens the remote mapping (once per (pid, nonce), re-checked cheaply on
//   every read, dropped when the owner is gone or its generation changes),
//   plans and coalesces the copies, splits them into pieces and queues them
//   for a persistent pool of max_workers threads. It never waits for the
//   copy, except that a read of at most kInlineCopyBytes (1 MiB) is copied on
//   the calling thread and returns an already resolved future, and that for
//   one of at most kHelpCopyBytes (8 MiB) the calling thread copies pieces
//   beside the workers until none is left to claim and returns while they
//   finish theirs; a read of kPiecewiseReads KVReadInfo or more between
//   caches of one geometry (the plain reads of KVTransferManager) is checked
//   whole on the calling thread and planned run by run on the workers, each
//   copying the run it just planned; the first read of a peer's cache maps it
//   (populating its page tables) on the calling thread. Every check happens
//   before the first byte moves and throws Error.
// * The timeout counts from read_batched_async, queueing included.
//   TransferEngineInfo.options.extra holds one key for this engine,
//   "shm_map_private"; any other starting with "shm_" is refused with
//   Error(kInvalidArgument) (a typo), keys of other engines' prefixes and
//   shared keys are ignored.
// * The future completes when every byte is in place. TransferFuture::cancel()
//   and the timeout stop a read between pieces; the future then resolves
//   (kCancelled / kTimeout) only after the last piece being copied finished,
//   so no byte lands after resolution. Pages already copied hold the new
//   bytes; no page outside the read is touched.
// * If the owner of a shared cache dies during a read, the memory stays
//   mapped and valid: the read completes with correct bytes. A read of a
//   private cache (cross-memory attach) running when its owner dies fails
//   with kNotFound once no worker is inside it. The next read of either
//   fails with kNotFound.
// * Layer-wise streaming (streaming.hpp): watch_layers below.
// * shutdown(): reads not yet finished resolve with kShutdown (pieces being
//   copied finish first), workers are joined, mappings unmapped; later reads
//   throw Error(kShutdown). Idempotent; the destructor calls it.
// Thread safety: every method is safe from any thread.
class ShmKVTransferEngine final : public KVTransferEngine {
 public:
  // Reads of at most this many bytes are copied on the calling thread.
  static constexpr std::uint64_t kInlineCopyBytes = 1u << 20;
  // Reads of at most this many bytes: the calling thread helps the workers.
  static constexpr std::uint64_t kHelpCopyBytes = 8u << 20;
  // Reads of at least this many KVReadInfo between caches of one geometry
  // are checked on the calling thread and planned on the workers.
  static constexpr std::size_t kPiecewiseReads = 4096;

  // Throws Error(kInvalidArgument) for a null or device cache or
  // max_workers outside [1, 256].
  ShmKVTransferEngine(std::shared_ptr<KVCache> kv_cache, ShmEngineOptions options = {});
  // Every engine's shape (what make_engine calls): the options parsed from
  // info.options (ShmEngineOptions::parse).
  ShmKVTransferEngine(std::shared_ptr<KVCache> kv_cache, const TransferEngineInfo& info);
  ~ShmKVTransferEngine() override;

  ShmKVTransferEngine(const ShmKVTransferEngine&) = delete;
  ShmKVTransferEngine& operator=(const ShmKVTransferEngine&) = delete;

  using KVTransferEngine::read_batched_async;
  std::string name() const override { return ShmKVTransferInfo::kEngineName; }
  KVTransferInfo get_kv_transfer_info() const override;
  // Decodes an shm descriptor (ShmKVTransferInfo::decode) and checks its
  // layout against the local cache's; maps nothing yet.
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;
  void shutdown() override;
  // Layer-wise streaming: a watch on the readiness words of the mapped owner
  // memory (no syscall per poll; the owner-alive check runs at most once per
  // millisecond, and only while layers are still missing: an owner that
  // died before marking them fails the stream with kNotFound).
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> read_info) override;
  // Maps the owner's memfd (or opens its cross-memory attach) and caches it
  // as the first read would; the errors of a read's open.
  void connect(const RemoteCache& remote) override;

  // The descriptor as a struct (kMemfd for a shared cache, kCma for a
  // private one).
  std::optional<ShmKVTransferInfo> shm_info() const;

  // Number of remote mappings currently cached (for tests and tools).
  std::size_t cached_mappings() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mstar::kv
