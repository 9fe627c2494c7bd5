// Copyright mstar-kv authors.
//
// MooncakeBackend: the RMA backend (rma/rma_backend.hpp) over Mooncake's
// transfer engine C API. Private to the Mooncake engine; the behaviour users
// see is documented in include/mstar/kv/engines/mooncake.hpp.
//
// Progress model: post_reads() splits the reads into requests of at most
// kMaxRequestBytes and queues them as one batch; it never calls Mooncake.
// One progress thread per backend allocates each batch's Mooncake batch,
// submits its READ requests while the peer has fewer than window_ requests
// in Mooncake's hands (Mooncake's TCP transport fails requests beyond its
// per-peer queue, MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, default 1024), polls
// getTransferStatus (from the first unfinished task; 20 us between rounds
// while requests finish, backing off to 1 ms while nothing moves, so that a
// busy poll never takes a core from Mooncake's own threads) and runs a
// batch's completion once every
// submitted task was seen COMPLETED or FAILED, right after freeBatchID.
// After a failure or an abort no further request of that batch is submitted.
// A batch whose abort() was requested keeps being polled; if it is still
// unfinished abort_grace later, the backend goes dead: with its own engine
// the progress thread destroys Mooncake's engine (the only way to stop its
// sockets writing into our pages) and fails every batch in flight; with a
// shared handle (the application's engine, never destroyed here) it only
// refuses new work and keeps polling until Mooncake reports every task
// final, so completions still run only once nothing can land.
//
// Files: mooncake_backend.cpp (construction, teardown, the progress thread),
// mooncake_connect.cpp (the identity page, connecting, peers).
//
// Locks: api_mu_ (shared for every Mooncake call, exclusive to destroy
// Mooncake's engine or to drop a shared handle) is never taken while holding
// mu_; completions run with no lock held.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "mooncake_api.hpp"
#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/engines/mooncake.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "rma/rma_backend.hpp"

namespace mstar::kv::mooncake {

// The identity page: every backend registers one page holding its own
// descriptor, so that a reader can check a descriptor against what the owner
// serves now. Layout: u64 magic | u32 length | RmaRegionInfo payload |
// u32 CRC-32C of everything before it; zero-padded to kIdentityBytes.
inline constexpr std::size_t kIdentityBytes = 4096;
// Largest single READ request: Mooncake's TCP transport carries one request
// on one of its (4) connections per peer, so large spans are cut to share
// them.
inline constexpr std::uint64_t kMaxRequestBytes = 1u << 20;
inline constexpr std::uint64_t kIdentityMagic = 0x4449434d564b534dull;  // "MSKVMCID"

// backend_blob of a Mooncake RmaRegionInfo: u16 version (3) | u64
// identity_ptr | u64 epochs_ptr (the owner's registered page epoch table,
// epochs.hpp: layout.num_pages 8-byte words) | u64 ready_ptr (its
// registered layer readiness words, readiness.hpp: 4 bytes a page).
struct MooncakeBlob {
  std::uint64_t identity_ptr = 0;
  std::uint64_t epochs_ptr = 0;
  std::uint64_t ready_ptr = 0;
};
std::vector<std::uint8_t> encode_blob(const MooncakeBlob& blob);
// Untrusted: throws Error(kCorruptDescriptor) naming the field.
MooncakeBlob decode_blob(std::span<const std::uint8_t> blob);

// A zeroed, page-aligned kIdentityBytes page, or `bytes` rounded up to
// whole pages (throws kInternal when out of memory).
using PagePtr = std::unique_ptr<std::byte, void (*)(void*)>;
PagePtr alloc_page(std::size_t bytes = kIdentityBytes);
// The identity page content of `region` (throws kInvalidArgument when it does
// not fit).
void write_identity(std::byte* page, const rma::RmaRegionInfo& region);
// The region an identity page holds (untrusted bytes); throws
// Error(kPermissionDenied) naming `where` when it holds none.
rma::RmaRegionInfo read_identity(std::span<const std::uint8_t> page, const std::string& where);
std::string hex(std::uint64_t v);

class MooncakeBackend final : public rma::RmaBackend {
 public:
  // Loads the library, creates and configures Mooncake's engine (or, when
  // `shared_engine` is not null, borrows that application's engine: see
  // mooncake.hpp) and registers the cache and the identity page. With a
  // shared handle my_session_id is the published session id, empty for
  // getLocalIpAndPort. Throws Error (see MooncakeKVTransferEngine's
  // constructors); nothing is left behind then.
  MooncakeBackend(std::shared_ptr<KVCache> cache, const MooncakeOptions& options,
                  const std::string& entity_id, const std::string& my_session_id,
                  McEngine shared_engine = nullptr);
  ~MooncakeBackend() override;

  MooncakeBackend(const MooncakeBackend&) = delete;
  MooncakeBackend& operator=(const MooncakeBackend&) = delete;

  std::string_view engine_name() const noexcept override { return "mooncake"; }
  rma::RmaRegionInfo local_region() const override { return region_; }
  std::shared_ptr<rma::RmaPeer> connect(const rma::RmaRegionInfo& remote,
                                        std::chrono::milliseconds timeout) override;
  void shutdown() noexcept override;

  const std::string& session_id() const noexcept { return region_.session_id; }

  // For MooncakePeer's page epoch checks and layer watches: registered,
  // zeroed scratch memory of `bytes` (whole 4 KiB pages; *data) that stays
  // registered while the handle lives,
  // or until shutdown() / the engine's tear-down, which unregister every
  // scratch page themselves and never wait for a handle (an idle layer watch
  // may hold one). A handle may outlive the backend: it then only frees the
  // page. Throws Error (kShutdown/kUnavailable when the backend is stopped
  // or dead, kInternal).
  std::shared_ptr<void> scratch(std::size_t bytes, std::byte** data);

  // For MooncakePeer: submits `reads` (offsets from the peer's `remote_base`
  // and from `local_base`) as one batch. `peer_failed` is set when a request
  // fails; `keepalive` lives until the completion has run.
  std::shared_ptr<rma::RmaOperation> post(McSegmentId segment, const std::string& peer_name,
                                          std::uint64_t remote_base, std::byte* local_base,
                                          std::span<const rma::RmaRead> reads,
                                          rma::RmaCompletion done,
                                          std::shared_ptr<std::atomic<bool>> peer_failed,
                                          std::shared_ptr<void> keepalive);
  bool dead() const noexcept { return dead_.load(std::memory_order_acquire); }

 private:
  struct Batch;
  class Scratch;           // one registered scratch page
  struct ScratchRegistry;  // every registered scratch page; shared with them

  void progress_loop();
  // Both: caller holds api_mu_ shared and engine_ is live; progress thread
  // only. `outstanding` counts the peer's requests in Mooncake's hands.
  // Polls b from its first unfinished task; true if a task finished.
  bool poll(Batch& b, std::size_t& outstanding);
  // Allocates b's Mooncake batch and submits what the peer's window allows.
  bool submit_more(Batch& b, std::size_t& outstanding);
  // Own engine: destroys Mooncake's engine after `why`, failing every batch
  // in flight. Shared handle: only refuses new work (batches keep polling).
  void go_dead(const std::string& why);
  // Runs b's completion once (catching what it throws), then drops its
  // keepalive. Progress thread only, no lock held.
  void complete(Batch& b, Status status) noexcept;
  // Caller holds api_mu_ exclusively (or constructs): unregisters what is
  // registered, destroys Mooncake's engine unless shared, nulls engine_.
  void release_engine() noexcept;
  // The error of work refused by a dead or stopped backend.
  Error refusal() const;
  Error refusal_locked() const MSTAR_KV_REQUIRES(mu_);
  // Caller holds api_mu_ shared and engine_ is live: registered scratch
  // memory of `bytes`, listed in scratch_. Throws Error(kInternal).
  std::shared_ptr<Scratch> new_scratch(std::size_t bytes);
  // Caller holds api_mu_ exclusively (or constructs): unregisters every scratch page still
  // registered and stops later ones from calling Mooncake (their holders may
  // outlive this backend: they then only free their memory).
  void release_scratch() noexcept;

  // Declared first: unloaded last, after Mooncake's engine is destroyed (a
  // shared handle's library stays loaded by the application's own reference).
  std::unique_ptr<MooncakeLibrary> lib_;
  const MooncakeApi* api_ = nullptr;
  std::shared_ptr<KVCache> cache_;
  MooncakeOptions options_;
  rma::RmaRegionInfo region_;
  PagePtr identity_;
  std::shared_ptr<ScratchRegistry> scratch_;

  // Guards the four members below (readers take it shared). A
  // std::shared_mutex, which libc++ does not annotate: not checked by the
  // thread-safety build.
  mutable std::shared_mutex api_mu_;
  McEngine engine_ = nullptr;         // guarded by api_mu_; null once destroyed / dropped
  bool shared_ = false;               // engine_ is the application's: never destroyed
  bool cache_registered_ = false;     // guarded by api_mu_
  bool identity_registered_ = false;  // guarded by api_mu_
  bool epochs_registered_ = false;    // guarded by api_mu_
  bool ready_registered_ = false;     // guarded by api_mu_

  std::size_t window_ = 1024;  // requests per peer in Mooncake's hands
  std::atomic<bool> dead_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;  // a batch arrived / stopping
  std::vector<std::shared_ptr<Batch>> batches_ MSTAR_KV_GUARDED_BY(mu_);
  std::uint64_t arrivals_ MSTAR_KV_GUARDED_BY(mu_) = 0;
  bool stopping_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::string dead_reason_ MSTAR_KV_GUARDED_BY(mu_);
  std::thread progress_;
};

// The scratch memory registered with Mooncake (scratch(), connect). The
// backend and every Scratch share it, so that a Scratch that outlives the
// backend (a layer watch dropped after its engine) only frees its page.
// `engine` is the engine the pages are registered on, null once shutdown()
// unregistered them all or Mooncake's engine was destroyed; it is nulled
// under `mu` before Mooncake's engine goes, and every unregistration runs
// under `mu`, so none can reach a destroyed engine. Lock order: api_mu_
// before mu.
struct MooncakeBackend::ScratchRegistry {
  std::mutex mu;
  const MooncakeApi* api MSTAR_KV_GUARDED_BY(mu) = nullptr;
  McEngine engine MSTAR_KV_GUARDED_BY(mu) = nullptr;
  std::set<const void*> pages MSTAR_KV_GUARDED_BY(mu);
  Logger log;
};

}  // namespace mstar::kv::mooncake
