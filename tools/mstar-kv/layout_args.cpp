// Copyright mstar-kv authors.
#include "layout_args.hpp"

#include "mstar/kv/status.hpp"

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
  return {"model", "layers", "kv-heads", "head-dim", "dtype", "page-size",
          "pages", "cache-order", "page-order"};
}

const char* layout_help() {
  return "layout options:\n"
         "  --model NAME        llama3-8b (default), llama3-70b-tp8, qwen2.5-7b, deepseek-v3\n"
         "  --layers N --kv-heads N --head-dim N   override the preset's geometry\n"
         "  --dtype T           bf16 (default), fp16, fp32, fp8_e4m3, fp8_e5m2\n"
         "  --page-size N       tokens per page (default 16)\n"
         "  --pages N           pages in each cache\n"
         "  --cache-order O     layer (default) or page\n"
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

}  // namespace mstar::kv::cli
