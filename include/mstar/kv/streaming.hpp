// Copyright mstar-kv authors.
//
// Layer-wise streaming, the reader's half: pull layer L of a sequence while
// its owner still computes layer L + 1 (the owner's half is readiness.hpp
// and KVCachePool::mark_layers_ready).
//
//   owner (prefill)                          reader (decode)
//   pages = pool.allocate(seq, n)
//   info  = pool.publish(seq, 0)   ==bytes==> s = manager.start_streaming_retrieve(
//   for layer in 0..L-1:                            0, n, local, info.page_indices,
//     forward(layer) -> K/V in pages                info.kv_transfer_info, {})
//     pool.mark_layers_ready(seq, layer + 1)    for layer in 0..L-1:
//                                                 s.wait_for_layer(layer, t)  // vLLM's
//                                                 attention(layer)            // wait_for_layer_load
//                                               s.future().get()
//
// How it maps onto the engines' hooks: vLLM's KV connector calls
// wait_for_layer_load(layer) before each attention layer on the decode side
// and save_kv_layer(layer) after each layer on the prefill side; here they
// are LayerStream::wait_for_layer and KVCachePool::mark_layers_ready (the
// pull model: the owner only marks, the reader reads). SGLang's pipelined
// Mooncake sender groups layers; a stream issues every layer that is ready
// when it looks, as one read, so a reader that starts late degenerates into
// one pull of everything (no per-layer overhead).
//
// The stream driver (one thread per KVTransferManager, started by the first
// stream, joined by cleanup()) polls each stream's LayerWatch (shm: loads of
// readiness words in the mapped owner memory, every poll_interval while it
// waits; no syscall but a cheap owner-alive check once per millisecond; ucx:
// the last readiness notice from the owner, with one request outstanding
// that the owner answers as soon as more layers are ready) and
// issues layer by layer, in order, as soon as the owner marked them, through
// the engine's ordinary read_batched_async (so epochs, in-flight limits and
// the engine's timeout apply to each layer's read as to any read).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>

#include "mstar/kv/future.hpp"
#include "mstar/kv/status.hpp"

namespace mstar::kv {

namespace detail {
struct StreamState;
}

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
  friend class LayerStreamer;
  explicit LayerStream(std::shared_ptr<detail::StreamState> s) : state_(std::move(s)) {}
  std::shared_ptr<detail::StreamState> state_;
};

class KVCache;
class KVTransferEngine;
struct KVTransferInfo;

// The stream driver on its own, for code that holds an engine without a
// KVTransferManager (the Python bindings); KVTransferManager owns one and
// documents the calls (start_streaming_retrieve). `engine` must outlive it.
// Thread safety: every method is safe from any thread.
class LayerStreamer {
 public:
  // `engine_timeout` is the default StreamOptions::ready_timeout.
  LayerStreamer(KVTransferEngine& engine, std::shared_ptr<KVCache> cache,
                std::chrono::milliseconds engine_timeout);
  ~LayerStreamer();  // stop()
  LayerStreamer(const LayerStreamer&) = delete;
  LayerStreamer& operator=(const LayerStreamer&) = delete;

  std::optional<LayerStream> start(std::uint64_t start_len, std::uint64_t end_len,
                                   std::span<const std::uint32_t> local_page_indices,
                                   std::span<const std::uint32_t> remote_page_indices,
                                   const KVTransferInfo& kv_transfer_info,
                                   StreamOptions options = {});
  // Unfinished streams resolve with kShutdown once nothing of theirs is in
  // flight; the driver thread is joined; later start() throws
  // Error(kShutdown). Idempotent.
  void stop() noexcept;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace mstar::kv
