// Copyright mstar-kv authors.
//
// `mstar-kv soak`'s decode threads: each pulls random published sequences
// into its own pages through the engines under test and checks every byte
// (the rules are in cmd_soak.cpp's header comment).
#include <algorithm>
#include <cstring>
#include <random>
#include <thread>

#include "mstar/kv/testing/pattern.hpp"
#include "soak_shared.hpp"

namespace mstar::kv::cli::soak {

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

}  // namespace

void decode_thread(std::size_t t, const DecodeConfig& cfg, const KVCache& cache,
                   const KVLayout& remote_layout, std::vector<std::uint32_t> region,
                   std::map<std::string, KVTransferEngine*> engines, Shared& shared, Stats& stats,
                   const std::atomic<bool>& stop) {
  const KVLayout& l = cache.layout();
  std::mt19937_64 rng(cfg.seed * 1000003 + t);
  const Ranges mine = toolkit::page_ranges(l, region);
  std::uint64_t n = 0;
  while (!stop.load(std::memory_order_relaxed)) {
    const std::size_t slot = rng() % shared.size();
    auto pub = shared.get(slot);
    if (!pub || pub->seqs.empty()) {
      std::this_thread::sleep_for(1ms);
      continue;
    }
    const SequenceInfo& seq = pub->seqs[rng() % pub->seqs.size()];
    KVTransferEngine* engine = engines.at(pub->engine);
    std::shuffle(region.begin(), region.end(), rng);
    std::vector<std::uint32_t> lp(
        region.begin(), region.begin() + static_cast<std::ptrdiff_t>(seq.page_indices.size()));
    const std::uint64_t start = rng() % 4 == 0 ? rng() % seq.num_tokens : 0;
    const auto reads = plan_reads(l, start, seq.num_tokens, lp, seq.page_indices);
    toolkit::ReadChecker checker(cache, toolkit::allowed_ranges(l, remote_layout, reads),
                                 cfg.seed ^ (t << 40) ^ ++n, mine);
    stats.requests.fetch_add(1, std::memory_order_relaxed);
    const std::string what = "thread " + std::to_string(t) + " request " + std::to_string(n) +
                             " (" + pub->engine + ", seq " + std::to_string(seq.seq_id) + ")";

    std::optional<TransferFuture> f;
    try {
      f = engine->read_batched_async(seq.kv_transfer_info, reads);
    } catch (const Error& e) {
      stats.rejected.fetch_add(1, std::memory_order_relaxed);
      stats.failure(e.code());
      if (!checker.destination_untouched()) stats.corruption(what + ": rejected read wrote");
      continue;
    }
    if (f && cfg.after_issue) cfg.after_issue();
    if (!f || !f->wait_for(cfg.timeout + 5s)) {
      // Its pages may still be written: this thread stops using them.
      stats.hangs.fetch_add(1, std::memory_order_relaxed);
      stats.corruption(what + ": the future did not resolve within the timeout + 5 s");
      return;
    }
    const Status st = f->status();
    if (st.is_ok()) {
      const VerifyResult v =
          verify_pattern(cache, pattern_seed(seq.seq_id), lp, start, seq.num_tokens);
      if (v.ok()) {
        stats.ok.fetch_add(1, std::memory_order_relaxed);
        stats.bytes_verified.fetch_add(v.bytes_checked, std::memory_order_relaxed);
      } else {
        // Another request's KV (or garbage) reported as this one's: the bug
        // page epochs exist to prevent.
        stats.corruption(what + ": success reported but " + v.first_mismatch, true);
      }
    } else {
      stats.failed.fetch_add(1, std::memory_order_relaxed);
      stats.failure(st.code());
    }
    // Resolved: no byte after a failure's grace, none outside the spans.
    const std::string broke = checker.check(*f, 0ms, cfg.grace);
    if (!broke.empty()) stats.corruption(what + ": " + broke);
  }
}

std::unique_ptr<FaultInjectingEngine> make_decode_engine(const std::string& engine,
                                                         std::shared_ptr<KVCache> cache,
                                                         const DecodeConfig& cfg, double fault_rate,
                                                         std::uint64_t seed,
                                                         FaultInjectingEngine::KillHook kill) {
  EngineOptions o;
  o.timeout = cfg.timeout;
  FaultConfig fc;
  fc.p_delay = fault_rate * 0.25;
  fc.p_drop = fault_rate * 0.1;
  fc.p_fail_after = fault_rate * 0.2;
  fc.p_kill = fault_rate * 0.05;
  fc.p_duplicate = fault_rate * 0.2;
  fc.p_cancel = fault_rate * 0.2;
  fc.max_random_delay = std::chrono::milliseconds(20);
  fc.drop_timeout = cfg.timeout;
  fc.seed = seed;
  const KVLayout layout = cache->layout();
  auto inner = make_engine(TransferEngineInfo{"soak-decode", "", engine, o}, cache);
  return std::make_unique<FaultInjectingEngine>(std::move(inner), layout, fc, std::move(kill));
}

}  // namespace mstar::kv::cli::soak
