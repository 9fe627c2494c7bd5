// Copyright mstar-kv authors.
//
// FaultInjectingEngine: a KVTransferEngine that wraps any other engine and
// injects faults into the batches that pass through it, for the reliability
// tests and the soak.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/core/layout.hpp"

namespace mstar::kv {

// When the kill hook is called, relative to issuing the batch.
enum class KillPoint : std::uint8_t {
  kNever = 0,
  kBeforeIssue,  // synchronously, before the inner engine sees the batch
  kAfterIssue,   // synchronously, right after the inner engine accepted it
  kAfterDelay,   // from the wrapper's thread, `kill_after` after issue
};

struct FaultConfig {
  // Fixed faults, applied to every batch (they combine).
  std::chrono::milliseconds delay{0};
  bool drop = false;
  std::optional<std::uint64_t> fail_after_bytes;
  KillPoint kill_point = KillPoint::kNever;
  std::chrono::milliseconds kill_after{0};
  bool duplicate_completion = false;
  std::optional<std::chrono::milliseconds> cancel_after;

  // How long a dropped batch takes to resolve with kTimeout: set it to the
  // inner engine's timeout so that callers see what a lost batch looks like.
  std::chrono::milliseconds drop_timeout{1000};

  // Random faults: per batch, at most one of them, each with its
  // probability (their sum should not exceed 1). Random delays, kill and
  // cancel times are uniform in [0, max_random_delay]; a random "fail after
  // N bytes" draws N uniformly in [0, batch bytes).
  double p_delay = 0;
  double p_drop = 0;
  double p_fail_after = 0;
  double p_kill = 0;
  double p_duplicate = 0;
  double p_cancel = 0;
  std::chrono::milliseconds max_random_delay{20};
  std::uint64_t seed = 1;
};

// Faults injected so far, one counter per kind (a snapshot).
struct FaultCounters {
  std::uint64_t batches = 0;  // batches seen
  std::uint64_t delayed = 0;
  std::uint64_t dropped = 0;
  std::uint64_t failed_after_bytes = 0;
  std::uint64_t kills = 0;               // kill hook calls
  std::uint64_t duplicates = 0;          // second resolutions attempted
  std::uint64_t duplicates_ignored = 0;  // ... and ignored by the future
  std::uint64_t cancels = 0;

  // Every fault injected (duplicates_ignored is an outcome, not a fault).
  std::uint64_t total() const noexcept {
    return delayed + dropped + failed_after_bytes + kills + duplicates + cancels;
  }
};

// A KVTransferEngine around another engine (LevelDB's EnvWrapper, for
// transfers).
//
// Faults, per batch (one read_batched_async call):
// * delay        the batch is issued to the inner engine `delay` later;
// * drop         the batch is never issued; its future resolves with
//                kTimeout after `drop_timeout` (futures always resolve);
// * fail after N the reads covering the first N bytes of the batch (split at
//                token granularity) are issued; once they finish the future
//                resolves with kPeerFailure. Those destination pages hold
//                bytes, which a failed read is allowed to leave; pages not
//                named in the batch are never touched;
// * kill         the test's kill hook (e.g. kill(peer, SIGKILL)) is called
//                before the batch is issued, right after, or a given time
//                after it was issued;
// * duplicate    the outer future is resolved twice, the second time with a
//                conflicting outcome; the first resolution must win;
// * cancel       the wrapper cancels the batch itself a given time after it
//                was issued (exercises the inner engine's cancellation).
// Fixed faults are set in FaultConfig; random faults are drawn per batch
// from a seeded generator with the given probabilities (at most one random
// fault per batch), so a run is reproducible for a given seed and order of
// calls.
//
// Invariants kept by the wrapper itself: the outer future resolves only
// after the inner future resolved (or when the inner read was never issued),
// so the inner engine's "no byte lands after resolution" promise carries
// over. Cancelling the outer future cancels the inner one.
//
// Differences from a bare engine, by design: the wrapper checks the local
// side of every read (layer, local page, token range) synchronously, but a
// delayed batch reaches the inner engine's own checks only when it is issued,
// so those errors surface as a failed future (with the inner engine's
// status) instead of a thrown Error.
//
// Ownership: the wrapper owns the inner engine. One internal thread runs
// timers and watches inner futures; it is joined by shutdown() and the
// destructor.
// Thread safety: every method is safe from any thread; set_config() takes
// effect for batches issued after it returns.
// Shutdown: shutdown() shuts the inner engine down, resolves every batch not
// yet issued with kShutdown, waits for issued ones to resolve (the inner
// engine resolves them) and stops the thread. Idempotent; later reads throw
// Error(kShutdown).
class FaultInjectingEngine final : public KVTransferEngine {
 public:
  // Called when a kill point is reached (e.g. to SIGKILL the peer); runs on
  // the thread that issues the batch for kBeforeIssue/kAfterIssue (the
  // caller's, or the wrapper's for a delayed batch) and on the wrapper's
  // thread for kAfterDelay and random kills. Must not call back into the
  // wrapper.
  using KillHook = std::function<void()>;

  // `local` is the layout of the inner engine's local cache (to size reads
  // for "fail after N bytes"). Throws Error(kInvalidArgument) when inner is
  // null or the layout is invalid.
  FaultInjectingEngine(std::shared_ptr<KVTransferEngine> inner, const KVLayout& local,
                       FaultConfig config = {}, KillHook kill = {});
  ~FaultInjectingEngine() override;

  FaultInjectingEngine(const FaultInjectingEngine&) = delete;
  FaultInjectingEngine& operator=(const FaultInjectingEngine&) = delete;

  using KVTransferEngine::read_batched_async;
  // The inner engine's.
  std::string name() const override;
  KVTransferInfo get_kv_transfer_info() const override;
  // The inner engine's.
  RemoteHandle open_remote(const KVTransferInfo& remote) const override;
  std::optional<TransferFuture> read_batched_async(const RemoteCache& remote,
                                                   std::span<const KVReadInfo> read_info) override;
  void shutdown() override;
  void notify_done(const RemoteCache& remote, std::uint64_t seq_id) override;
  void connect(const RemoteCache& remote) override;
  void set_done_handler(DoneHandler handler) override;
  ServedStats served_stats() const override;
  std::unique_ptr<LayerWatch> watch_layers(const RemoteCache& remote,
                                           std::span<const KVReadInfo> read_info) override;

  // Replaces the fault configuration (the random generator is reseeded when
  // the seed changes).
  void set_config(FaultConfig config);
  FaultConfig config() const;
  FaultCounters counters() const;
  // Batches whose outer future has not resolved yet.
  std::uint64_t in_flight() const;

  KVTransferEngine& inner() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mstar::kv
