// Copyright mstar-kv authors.
#include "soak_prefill.hpp"

#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <random>

#include "mstar/kv/pattern.hpp"

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

}  // namespace mstar::kv::cli
