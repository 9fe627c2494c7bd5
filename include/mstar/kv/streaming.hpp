// Copyright mstar-kv authors.
//
// Layer-wise streaming, the reader's half: pull layer L of a sequence while
// its owner still computes layer L + 1 (the owner's half is readiness.hpp
// and KVCachePool::mark_layers_ready). docs/streaming.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "mstar/kv/core/future.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv {

namespace detail {
struct StreamState;
}

// The stream driver (one thread per KVTransferManager, started by the first
// stream, joined by cleanup()) polls each stream's LayerWatch (the engine's
// readiness channel, KVTransferEngine::watch_layers) every poll_interval
// while it waits, and issues every layer that is ready, in order, as one
// read through the engine's ordinary read_batched_async, so epochs,
// in-flight limits and the engine's timeout apply to each layer's read as to
// any read. A reader that starts late therefore pulls everything in one read.
struct StreamOptions {
  // A layer that the owner has not marked ready this long after the
  // previous one (or after the stream started, for the first) fails the
  // stream with kTimeout naming it. 0: the engine's timeout
  // (EngineOptions::timeout; 30 s for a manager around an engine built
  // elsewhere).
  std::chrono::milliseconds ready_timeout{0};
  // How often a waiting stream looks at the owner's readiness.
  std::chrono::microseconds poll_interval{20};
  // Reads (groups of ready layers) in flight at once, 1..64.
  std::uint32_t max_reads_in_flight = 4;
  // Runs on the driver thread once layer `layer` is in the local cache, in
  // layer order, before wait_for_layer(layer) returns. Must not block nor
  // throw (an exception is dropped), nor start or wait on streams.
  std::function<void(std::uint32_t layer)> on_layer;
};

// One streamed pull. Copies share one state; safe from any thread. Dropping
// every copy does not stop the stream (call cancel() first).
class LayerStream {
 public:
  LayerStream() = default;  // invalid
  bool valid() const noexcept { return state_ != nullptr; }

  // Resolves once every layer is in place (bytes of the whole pull) or with
  // the stream's error. Cancelling it cancels the stream. After it resolves
  // no byte of the stream lands in a local page.
  TransferFuture future() const;
  std::uint32_t num_layers() const noexcept;
  // Layers [0, n) are in the local cache.
  std::uint32_t layers_done() const noexcept;
  // Blocks until layer `layer` is in the local cache: OK; the stream's error
  // if it failed first (layers before it may be in place); kInProgress when
  // `timeout` passed first (the stream goes on). Throws
  // Error(kInvalidArgument) for a layer out of range.
  Status wait_for_layer(std::uint32_t layer, std::chrono::nanoseconds timeout) const;
  // Stops issuing reads and cancels those in flight; future() resolves with
  // kCancelled once nothing is in flight (or with success if every layer was
  // already in place). Returns immediately.
  void cancel() const noexcept;

 private:
  friend class LayerStreamer;  // the manager's stream driver (src/core/stream_driver.hpp)
  explicit LayerStream(std::shared_ptr<detail::StreamState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::StreamState> state_;
};

}  // namespace mstar::kv
