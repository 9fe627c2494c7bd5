// Copyright mstar-kv authors.
#include "layout_args.hpp"

#include "mstar/kv/util/status.hpp"

namespace mstar::kv::cli {

const std::vector<ModelPreset>& model_presets() {
  static const std::vector<ModelPreset> presets = {
      {"llama3-8b", 32, 8, 128, true, "Llama-3-8B: 32 layers, 8 KV heads, head dim 128"},
      {"llama3-70b", 80, 8, 128, true, "Llama-3-70B: 80 layers, 8 KV heads, head dim 128"},
      {"llama3-70b-tp8", 80, 1, 128, true, "Llama-3-70B at TP8: 80 layers, 1 KV head per rank"},
      {"qwen2.5-7b", 28, 4, 128, true, "Qwen-2.5-7B: 28 layers, 4 KV heads, head dim 128"},
      {"deepseek-v3", 61, 1, 576, false,
       "DeepSeek-V3 MLA: 61 layers, one 576-wide latent (512 + 64 rope), no V"},
  };
  return presets;
}

const ModelPreset& find_preset(std::string_view name) {
  std::string known;
  for (const auto& p : model_presets()) {
    if (name == p.name) return p;
    known += (known.empty() ? "" : ", ") + std::string(p.name);
  }
  throw Error(StatusCode::kInvalidArgument,
              "unknown model '" + std::string(name) + "' (known: " + known + ")");
}

std::set<std::string> layout_options() {
  return {"model",     "layers", "kv-heads",    "head-dim",  "dtype",
          "page-size", "pages",  "cache-order", "page-order"};
}

const char* layout_help() {
  return "layout options:\n"
         "  --model NAME        llama3-8b (default), llama3-70b-tp8, qwen2.5-7b, deepseek-v3\n"
         "  --layers N --kv-heads N --head-dim N   override the preset's geometry\n"
         "  --dtype T           bf16 (default), fp16, fp32, fp8_e4m3, fp8_e5m2\n"
         "  --page-size N       tokens per page (default 16)\n"
         "  --pages N           pages in each cache\n"
         "  --cache-order O     layer (default: [L][k|v][P]), page ([P][L][k|v]) or\n"
         "                      layer_page ([L][P][k|v], torch [L, P, 2, T, H, D])\n"
         "  --page-order O      nhd (default) or hnd\n";
}

KVLayout layout_from_args(const Args& args, std::uint32_t default_pages) {
  const ModelPreset& p = find_preset(args.str("model", "llama3-8b"));
  KVLayout l;
  l.num_layers = static_cast<std::uint32_t>(args.u64("layers", p.num_layers));
  l.num_kv_heads = static_cast<std::uint32_t>(args.u64("kv-heads", p.num_kv_heads));
  l.head_dim = static_cast<std::uint32_t>(args.u64("head-dim", p.head_dim));
  l.has_v = p.has_v;
  l.dtype = parse_dtype(args.str("dtype", "bf16"));
  l.page_size = static_cast<std::uint32_t>(args.u64("page-size", 16));
  l.num_pages = static_cast<std::uint32_t>(args.u64("pages", default_pages));
  l.cache_order = parse_cache_order(args.str("cache-order", "layer"));
  l.page_order = parse_page_order(args.str("page-order", "nhd"));
  l.validate();
  return l;
}

std::string apply_geometry(KVLayout& local, KVLayout& remote, const Geometry& g,
                           std::uint64_t tokens) {
  std::string suffix;
  const std::uint32_t model_heads = local.num_kv_heads;  // the preset's, all of them
  auto shard = [&](std::uint32_t tp, std::uint32_t rank, const char* what) {
    if (tp == 0 || model_heads % tp != 0) {
      throw Error(StatusCode::kInvalidArgument,
                  std::string("--") + what + "-tp " + std::to_string(tp) +
                      " does not divide the model's " + std::to_string(model_heads) + " KV heads");
    }
    if (rank >= tp) {
      throw Error(
          StatusCode::kInvalidArgument,
          "--local-rank " + std::to_string(rank) + " out of range [0, " + std::to_string(tp) + ")");
    }
    return std::pair<std::uint32_t, std::uint32_t>{model_heads / tp * rank, model_heads / tp};
  };
  const auto [lfirst, ln] = shard(g.local_tp, g.local_rank, "local");
  // The prefill rank holding the local shard's first head; it must hold all.
  const std::uint32_t rn = shard(g.remote_tp, 0, "remote").second;
  const std::uint32_t rfirst = lfirst / rn * rn;
  if (lfirst + ln > rfirst + rn) {
    throw Error(StatusCode::kInvalidArgument,
                "a TP=" + std::to_string(g.local_tp) + " decode rank holds KV heads [" +
                    std::to_string(lfirst) + ", " + std::to_string(lfirst + ln) +
                    "), more than one TP=" + std::to_string(g.remote_tp) + " prefill rank holds (" +
                    std::to_string(rn) +
                    "): a merge reads several peers (KVTransferManager's RemoteShard form, "
                    "tested in the conformance suite), which this command does not do");
  }
  if (g.local_tp > 1 || g.remote_tp > 1) {
    local.total_kv_heads = remote.total_kv_heads = model_heads;
    local.first_kv_head = lfirst;
    local.num_kv_heads = ln;
    remote.first_kv_head = rfirst;
    remote.num_kv_heads = rn;
    suffix += "/tp" + std::to_string(g.remote_tp) + "->" + std::to_string(g.local_tp) + "r" +
              std::to_string(g.local_rank);
  }
  if (g.remote_page_size != 0 && g.remote_page_size != remote.page_size) {
    remote.page_size = g.remote_page_size;
    remote.num_pages =
        static_cast<std::uint32_t>((tokens + g.remote_page_size - 1) / g.remote_page_size);
    suffix += "/p" + std::to_string(local.page_size) + "<-p" + std::to_string(g.remote_page_size);
  }
  local.validate();
  remote.validate();
  return suffix;
}

Geometry geometry_from_args(const Args& args) {
  Geometry g;
  g.remote_page_size = static_cast<std::uint32_t>(args.u64("remote-page-size", 0));
  g.local_tp = static_cast<std::uint32_t>(args.u64("local-tp", 1));
  g.local_rank = static_cast<std::uint32_t>(args.u64("local-rank", 0));
  g.remote_tp = static_cast<std::uint32_t>(args.u64("remote-tp", 1));
  return g;
}

}  // namespace mstar::kv::cli
