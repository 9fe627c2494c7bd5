// Copyright mstar-kv authors.
//
// LayerStreamer: the stream driver KVTransferManager owns (one thread, made
// by the first stream, joined by stop()); KVTransferManager documents the
// calls (start_streaming_retrieve). Private to the library.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "mstar/kv/core/cache.hpp"
#include "mstar/kv/core/descriptor.hpp"
#include "mstar/kv/core/engine.hpp"
#include "mstar/kv/streaming.hpp"

namespace mstar::kv {

// Thread safety: every method is safe from any thread. `engine` must outlive
// the streamer.
class LayerStreamer {
 public:
  // `engine_timeout` is the default StreamOptions::ready_timeout.
  LayerStreamer(KVTransferEngine& engine, std::shared_ptr<KVCache> cache,
                std::chrono::milliseconds engine_timeout);
  ~LayerStreamer();  // stop()
  LayerStreamer(const LayerStreamer&) = delete;
  LayerStreamer& operator=(const LayerStreamer&) = delete;

  // `remote` from the engine's open_remote. `shared`, when given, is the
  // descriptor `remote` was opened from without its page_epochs: the pages
  // it names are watched and read through handles of their own epochs.
  std::optional<LayerStream> start(std::uint64_t start_len, std::uint64_t end_len,
                                   std::span<const std::uint32_t> local_page_indices,
                                   std::span<const std::uint32_t> remote_page_indices,
                                   const RemoteCache& remote, const KVTransferInfo* shared,
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
