// Copyright mstar-kv authors.
//
// `mstar-kv serve --layerwise` and `mstar-kv pull --layerwise`: the two-host
// form of `demo --layerwise` (demo_layerwise.hpp). The server runs a
// prefill of a sequence on request, writing each layer, sleeping
// --prefill-ms-per-layer and marking it ready; the puller streams it
// (start_streaming_retrieve) in some rounds and pulls after the prefill
// finished in the others, alternating, and prints the same lines as the
// demo. Two more endpoints (only with --layerwise):
//   POST /v1/sequences/{id}/prefill  frees the sequence's pages, allocates
//                                    them again, fills them with poison,
//                                    publishes them with 0 layers ready and
//                                    starts the prefill; answers the
//                                    SequenceInfo bytes. 409 while another
//                                    prefill runs.
//   GET  /v1/sequences/{id}/prefill  waits (up to 60 s) for that prefill to
//                                    end; its timings as flat JSON.
// While a prefill of a sequence runs, GET /v1/sequences/{id} answers 409
// (a whole publish would declare every layer ready).
//
// Clocks: the two processes need not share one, so the puller times a round
// from the moment it sent the prefill request, less the server's setup
// before layer 0 (the pattern and the poison, reported as setup_ns); the
// request's one-way latency counts against both modes.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "http_server.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/util/thread_annotations.hpp"

namespace mstar::kv::cli {

// The server's half. Thread safety: every method is safe from any thread
// (the HTTP handlers); one prefill runs at a time, on its own thread, which
// the destructor joins (a prefill ends after num_layers x ms_per_layer).
class LayerwiseOwner {
 public:
  LayerwiseOwner(std::shared_ptr<KVCache> cache, KVCachePool& pool, std::uint64_t tokens,
                 double ms_per_layer);
  ~LayerwiseOwner();
  LayerwiseOwner(const LayerwiseOwner&) = delete;
  LayerwiseOwner& operator=(const LayerwiseOwner&) = delete;

  // Starts a prefill of `id` with the pattern of `seed` (see the POST
  // above); returns the SequenceInfo bytes. Throws Error(kUnavailable) while
  // a prefill runs.
  std::vector<std::uint8_t> start(std::uint64_t id, std::uint64_t seed);
  bool running(std::uint64_t id) const;
  // Waits up to `timeout` for the last prefill of `id` to end: its timings
  // as JSON {"seq_id", "layers", "setup_ns", "compute_ns", "mark_ns",
  // "marks"}, or std::nullopt if it did not end in time. Throws
  // Error(kNotFound) when the last prefill was not of `id`, Error(kInternal)
  // with the reason when it failed (e.g. the sequence was marked done
  // meanwhile).
  std::optional<std::string> wait(std::uint64_t id, std::chrono::milliseconds timeout);
  // The /v1/sequences/{id}/prefill endpoint (POST: start; GET: wait up to
  // 60 s) for a sequence the server holds, whose pattern seed is `seed`.
  HttpResponse route(const HttpRequest& req, std::uint64_t id, std::uint64_t seed);

 private:
  std::shared_ptr<KVCache> cache_;
  KVCachePool& pool_;
  std::uint64_t tokens_;
  std::chrono::nanoseconds compute_;
  std::shared_ptr<KVCache> staging_;  // the "model output" of the prefill
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool running_ MSTAR_KV_GUARDED_BY(mu_) = false;
  std::optional<std::uint64_t> last_ MSTAR_KV_GUARDED_BY(mu_);  // the id of the last prefill
  std::string result_ MSTAR_KV_GUARDED_BY(mu_);                 // its JSON once ended
  std::string error_ MSTAR_KV_GUARDED_BY(mu_);                  // or why it failed
  std::thread worker_;                                          // joined before the next start
};

// The puller's half: 2 x rounds prefills of the sequence at `base`
// ("/v1/sequences/{id}"), alternating streaming and pull-after-prefill,
// each verified against the pattern of `seed`; prints the rounds and
// demo::print_layerwise_report. `call(method, path)` performs one HTTP
// request and returns the body of a 200 answer (else throws).
struct LayerwisePull {
  std::function<std::string(const std::string& method, const std::string& path)> call;
  std::string base;
  std::uint64_t seed = 0;
  std::uint32_t rounds = 5;
  KVTransferManager* manager = nullptr;
  KVCache* cache = nullptr;
  std::span<const std::uint32_t> local;
};
void run_pull_layerwise(const LayerwisePull& p);

}  // namespace mstar::kv::cli
