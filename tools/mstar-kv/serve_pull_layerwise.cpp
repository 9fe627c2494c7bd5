// Copyright mstar-kv authors.
#include "serve_pull_layerwise.hpp"

#include <cstdio>
#include <cstring>
#include <utility>

#include "demo_layerwise.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "serve_pull_util.hpp"

namespace mstar::kv::cli {

namespace {

using demo::now_ns;
using Clock = std::chrono::steady_clock;
constexpr std::uint8_t kPoison = 0xA5;

void poison(const KVCache& cache, std::span<const std::uint32_t> pages) {
  const KVLayout& l = cache.layout();
  for (std::uint32_t layer = 0; layer < l.num_layers; ++layer) {
    for (std::uint32_t kv = 0; kv < l.num_kv(); ++kv) {
      for (std::uint32_t p : pages) {
        const auto b = cache.block(layer, static_cast<KV>(kv), p);
        std::memset(b.data(), kPoison, b.size());
      }
    }
  }
}

}  // namespace

LayerwiseOwner::LayerwiseOwner(std::shared_ptr<KVCache> cache, KVCachePool& pool,
                               std::uint64_t tokens, double ms_per_layer)
    : cache_(std::move(cache)),
      pool_(pool),
      tokens_(tokens),
      compute_(static_cast<std::int64_t>(ms_per_layer * 1e6)),
      staging_(KVCache::create_host(cache_->layout())) {}

LayerwiseOwner::~LayerwiseOwner() {
  if (worker_.joinable()) worker_.join();
}

std::vector<std::uint8_t> LayerwiseOwner::start(std::uint64_t id, std::uint64_t seed) {
  const auto setup0 = Clock::now();
  internal::UniqueLock lk(mu_);
  if (running_) {
    throw Error(StatusCode::kUnavailable,
                "a prefill of sequence " + std::to_string(*last_) + " is running");
  }
  if (worker_.joinable()) worker_.join();  // it ended: running_ is false
  // A new epoch for the sequence, so that a reader of the previous prefill
  // is refused rather than served this one's bytes.
  if (pool_.contains(id)) pool_.release(id);
  const std::vector<std::uint32_t> pages = pool_.allocate(id, tokens_);
  fill_pattern(*staging_, seed, pages, 0, tokens_);
  poison(*cache_, pages);  // what a reader that reads too early would get
  const std::vector<std::uint8_t> info = pool_.publish(id, 0).encode();
  running_ = true;
  last_ = id;
  result_.clear();
  error_.clear();
  const auto setup_ns =
      std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - setup0).count();
  worker_ = std::thread([this, id, pages, setup_ns] {
    std::string result, error;
    try {
      const demo::PrefillTiming t =
          demo::prefill_layers(*cache_, *staging_, pool_, id, pages, compute_);
      result = "{\"seq_id\":" + std::to_string(id) +
               ",\"layers\":" + std::to_string(cache_->layout().num_layers) +
               ",\"setup_ns\":" + std::to_string(setup_ns) +
               ",\"compute_ns\":" + std::to_string(t.compute_end_ns - t.t0_ns) +
               ",\"mark_ns\":" + std::to_string(static_cast<std::int64_t>(t.mark_us * 1e3)) +
               ",\"marks\":" + std::to_string(t.marks) + "}\n";
    } catch (const std::exception& e) {
      error = "prefill of sequence " + std::to_string(id) + " failed: " + e.what();
    }
    std::lock_guard<std::mutex> g(mu_);
    result_ = std::move(result);
    error_ = std::move(error);
    running_ = false;
    cv_.notify_all();
  });
  return info;
}

bool LayerwiseOwner::running(std::uint64_t id) const {
  std::lock_guard<std::mutex> lk(mu_);
  return running_ && last_ == id;
}

std::optional<std::string> LayerwiseOwner::wait(std::uint64_t id,
                                                std::chrono::milliseconds timeout) {
  internal::UniqueLock lk(mu_);
  if (last_ != id) {
    throw Error(StatusCode::kNotFound,
                "no prefill of sequence " + std::to_string(id) + " was started");
  }
  if (!cv_.wait_for(lk, timeout, [&] {
        MSTAR_KV_ASSERT_HELD(mu_);  // the condition runs under the lock
        return !running_ || last_ != id;
      })) {
    return std::nullopt;
  }
  if (last_ != id) {
    throw Error(StatusCode::kNotFound,
                "a prefill of another sequence replaced that of " + std::to_string(id));
  }
  if (!error_.empty()) throw Error(StatusCode::kInternal, error_);
  return result_;
}

HttpResponse LayerwiseOwner::route(const HttpRequest& req, std::uint64_t id, std::uint64_t seed) {
  HttpResponse r;
  auto fail = [&r](int status, const std::string& why) {
    r.status = status;
    r.body = why + "\n";
    return r;
  };
  std::optional<std::string> timing;
  try {
    if (req.method == "POST") {
      const auto info = start(id, seed);
      r.content_type = "application/octet-stream";
      r.body.assign(info.begin(), info.end());
      return r;
    }
    if (req.method != "GET") {
      r.headers.emplace_back("Allow", "GET, POST");
      return fail(405, "method not allowed; use GET, POST");
    }
    timing = wait(id, std::chrono::seconds(60));
  } catch (const Error& e) {
    return fail(e.code() == StatusCode::kUnavailable ? 409
                : e.code() == StatusCode::kNotFound  ? 404
                                                     : 500,
                e.what());
  }
  if (!timing)
    return fail(503, "the prefill of sequence " + std::to_string(id) + " did not end in 60 s");
  r.content_type = "application/json";
  r.body = std::move(*timing);
  return r;
}

void run_pull_layerwise(const LayerwisePull& p) {
  const KVLayout& layout = p.cache->layout();
  demo::LayerwiseSamples samples;
  std::uint64_t moved = 0;
  double mark_ns = 0, marks = 0;
  for (std::uint32_t r = 0; r < 2 * p.rounds; ++r) {
    std::memset(p.cache->base(), 0, p.cache->size_bytes());  // outside the clock
    const bool stream = demo::streaming_round(r);
    const std::int64_t sent = now_ns();
    const std::string bytes = p.call("POST", p.base + "/prefill");
    const SequenceInfo seq = SequenceInfo::decode(std::span<const std::uint8_t>(
        reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()));
    std::string timing;
    std::int64_t ready = 0;
    if (stream) {
      auto s = p.manager->start_streaming_retrieve(0, seq.num_tokens, p.local, seq.page_indices,
                                                   seq.kv_transfer_info);
      moved = s ? s->future().get() : 0;
    } else {
      timing = p.call("GET", p.base + "/prefill");
      ready = now_ns();
      auto f = p.manager->start_async_retrieve(0, seq.num_tokens, p.local, seq.page_indices,
                                               seq.kv_transfer_info);
      moved = f ? f->get() : 0;
    }
    const std::int64_t done = now_ns();
    if (stream) timing = p.call("GET", p.base + "/prefill");
    const std::int64_t t0 = sent + static_cast<std::int64_t>(json_u64(timing, "setup_ns"));
    const double compute = static_cast<double>(json_u64(timing, "compute_ns")) / 1e6;
    mark_ns += static_cast<double>(json_u64(timing, "mark_ns"));
    marks += static_cast<double>(json_u64(timing, "marks"));
    const double end = static_cast<double>(done - t0) / 1e6;
    if (stream) {
      samples.add_stream(end, compute);
    } else {
      samples.add_pull(end, compute, static_cast<double>(done - ready) / 1e6);
    }
    const VerifyResult v = verify_pattern(*p.cache, p.seed, p.local, 0, seq.num_tokens);
    if (!v.ok()) {
      throw Error(StatusCode::kInternal,
                  std::string(stream ? "streamed" : "pulled") + " round " + std::to_string(r + 1) +
                      ": " + std::to_string(v.mismatched_blocks) + " of " +
                      std::to_string(v.blocks_checked) +
                      " blocks differ from the pattern; first: " + v.first_mismatch);
    }
    std::printf(
        "  round %u %-9s all KV at decode %8.2f ms after prefill start (compute "
        "%.2f ms), verified %llu blocks\n",
        r + 1, stream ? "streamed:" : "pulled:", end, compute,
        static_cast<unsigned long long>(v.blocks_checked));
    std::fflush(stdout);
  }
  std::printf(
      "layer-wise: %.1f MiB per request, %u layers, medians of %u rounds each "
      "(alternating); owner's mark_layers_ready %.3f us per layer (mean of %.0f)\n",
      static_cast<double>(moved) / 1048576.0, layout.num_layers, p.rounds,
      marks > 0 ? mark_ns / marks / 1e3 : 0.0, marks);
  demo::print_layerwise_report(samples, layout.num_layers);
}

}  // namespace mstar::kv::cli
