// Copyright mstar-kv authors.
//
// Transfer statistics: what every read did, per peer and in total, and the
// Prometheus text that exposes them.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mstar/kv/core/future.hpp"
#include "mstar/kv/util/status.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv {

// KVTransferManager keeps one TransferStatsRecorder for its engine and
// records every read it starts (read = one start_async_retrieve, i.e. one
// engine batch): started, succeeded or failed by StatusCode (a read refused
// before any byte moved counts as failed too), bytes moved, byte ranges after
// coalescing, and a latency histogram per phase:
//   plan      validate + plan (from the call until the engine planned)
//   post      until the last byte range was handed to the transport
//   transfer  until the future resolved
// Peers are named by the engine (TransferTiming::peer); "unknown" when it did
// not say (e.g. a read refused before its descriptor was decoded).

// Number of StatusCode values (kOk .. kLastStatusCode).
inline constexpr std::size_t kNumStatusCodes = static_cast<std::size_t>(kLastStatusCode) + 1;

// A fixed-bucket latency histogram (seconds), Prometheus style: bucket i
// counts observations <= kBounds[i] (not cumulative here; the renderer
// accumulates); the last bucket is +Inf. Value type.
struct LatencyHistogram {
  static constexpr std::array<double, 18> kBounds = {1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5,
                                                     1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
                                                     1e-2, 2.5e-2, 5e-2, 0.1,  1.0,    10.0};
  std::array<std::uint64_t, kBounds.size() + 1> buckets{};
  std::uint64_t count = 0;
  double sum_seconds = 0;

  void add(double seconds) noexcept;
  void merge(const LatencyHistogram& other) noexcept;
};

enum class Phase : std::uint8_t { kPlan = 0, kPost = 1, kTransfer = 2 };
inline constexpr std::array<const char*, 3> kPhaseNames = {"plan", "post", "transfer"};

// One read's phases in seconds, by Phase: from `called` (when the caller
// began, planning included) through the engine's stamps; stamps the engine
// did not set count from `returned` (when its read_batched_async returned).
std::array<double, 3> phase_seconds(const TransferTiming& timing,
                                    TransferTiming::Clock::time_point called,
                                    TransferTiming::Clock::time_point returned);

struct PeerStats {
  std::uint64_t reads_started = 0;
  std::uint64_t reads_succeeded = 0;
  std::array<std::uint64_t, kNumStatusCodes> reads_failed{};  // by StatusCode
  std::uint64_t bytes = 0;                                    // moved by reads that succeeded
  std::uint64_t copies = 0;                 // byte ranges after coalescing, reads that were posted
  std::array<LatencyHistogram, 3> latency;  // by Phase, reads that resolved

  std::uint64_t failed() const noexcept;
  void merge(const PeerStats& other) noexcept;
};

// The owner side: what this process served to readers of its cache.
// Engine counters (KVTransferEngine::served_stats): the ucx engine counts
// its replies; engines whose readers never reach the owner (shm, cuda_ipc
// map its memory; Mooncake's library serves them) leave them 0. Pool
// counters: the KVCachePool a manager serves done notices into
// (KVTransferManager::serve_done_notices), any engine. Value type.
struct ServedStats {
  std::uint64_t reads = 0;              // read requests answered: every reply sent
  std::uint64_t bytes = 0;              // bytes of replies whose send completed
  std::uint64_t reads_refused = 0;      // requests refused before any byte (an error reply)
  std::uint64_t replies_dropped = 0;    // replies and verdicts not sent: the reader was gone
  std::uint64_t readers_connected = 0;  // reader connections accepted
  std::uint64_t readers_gone = 0;       // reader connections closed (the reader went away)
  std::uint64_t staged_bytes = 0;       // of `bytes`, gathered into host buffers (ucx_staging)
  std::uint64_t descriptors = 0;        // pool: SequenceInfos published (KVCachePool::publish)
  std::uint64_t done_notices = 0;       // pool: done notices taken (KVCachePool::done)

  void merge(const ServedStats& other) noexcept;
};

// A snapshot. Value type.
struct TransferStats {
  std::string engine;  // the engine's name ("shm", "ucx", ...; "local")
  PeerStats total;
  std::map<std::string, PeerStats> peers;
  ServedStats served;  // the owner side (KVTransferManager::stats fills it)
};

// Thread safety: every method is safe from any thread (one mutex, held for a
// map lookup and a few additions per read).
class TransferStatsRecorder {
 public:
  explicit TransferStatsRecorder(std::string engine) : engine_(std::move(engine)) {}

  // A read the engine refused synchronously (plan_seconds until the refusal).
  void refused(const std::string& peer, StatusCode code, double plan_seconds);
  // A read the engine accepted; `returned` is when its call returned (the
  // phase stamps the engine did not set default to it). Call finished() from
  // the future's on_resolving (before its waiters wake).
  void started(const std::string& peer);
  void finished(const TransferTiming& timing, TransferTiming::Clock::time_point called,
                TransferTiming::Clock::time_point returned, const Status& status,
                std::uint64_t bytes);

  TransferStats snapshot() const;

  // Runs `issue` (plan + the engine's read_batched_async) and records the
  // read on `rec`: refused if it throws (rethrown), else started now and
  // finished when its future resolves (rec is kept alive until then).
  // Nothing is recorded when issue returns no future (nothing to read).
  static std::optional<TransferFuture> track(
      const std::shared_ptr<TransferStatsRecorder>& rec,
      const std::function<std::optional<TransferFuture>()>& issue);

 private:
  PeerStats& peer_locked(const std::string& peer) MSTAR_KV_REQUIRES(mu_);

  const std::string engine_;
  mutable std::mutex mu_;
  std::map<std::string, PeerStats> peers_ MSTAR_KV_GUARDED_BY(mu_);
};

// Prometheus text exposition format (version 0.0.4) of the snapshots, one
// family per metric with engine and peer labels:
//   mstar_kv_reads_started_total, mstar_kv_reads_succeeded_total,
//   mstar_kv_reads_failed_total{code}, mstar_kv_transferred_bytes_total,
//   mstar_kv_copies_total, mstar_kv_read_phase_seconds{phase} (histogram);
// and the owner side (ServedStats), engine label only:
//   mstar_kv_served_reads_total, mstar_kv_served_bytes_total,
//   mstar_kv_served_reads_refused_total, mstar_kv_served_replies_dropped_total,
//   mstar_kv_served_readers_connected_total, mstar_kv_served_readers_gone_total,
//   mstar_kv_served_staged_bytes_total,
//   mstar_kv_served_descriptors_total, mstar_kv_served_done_notices_total.
// `extra` is appended as is (an embedding program's own families).
std::string render_prometheus(const std::vector<TransferStats>& stats,
                              const std::string& extra = "");

}  // namespace mstar::kv
