// Copyright mstar-kv authors.
#include "soak_prefill.hpp"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <random>

#include "layout_args.hpp"
#include "mstar/kv/kv.hpp"
#include "mstar/kv/testing/pattern.hpp"
#include "soak_shared.hpp"
#include "toolkit/seq_line.hpp"

namespace mstar::kv::cli {

void serve_prefill_with_churn(KVCachePool& pool, const KVCache& cache,
                              std::vector<std::uint64_t> live, const PrefillChurn& cfg,
                              const std::function<std::uint64_t(std::uint64_t)>& seed_of,
                              const std::function<void(const SequenceInfo&)>& published) {
  std::mt19937_64 rng(cfg.gen * 104729 + 3);
  std::exponential_distribution<double> next(
      cfg.reuse.count() > 0 ? 1.0 / static_cast<double>(cfg.reuse.count()) : 1.0);
  std::uint64_t n = cfg.first_free_id;
  auto add_one = [&] {
    const std::uint64_t seq_id = cfg.gen * 1000 + n++;
    const std::uint64_t tokens =
        std::uniform_int_distribution<std::uint64_t>(1, cfg.max_tokens)(rng);
    const auto pages = pool.allocate(seq_id, tokens);
    fill_pattern(cache, seed_of(seq_id), pages, 0, tokens);
    published(pool.publish(seq_id));
    live.push_back(seq_id);
  };
  auto wait_ms = [&] {
    return cfg.reuse.count() > 0 ? std::max(1, static_cast<int>(next(rng))) : 50;
  };
  for (;;) {
    pollfd pfd{STDIN_FILENO, POLLIN, 0};
    const int r = ::poll(&pfd, 1, wait_ms());
    if (r > 0) {
      char buf[64];
      if (::read(STDIN_FILENO, buf, sizeof buf) <= 0) return;  // stdin closed: stop
    }
    // Leases that expired freed their sequences: replace them.
    pool.expire_leases();
    const std::size_t before = live.size();
    std::erase_if(live, [&](std::uint64_t id) { return !pool.contains(id); });
    for (std::size_t i = live.size(); i < before; ++i) add_one();
    if (cfg.reuse.count() > 0 && !live.empty()) {
      const std::size_t i = rng() % live.size();
      pool.release(live[i]);
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      add_one();  // LIFO free list: it gets the pages just freed
    }
  }
}

std::vector<std::string> layout_flags(const KVLayout& l) {
  return {"--layers",      std::to_string(l.num_layers),
          "--kv-heads",    std::to_string(l.num_kv_heads),
          "--head-dim",    std::to_string(l.head_dim),
          "--dtype",       std::string(to_string(l.dtype)),
          "--page-size",   std::to_string(l.page_size),
          "--pages",       std::to_string(l.num_pages),
          "--cache-order", std::string(to_string(l.cache_order)),
          "--page-order",  std::string(to_string(l.page_order))};
}

// The soak's default geometry is small (4 layers, 2 heads x 64) so that many
// requests fit in a short run; the layout flags override it.
KVLayout soak_layout(const Args& args, std::uint32_t pages) {
  KVLayout l = layout_from_args(args, pages);
  if (!args.has("model")) {
    l.num_layers = static_cast<std::uint32_t>(args.u64("layers", 4));
    l.num_kv_heads = static_cast<std::uint32_t>(args.u64("kv-heads", 2));
    l.head_dim = static_cast<std::uint32_t>(args.u64("head-dim", 64));
  }
  l.validate();
  return l;
}

// Publishes `sequences` sequences filled with their pattern, one
// "SEQ <hex>" line each, then "READY", and serves until stdin closes.
int run_soak_prefill(const Args& args) {
  const std::string engine = args.str("engine", "shm");
  const std::uint64_t gen = args.u64("gen", 1);
  const std::uint64_t sequences = args.u64("sequences", 6);
  const std::uint64_t max_tokens = args.u64("max-tokens", 256);
  const KVLayout l = soak_layout(args, 256);
  auto cache = make_kv_cache(l, engine_traits(engine).memory);
  EngineOptions o;
  o.timeout = std::chrono::milliseconds(args.u64("timeout-ms", 2000));
  KVTransferManager m(TransferEngineInfo{"soak-prefill-" + std::to_string(gen), "", engine, o},
                      cache);
  KVCachePool pool(cache, m.get_kv_transfer_info(), gen,
                   std::chrono::milliseconds(args.u64("lease-ms", 1000)));
  std::mt19937_64 rng(gen * 7919);
  std::vector<std::uint64_t> live;
  for (std::uint64_t i = 0; i < sequences; ++i) {
    const std::uint64_t seq_id = gen * 1000 + i;
    const std::uint64_t tokens = std::uniform_int_distribution<std::uint64_t>(1, max_tokens)(rng);
    const auto pages = pool.allocate(seq_id, tokens);
    fill_pattern(*cache, soak::pattern_seed(seq_id), pages, 0, tokens);
    std::printf("%s\n", toolkit::seq_line(pool.publish(seq_id)).c_str());
    live.push_back(seq_id);
  }
  std::printf("READY\n");
  std::fflush(stdout);
  PrefillChurn churn;
  churn.reuse = std::chrono::milliseconds(args.u64("reuse-ms", 50));
  churn.gen = gen;
  churn.max_tokens = max_tokens;
  churn.first_free_id = sequences;
  serve_prefill_with_churn(pool, *cache, std::move(live), churn, soak::pattern_seed,
                           [](const SequenceInfo& s) {
                             std::printf("%s\n", toolkit::seq_line(s).c_str());
                             std::fflush(stdout);
                           });
  m.cleanup();
  return 0;
}

}  // namespace mstar::kv::cli
