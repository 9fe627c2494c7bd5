// Copyright mstar-kv authors.
//
// RmaKVTransferEngine: the KVTransferEngine of every remote engine, over an
// RmaBackend (rma_backend.hpp). UCX and Mooncake differ only in the backend.
//
// What it does for a read_batched_async(remote, reads):
//   1. checks the engine is running (else Error(kShutdown)) and that the
//      descriptor names this backend's engine (else kInvalidArgument);
//   2. decodes the payload as RmaRegionInfo (untrusted: kCorruptDescriptor);
//   3. plans the byte copies with plan_copies (layout compatibility, every
//      page and token range, duplicate destinations) against the local
//      layout and the descriptor's layout, or with plan_strided_copies when
//      the backend moves strided spans itself (RmaBackend::strided_reads);
//   4. takes the cached connection to the peer (session_id), connecting when
//      there is none or the cached one failed, bounded by options.timeout;
//   5. RmaPeer::verify: generation, region, remote key and layout must be
//      what the peer serves now; on a stale result from a cached
//      connection it reconnects once and verifies again;
//   6. posts the batch and returns its future.
// Steps 1-5 throw Error before any read is posted.
//
// Timeouts and cancellation: a watchdog thread (one per engine, joined by
// shutdown) aborts a batch whose options.timeout has passed (kTimeout) or
// whose future was cancelled (kCancelled, polled every few milliseconds).
// The future resolves only from the backend's completion callback, i.e. once
// no byte of the batch can land any more. A batch that failed with a peer
// scope (kPeerFailure) evicts that peer's connection from the cache, so a new
// owner at the same session_id is reached by a fresh connection.
//
// Thread safety: every method is safe from any thread. shutdown() aborts
// every in-flight batch with kShutdown, waits for their completions, then
// shuts the backend down; idempotent; run by the destructor.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/engine_options.hpp"
#include "mstar/kv/util/thread_annotations.hpp"
#include "rma_backend.hpp"

namespace mstar::kv::rma {

// A fresh nonzero generation for a registration (random, 64 bits).
std::uint64_t new_generation();

class RmaKVTransferEngine final : public KVTransferEngine {
 public:
  // `backend` is bound to `cache` already (it registered its memory).
  // options.timeout bounds every read (and every connect); options.extra is
  // the backend's business. Throws Error(kInvalidArgument) on a null
  // argument or a zero timeout.
  RmaKVTransferEngine(std::shared_ptr<KVCache> cache, std::unique_ptr<RmaBackend> backend,
                      const EngineOptions& options);
  ~RmaKVTransferEngine() override;

  RmaKVTransferEngine(const RmaKVTransferEngine&) = delete;
  RmaKVTransferEngine& operator=(const RmaKVTransferEngine&) = delete;

  // {backend engine name, local_region().encode()}.
  KVTransferInfo get_kv_transfer_info() const override;

  using KVTransferEngine::read_batched_async;
  std::string name() const override { return engine_name_; }
  // Checks the engine name, decodes the payload as RmaRegionInfo and its
  // layout against the local cache's (no contact with the owner).
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;

  void shutdown() override;
  // peer_for(remote): connects and verifies, as the first read would.
  void connect(const RemoteCache& remote) override;
  void notify_done(const RemoteCache& remote, std::uint64_t seq_id) override;
  void set_done_handler(DoneHandler handler) override;
  ServedStats served_stats() const override { return backend_->served_stats(); }
  // Validates as read_batched_async (same Errors, before any byte moves),
  // then asks the backend's peer for a watch; kUnavailable naming the engine
  // when its backend has no readiness channel.
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> read_info) override;

  // Backend access (tests, the CLI's diagnostics).
  RmaBackend& backend() noexcept { return *backend_; }

 private:
  struct InFlight;
  struct PeerSlot;

  // Throws Error(kShutdown) once shutdown() began.
  void check_running();
  // Throws Error(kInvalidArgument) for a descriptor of another engine.
  void check_engine(const KVTransferInfo& remote) const;
  std::shared_ptr<RmaPeer> peer_for(const RmaRegionInfo& remote);
  bool evict_peer(const std::string& session_id, const RmaPeer* peer);
  void on_done(std::uint64_t id, Status status);
  void watchdog();

  const std::shared_ptr<KVCache> cache_;
  const std::unique_ptr<RmaBackend> backend_;
  const std::chrono::milliseconds timeout_;
  bool check_epochs_ = true;  // EngineOptions::check_epochs
  const Logger log_;
  const std::string engine_name_;

  std::mutex shutdown_mu_;  // one shutdown() at a time
  std::mutex peers_mu_;
  std::unordered_map<std::string, std::shared_ptr<PeerSlot>> peers_ MSTAR_KV_GUARDED_BY(peers_mu_);

  std::mutex mu_;
  std::condition_variable cv_;  // in-flight set changed / stopping
  bool stopping_ MSTAR_KV_GUARDED_BY(mu_) = false;
  bool backend_down_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::uint64_t next_id_ MSTAR_KV_GUARDED_BY(mu_) = 1;
  std::map<std::uint64_t, std::shared_ptr<InFlight>> inflight_ MSTAR_KV_GUARDED_BY(mu_);
  std::thread watchdog_;
};

}  // namespace mstar::kv::rma
