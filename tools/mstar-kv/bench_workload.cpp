// Copyright mstar-kv authors.
#include "bench_workload.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "layout_args.hpp"
#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cli::bench {

namespace {

constexpr std::uint64_t kRemoteSeed = 0x5eed0001;
constexpr std::uint64_t kLocalSeed = 0x5eed0002;

std::uint64_t pages_needed(const Workload& w, const KVLayout& side) {
  return (w.tokens + side.page_size - 1) / side.page_size;
}

// A page table of `side` (each side's in its own page size).
std::vector<std::uint32_t> table(const Workload& w, const KVLayout& side, std::uint64_t seed) {
  const std::uint64_t n = pages_needed(w, side);
  std::vector<std::uint32_t> t(n);
  switch (w.table) {
    case PageTable::kContiguous:
      std::iota(t.begin(), t.end(), 0u);
      break;
    case PageTable::kStride2:
      for (std::uint64_t i = 0; i < n; ++i) t[i] = static_cast<std::uint32_t>(2 * i);
      break;
    case PageTable::kScattered: {
      // Like KVCachePool with a scatter seed: a shuffled free list, so a
      // long-running engine's sequence owns pages in no particular order.
      std::vector<std::uint32_t> all(side.num_pages);
      std::iota(all.begin(), all.end(), 0u);
      std::mt19937_64 gen(seed);
      std::shuffle(all.begin(), all.end(), gen);
      std::copy_n(all.begin(), n, t.begin());
      break;
    }
  }
  return t;
}

std::string order_suffix(CacheOrder lco, CacheOrder rco, PageOrder lpo, PageOrder rpo) {
  std::string s;
  if (lco != CacheOrder::kLayerMajor || rco != CacheOrder::kLayerMajor) {
    s += "/" + std::string(to_string(lco)) + "<-" + std::string(to_string(rco));
  }
  if (lpo != PageOrder::kNHD || rpo != PageOrder::kNHD) {
    s += "/" + std::string(to_string(lpo)) + "<-" + std::string(to_string(rpo));
  }
  return s;
}

}  // namespace

const char* to_string(PageTable t) noexcept {
  switch (t) {
    case PageTable::kContiguous:
      return "contiguous";
    case PageTable::kScattered:
      return "scattered";
    case PageTable::kStride2:
      return "stride2";
  }
  return "?";
}

std::uint64_t Workload::bytes_per_request() const {
  return (tokens - start_len) * local.token_bytes() * local.num_kv() * local.num_layers;
}

std::vector<std::uint32_t> remote_page_table(const Workload& w) {
  return table(w, w.remote, kRemoteSeed);
}
std::vector<std::uint32_t> local_page_table(const Workload& w) {
  return table(w, w.local, kLocalSeed);
}

bool Workload::mixed_geometry() const {
  return !local.same_geometry(remote) || local.page_order != remote.page_order;
}

Workload plain_twin(const Workload& w) {
  Workload t = w;
  t.remote = w.local;
  t.name = w.name + "/plain";
  return t;
}

void set_geometry(Workload& w, const Geometry& g) {
  w.name += apply_geometry(w.local, w.remote, g, w.tokens);
  w.piece_bytes = w.local.block_bytes();
}

Workload model_workload(const std::string& model, std::uint32_t page_size, std::uint64_t tokens,
                        PageTable table_kind, double prefix_hit, CacheOrder local_co,
                        CacheOrder remote_co, PageOrder local_po, PageOrder remote_po) {
  const ModelPreset& p = find_preset(model);
  if (tokens == 0) throw Error(StatusCode::kInvalidArgument, "bench: --tokens must be > 0");
  if (!(prefix_hit >= 0.0 && prefix_hit < 1.0)) {
    throw Error(StatusCode::kInvalidArgument,
                "bench: prefix hit fraction " + std::to_string(prefix_hit) + " outside [0, 1)");
  }
  Workload w;
  w.group = "model";
  w.model = model;
  w.tokens = tokens;
  w.start_len = static_cast<std::uint64_t>(std::floor(static_cast<double>(tokens) * prefix_hit));
  w.table = table_kind;
  KVLayout l;
  l.num_layers = p.num_layers;
  l.num_kv_heads = p.num_kv_heads;
  l.head_dim = p.head_dim;
  l.has_v = p.has_v;
  l.dtype = DType::kBFloat16;
  l.page_size = page_size;
  const std::uint64_t needed = (tokens + page_size - 1) / page_size;
  l.num_pages = static_cast<std::uint32_t>(needed);
  w.local = l;
  w.remote = l;
  w.local.cache_order = local_co;
  w.remote.cache_order = remote_co;
  w.local.page_order = local_po;
  w.remote.page_order = remote_po;
  w.local.validate();
  w.remote.validate();
  w.name = model + "/p" + std::to_string(page_size) + "/t" + std::to_string(tokens) + "/" +
           to_string(table_kind);
  if (w.start_len > 0) {
    w.name += "/hit" + std::to_string(static_cast<int>(std::lround(prefix_hit * 100)));
  }
  w.name += order_suffix(local_co, remote_co, local_po, remote_po);
  w.piece_bytes = l.block_bytes();
  return w;
}

Workload raw_workload(std::uint64_t piece_bytes, std::uint32_t batch, const std::string& group) {
  if (piece_bytes < 4096 || piece_bytes % 4096 != 0 || piece_bytes > (64u << 20)) {
    throw Error(StatusCode::kInvalidArgument, "bench: piece size " + std::to_string(piece_bytes) +
                                                  " must be a multiple of 4096 in [4096, 64 MiB]");
  }
  if (batch == 0 || batch > (1u << 20)) {
    throw Error(StatusCode::kInvalidArgument,
                "bench: batch " + std::to_string(batch) + " outside [1, 1048576]");
  }
  Workload w;
  w.group = group;
  w.model = "raw";
  w.table = PageTable::kStride2;
  w.piece_bytes = piece_bytes;
  w.batch = batch;
  KVLayout l;
  l.num_layers = 1;
  l.has_v = false;
  l.page_size = 16;
  l.head_dim = 128;
  l.dtype = DType::kBFloat16;
  l.num_kv_heads = static_cast<std::uint32_t>(piece_bytes / 4096);
  l.num_pages = 2 * batch;
  l.validate();
  w.local = l;
  w.remote = l;
  w.tokens = std::uint64_t{batch} * l.page_size;
  auto size_name = [](std::uint64_t b) {
    return b >= (1u << 20) ? std::to_string(b >> 20) + "MiB" : std::to_string(b >> 10) + "KiB";
  };
  w.name = "raw/" + size_name(piece_bytes) + "/b" + std::to_string(batch);
  return w;
}

std::vector<Workload> suite(const std::string& name) {
  using CO = CacheOrder;
  using PO = PageOrder;
  constexpr auto S = PageTable::kScattered;
  constexpr auto C = PageTable::kContiguous;
  std::vector<Workload> out;
  // Raw sweeps keep one request at or below 64 MiB.
  auto piece_sweep = [&](std::uint32_t batch, std::vector<std::uint64_t> sizes) {
    for (std::uint64_t s : sizes) {
      const auto b = static_cast<std::uint32_t>(
          std::max<std::uint64_t>(1, std::min<std::uint64_t>(batch, (64u << 20) / s)));
      out.push_back(raw_workload(s, b, "piece"));
    }
  };
  auto batch_sweep = [&](std::uint64_t piece, std::vector<std::uint32_t> batches) {
    for (std::uint32_t b : batches) out.push_back(raw_workload(piece, b, "batch"));
  };
  if (name == "tiny") {
    out.push_back(model_workload("qwen2.5-7b", 16, 40, S, 0.3));
    out.push_back(raw_workload(4096, 8, "piece"));
    out.push_back(raw_workload(65536, 4, "piece"));
  } else if (name == "default") {
    // The shm target cases at 4096 tokens (512 and 160 MiB) run on the
    // same-host engines only; the rest are 32-128 MiB per request so that
    // the TCP engines fit in the two-minute budget.
    out.push_back(model_workload("llama3-8b", 16, 4096, S, 0));
    out.back().same_host_only = true;
    out.push_back(model_workload("llama3-8b", 16, 1024, S, 0));
    out.push_back(model_workload("llama3-8b", 16, 1024, C, 0));
    out.push_back(model_workload("llama3-70b-tp8", 16, 4096, S, 0));
    out.back().same_host_only = true;
    out.push_back(model_workload("llama3-8b", 1, 512, S, 0));
    out.push_back(model_workload("qwen2.5-7b", 64, 2048, S, 0.3));
    out.push_back(model_workload("deepseek-v3", 64, 1024, S, 0));
    out.push_back(model_workload("llama3-8b", 16, 1024, S, 0, CO::kPageMajor, CO::kLayerMajor));
    // Upstream mstar's [L, P, 2, T, H, D]: against the layer-major case above.
    out.push_back(model_workload("llama3-8b", 16, 1024, S, 0, CO::kLayerPage, CO::kLayerPage));
    out.push_back(model_workload("llama3-8b", 16, 64, S, 0, CO::kLayerMajor, CO::kLayerMajor,
                                 PO::kNHD, PO::kHND));
    piece_sweep(128, {4096, 16384, 65536, 262144, 1u << 20, 4u << 20});
    batch_sweep(65536, {1, 512});
  } else if (name == "full") {
    for (const char* m : {"llama3-8b", "llama3-70b-tp8", "qwen2.5-7b", "deepseek-v3"}) {
      for (std::uint32_t ps : {1u, 16u, 64u}) {
        for (auto t : {S, C}) out.push_back(model_workload(m, ps, 1024, t, 0));
      }
    }
    for (std::uint64_t tokens : {128u, 1024u, 4096u, 16384u}) {
      out.push_back(model_workload("llama3-8b", 16, tokens, S, 0));
    }
    for (std::uint64_t tokens : {32768u, 131072u}) {
      out.push_back(model_workload("llama3-70b-tp8", 16, tokens, S, 0));
    }
    for (double hit : {0.5, 0.9, 0.33})
      out.push_back(model_workload("llama3-8b", 16, 4096, S, hit));
    for (auto lco : {CO::kLayerMajor, CO::kPageMajor, CO::kLayerPage}) {
      for (auto rco : {CO::kLayerMajor, CO::kPageMajor, CO::kLayerPage}) {
        for (auto t : {S, C}) out.push_back(model_workload("llama3-8b", 16, 1024, t, 0, lco, rco));
      }
    }
    for (auto lpo : {PO::kNHD, PO::kHND}) {
      for (auto rpo : {PO::kNHD, PO::kHND}) {
        out.push_back(model_workload("llama3-8b", 16, 256, S, 0.3, CO::kLayerMajor, CO::kLayerMajor,
                                     lpo, rpo));
      }
    }
    piece_sweep(128, {4096, 8192, 16384, 32768, 65536, 131072, 262144, 524288, 1u << 20, 2u << 20,
                      4u << 20});
    batch_sweep(65536, {1, 2, 8, 32, 512, 1024});
    batch_sweep(4096, {1, 8, 32, 512, 4096});
  } else {
    throw Error(StatusCode::kInvalidArgument,
                "bench: unknown suite '" + name + "' (known: tiny, default, full)");
  }
  return out;
}

std::vector<EngineVariant> engine_variants(const std::vector<EngineTraits>& engines) {
  std::vector<EngineVariant> out;
  for (const EngineTraits& e : engines) {
    if (!e.built) continue;
    for (const LoopbackSetup& setup : e.loopback) {
      out.push_back({.name = setup.name,
                     .engine = e.name,
                     .remote_kind = setup.owner_memory.value_or(e.memory),
                     .local_kind = setup.reader_memory.value_or(e.reader_memory),
                     .remote_in_child = e.crosses_processes,
                     .env = setup.env,
                     .extra = {},
                     .memcpy_baseline = true,
                     .crosses_hosts = e.crosses_hosts,
                     .over_tcp = setup.over_tcp,
                     .layer_regions = setup.layer_regions});
    }
  }
  return out;
}

Stat make_stat(std::vector<double> values) {
  Stat s;
  if (values.empty()) return s;
  std::sort(values.begin(), values.end());
  s.min = values.front();
  s.max = values.back();
  const std::size_t n = values.size();
  s.median = n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
  return s;
}

}  // namespace mstar::kv::cli::bench
