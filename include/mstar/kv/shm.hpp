// Copyright mstar-kv authors.
//
// The same-host shared-memory engine: the CPU twin of the spec's
// CudaIpcKVTransferEngine. Two processes of one user on one host; the reader
// maps the owner's cache read-only and copies pages with a worker pool.
//
// Shared memory (make_kv_cache(layout, MemoryKind::kSharedHost)) is an
// anonymous memfd: no name in /dev/shm or anywhere else, so nothing is left
// behind when either process exits, even by kill -9. Its size is sealed (it
// can never shrink), so a reader's mapping can never fault with SIGBUS, and
// the memory stays valid for a reader as long as it is mapped, even after the
// owner died. Its first 4 KiB hold a header (magic, a random 64-bit nonce,
// size); the cache starts after it.
//
// Another process reaches the memfd through /proc/<pid>/fd/<fd>: the kernel
// lets only the same user (ptrace read access) open it, and the reader opens
// it O_RDONLY and maps it PROT_READ, so a reader can never write the owner's
// cache. A descriptor names pid, fd, uid, the owner's start time, the nonce,
// the size and the layout; one from a dead owner (kNotFound), a restarted
// owner or a freed and re-allocated cache (kStaleDescriptor), or another user
// (kPermissionDenied) is rejected before any byte moves.
//
// Authentication is the kernel's: only processes of the owner's user (with
// ptrace read access to it) can open the memfd, so extra["auth_token"] adds
// nothing here and is accepted and ignored (one EngineOptions may serve
// several engines).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>

#include "mstar/kv/cache.hpp"
#include "mstar/kv/descriptor.hpp"
#include "mstar/kv/engine.hpp"
#include "mstar/kv/layout.hpp"
#include "mstar/kv/engine_options.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

// What a reader needs to map an owner's shared cache. Value type.
struct ShmKVTransferInfo {
  static constexpr const char* kEngineName = "shm";

  std::uint32_t pid = 0;          // owner process
  std::uint32_t fd = 0;           // the memfd in the owner (/proc/<pid>/fd/<fd>)
  std::uint32_t uid = 0;          // owner's effective uid
  std::uint64_t start_time = 0;   // owner's start time (/proc/<pid>/stat field 22)
  std::uint64_t nonce = 0;        // random, chosen when the memory was allocated
  std::uint64_t size = 0;         // cache bytes (after the header page)
  KVLayout layout;

  // KVTransferInfo{engine = "shm", payload}.
  KVTransferInfo encode() const;
  // Treats the bytes as untrusted: throws Error(kInvalidArgument) when
  // info.engine is not "shm", Error(kCorruptDescriptor) naming the field when
  // the payload is truncated, oversized or out of range (pid, fd, nonce 0,
  // size smaller than layout.total_bytes(), invalid layout).
  static ShmKVTransferInfo decode(const KVTransferInfo& info);

  bool operator==(const ShmKVTransferInfo&) const = default;
};

// The bytes of a same-host owner's cache, mapped read-only from one of its
// shm descriptors: what the shm engine reads, for tools that compare with a
// memcpy over the same memory (mstar-kv demo's baseline). `data` keeps the
// mapping alive (unmapped when its last copy goes) and holds
// layout.total_bytes() bytes. map_shm_cache throws the Errors a read of that
// descriptor would (kInvalidArgument for another engine's descriptor,
// kCorruptDescriptor, kPermissionDenied, kNotFound, kStaleDescriptor).
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

  // From the engine-independent options (every engine's options parse the
  // same way: XOptions::parse(EngineOptions)). The shm engine has no
  // options of its own: any "shm_*" key in options.extra is a typo and
  // throws Error(kInvalidArgument) naming it.
  static ShmEngineOptions parse(const EngineOptions& options);
};

// Reads pages of other processes' shared caches into the local cache.
//
// * The local cache may be kSharedHost (then get_kv_transfer_info() describes
//   it, so others can read it too) or kHost (a private cache can still read
//   others; its get_kv_transfer_info() is empty, i.e. local-only to others).
//   kDevice is rejected with Error(kInvalidArgument).
// * read_batched_async(remote, reads) decodes and validates the descriptor,
//   opens the remote mapping (once per (pid, nonce), re-checked cheaply on
//   every read, dropped when the owner is gone or its generation changes),
//   plans and coalesces the copies, splits them into pieces and queues them
//   for a persistent pool of max_workers threads. It never waits for the
//   copy, except that a read of at most kInlineCopyBytes (1 MiB) is copied on
//   the calling thread (tens of microseconds, less than a hand-off to a
//   worker costs) and returns an already resolved future, and that for one
//   of at most kHelpCopyBytes (8 MiB) the calling thread copies pieces
//   beside the workers until none is left to claim (waking a worker costs
//   tens of microseconds, a good part of such a copy) and returns while they
//   finish theirs; a read of kPiecewiseReads KVReadInfo or more between
//   caches of one geometry (the plain reads of KVTransferManager) is checked
//   whole on the calling thread and planned run by run on the workers, each
//   copying the run it just planned (planning 32,768 pieces of 2 KiB was
//   10-15 % of such a read, with the workers idle until it was done); the
//   first read of a peer's cache maps it (populating its page
//   tables, about 0.1 s per GiB, for caches up to 8 GiB) on the calling
//   thread. Every check happens before the first byte moves and throws Error.
// * The timeout counts from read_batched_async, queueing included.
//   TransferEngineInfo.options.extra holds nothing for this engine: a key
//   starting with "shm_" is refused with Error(kInvalidArgument) (a typo),
//   keys of other engines' prefixes and shared keys are ignored.
// * The future completes when every byte is in place. TransferFuture::cancel()
//   and the timeout stop a read between pieces; the future then resolves
//   (kCancelled / kTimeout) only after the last piece being copied finished,
//   so no byte lands after resolution. Pages already copied hold the new
//   bytes; no page outside the read is touched.
// * If the owner dies during a read, the memory stays mapped and valid: the
//   read completes with correct bytes. The next read of that descriptor fails
//   with kNotFound.
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

  KVTransferInfo get_kv_transfer_info() const override;
  std::optional<KVLayout> remote_layout(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(
      const KVTransferInfo& remote_kv_info,
      std::span<const KVReadInfo> read_info) override;
  void shutdown() override;
  // Layer-wise streaming: a watch on the readiness words of the mapped owner
  // memory (no syscall per poll; the owner-alive check runs at most once per
  // millisecond, and only while layers are still missing: an owner that
  // died before marking them fails the stream with kNotFound).
  std::unique_ptr<LayerWatch> watch_layers(const KVTransferInfo& remote_kv_info,
                                           std::span<const KVReadInfo> read_info) override;

  // The descriptor as a struct; std::nullopt for a private (kHost) cache.
  std::optional<ShmKVTransferInfo> shm_info() const;

  // Number of remote mappings currently cached (for tests and tools).
  std::size_t cached_mappings() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mstar::kv
