// Copyright mstar-kv authors.
#include "demo_layerwise.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "demo_proc.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"

namespace mstar::kv::cli::demo {

namespace {

using Clock = std::chrono::steady_clock;
constexpr std::uint64_t kSeed = 0x5eed0015;

std::vector<std::uint8_t> pack(std::int64_t a, std::int64_t b) {
  std::vector<std::uint8_t> v(16);
  std::memcpy(v.data(), &a, 8);
  std::memcpy(v.data() + 8, &b, 8);
  return v;
}

void unpack(const std::vector<std::uint8_t>& v, std::int64_t* a, std::int64_t* b) {
  if (v.size() != 16) {
    throw Error(StatusCode::kCorruptDescriptor,
                "timing frame of " + std::to_string(v.size()) + " bytes, expected 16");
  }
  std::memcpy(a, v.data(), 8);
  std::memcpy(b, v.data() + 8, 8);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

void require_layer_readiness(const std::string& engine) {
  const auto traits = find_engine(engine);
  if (!traits || !traits->layer_readiness) {
    throw Error(StatusCode::kUnavailable,
                "--layerwise over engine '" + engine +
                    "': it has no readiness channel from the owner (shm, ucx, cuda_ipc and "
                    "mooncake stream)");
  }
}

PrefillTiming prefill_layers(KVCache& cache, const KVCache& staging, KVCachePool& pool,
                             std::uint64_t id, std::span<const std::uint32_t> pages,
                             std::chrono::nanoseconds compute_per_layer) {
  const KVLayout& layout = cache.layout();
  PrefillTiming t;
  t.t0_ns = now_ns();
  for (std::uint32_t l = 0; l < layout.num_layers; ++l) {
    for (std::uint32_t kv = 0; kv < layout.num_kv(); ++kv) {
      for (std::uint32_t p : pages) {
        const auto dst = cache.block(l, static_cast<KV>(kv), p);
        std::memcpy(dst.data(), staging.block(l, static_cast<KV>(kv), p).data(), dst.size());
      }
    }
    std::this_thread::sleep_for(compute_per_layer);
    const auto m0 = Clock::now();
    pool.mark_layers_ready(id, l + 1);
    t.mark_us += std::chrono::duration<double, std::micro>(Clock::now() - m0).count();
    ++t.marks;
  }
  t.compute_end_ns = now_ns();
  return t;
}

void LayerwiseSamples::add_stream(double end, double compute) {
  stream_end.push_back(end);
  stream_compute.push_back(compute);
  stream_exposed.push_back(std::max(0.0, end - compute));
}

void LayerwiseSamples::add_pull(double end, double compute, double transfer) {
  pull_end.push_back(end);
  pull_compute.push_back(compute);
  pull_transfer.push_back(transfer);
}

void print_layerwise_report(const LayerwiseSamples& s, std::uint32_t num_layers) {
  // Each round against its own compute: rounds of one mode differ a little.
  std::vector<double> all_compute = s.stream_compute;
  all_compute.insert(all_compute.end(), s.pull_compute.begin(), s.pull_compute.end());
  const double compute = median(all_compute);
  const double s_end = median(s.stream_end);
  const double p_end = median(s.pull_end);
  const double transfer = median(s.pull_transfer);
  const double layer_transfer = transfer / num_layers;
  const double exposed = median(s.stream_exposed);
  const double hidden = transfer > 0 ? 1.0 - std::min(1.0, exposed / transfer) : 0.0;
  // A stream runs beside the compute: it cannot hide more of the transfer
  // than the compute lasts (a transfer longer than the compute is exposed
  // by at least the difference).
  const double bound = transfer > 0 ? std::min(1.0, compute / transfer) : 1.0;
  std::printf(
      "  prefill compute              %8.2f ms (median of all rounds; each round is "
      "compared with its own)\n",
      compute);
  std::printf(
      "  pull after prefill: all KV at decode %8.2f ms after prefill start "
      "(transfer %.2f ms = %.2f ms per layer)\n",
      p_end, transfer, layer_transfer);
  std::printf("  layer-wise streaming: all KV at decode %8.2f ms after prefill start\n", s_end);
  std::printf(
      "  hidden   %.1f%% of the transfer; streaming ends %.2f ms after compute, %s "
      "1.5 x one layer's transfer (%.2f ms)\n",
      hidden * 100, exposed, exposed <= 1.5 * layer_transfer ? "<=" : ">", 1.5 * layer_transfer);
  std::printf(
      "  bound    %.1f%%: no stream hides more than the compute it runs beside "
      "(compute / transfer)\n",
      bound * 100);
  std::printf(
      "summary: layerwise stream %.2f ms, pull-after-prefill %.2f ms, compute %.2f ms, "
      "hidden %.1f%%, exposed %.2f ms, transfer %.2f ms, bound %.1f%%\n",
      s_end, p_end, compute, hidden * 100, exposed, transfer, bound * 100);
  std::fflush(stdout);
}

// Once the decode side says 'R' (its cache and engine exist, so that the
// first round does not race its start-up), per round: publish with 0 layers
// ready, then prefill_layers. Then a timing frame (prefill start, compute
// end); the decode side acknowledges each round with 'D'.
int run_layerwise_prefill(const LayerwiseConfig& c) {
  auto cache = make_kv_cache(c.layout, c.memory);
  KVTransferManager manager(c.engine, cache);
  KVCachePool pool(cache, manager.get_kv_transfer_info(), c.scatter_seed);
  const auto compute = std::chrono::nanoseconds(static_cast<std::int64_t>(c.ms_per_layer * 1e6));
  double mark_us = 0;
  std::uint64_t marks = 0;
  auto staging = KVCache::create_host(c.layout);
  if (read_byte(c.fd, c.timeout, "decode") != 'R') {
    throw Error(StatusCode::kInternal, "unexpected byte from the decode process");
  }
  for (std::uint32_t r = 0; r < 2 * c.rounds; ++r) {
    const std::uint64_t id = 100 + r;
    const auto pages = pool.allocate(id, c.tokens);
    fill_pattern(*staging, kSeed + r, pages, 0, c.tokens);
    write_frame(c.fd, pool.publish(id, 0).encode());
    const PrefillTiming t = prefill_layers(*cache, *staging, pool, id, pages, compute);
    mark_us += t.mark_us;
    marks += t.marks;
    write_frame(c.fd, pack(t.t0_ns, t.compute_end_ns));
    if (read_byte(c.fd, c.timeout, "decode") != 'D') {
      throw Error(StatusCode::kInternal, "unexpected byte from the decode process");
    }
    pool.release(id);
  }
  std::printf(
      "[prefill] pid %d: %u rounds, %u layers each, %.3f ms compute per layer; "
      "mark_layers_ready %.3f us per layer (mean of %llu)\n",
      ::getpid(), 2 * c.rounds, c.layout.num_layers, c.ms_per_layer,
      mark_us / static_cast<double>(marks), static_cast<unsigned long long>(marks));
  std::fflush(stdout);
  manager.cleanup();
  return 0;
}

int run_layerwise_decode(const LayerwiseConfig& c) {
  auto cache = make_kv_cache(c.layout, c.memory);
  KVTransferManager manager(c.engine, cache);
  KVCachePool pool(cache, manager.get_kv_transfer_info(),
                   c.scatter_seed ? c.scatter_seed * 31 + 1 : 0);
  const auto local = pool.allocate(1, c.tokens);
  // Sentinel bytes before each round, outside its clock: the prefill starts
  // the next round only after this side's 'D'.
  std::memset(cache->base(), 0xA5, c.layout.total_bytes());
  write_byte(c.fd, 'R');  // the prefill's clock starts only now
  LayerwiseSamples samples;
  std::uint64_t bytes = 0;
  for (std::uint32_t r = 0; r < 2 * c.rounds; ++r) {
    const SequenceInfo seq = SequenceInfo::decode(read_frame(c.fd, c.timeout, "prefill"));
    std::int64_t t0 = 0, compute_end = 0, done = 0;
    if (streaming_round(r)) {
      auto s = manager.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                                seq.kv_transfer_info);
      bytes = s ? s->future().get() : 0;
      done = now_ns();
      unpack(read_frame(c.fd, c.timeout, "prefill"), &t0, &compute_end);
      samples.add_stream((done - t0) / 1e6, (compute_end - t0) / 1e6);
    } else {
      unpack(read_frame(c.fd, c.timeout, "prefill"), &t0, &compute_end);
      auto f = manager.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                            seq.kv_transfer_info);
      bytes = f ? f->get() : 0;
      done = now_ns();
      samples.add_pull((done - t0) / 1e6, (compute_end - t0) / 1e6, (done - compute_end) / 1e6);
    }
    const VerifyResult v = verify_pattern(*cache, kSeed + r, local, 0, seq.num_tokens);
    if (!v.ok()) {
      throw Error(StatusCode::kInternal, std::string(streaming_round(r) ? "streamed" : "pulled") +
                                             " round " + std::to_string(r) + ": " +
                                             v.first_mismatch);
    }
    std::memset(cache->base(), 0xA5, c.layout.total_bytes());
    write_byte(c.fd, 'D');
  }
  std::printf(
      "[decode]  pid %d: engine '%s', %s per request, %u layers, %.3f ms compute per "
      "layer, medians of %u rounds each (alternating)\n",
      ::getpid(), c.engine.transfer_engine.c_str(), (std::to_string(bytes >> 20) + " MiB").c_str(),
      c.layout.num_layers, c.ms_per_layer, c.rounds);
  print_layerwise_report(samples, c.layout.num_layers);
  manager.cleanup();
  return 0;
}

}  // namespace mstar::kv::cli::demo
