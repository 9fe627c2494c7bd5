// Copyright mstar-kv authors.
//
// Model geometry presets and the layout flags shared by every subcommand.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "args.hpp"
#include "mstar/kv/layout.hpp"

namespace mstar::kv::cli {

struct ModelPreset {
  const char* name;
  std::uint32_t num_layers;
  std::uint32_t num_kv_heads;  // per tensor-parallel rank
  std::uint32_t head_dim;
  bool has_v;
  const char* about;
};

// llama3-8b, llama3-70b-tp8, qwen2.5-7b, deepseek-v3 (MLA latent).
const std::vector<ModelPreset>& model_presets();
// Throws Error naming the preset and the known ones.
const ModelPreset& find_preset(std::string_view name);

// --model --layers --kv-heads --head-dim --dtype --page-size --pages
// --cache-order --page-order --mla
std::set<std::string> layout_options();
const char* layout_help();
// num_pages defaults to `default_pages` when --pages is absent.
KVLayout layout_from_args(const Args& args, std::uint32_t default_pages = 1024);

}  // namespace mstar::kv::cli
