// Copyright mstar-kv authors.
//
// Model geometry presets and the layout flags shared by every subcommand.
#pragma once

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "args.hpp"
#include "mstar/kv/core/layout.hpp"

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

// A prefill (remote) geometry other than the decode (local) one: the
// prefill side's page size and tensor-parallel split, and the decode rank's.
// The model's KV heads are the local layout's num_kv_heads before it.
struct Geometry {
  std::uint32_t remote_page_size = 0;  // 0: the local one
  std::uint32_t local_tp = 1, local_rank = 0, remote_tp = 1;
};
// --remote-page-size --remote-tp --local-tp --local-rank
Geometry geometry_from_args(const Args& args);
// Applies `g` to two copies of a model's layout for a `tokens`-token
// request; returns a name suffix ("/tp1->2r1", "/p64<-p16"). Throws
// Error(kInvalidArgument) naming the flag for splits that do not line up
// and for merges (a decode rank wider than one prefill rank).
std::string apply_geometry(KVLayout& local, KVLayout& remote, const Geometry& g,
                           std::uint64_t tokens);

}  // namespace mstar::kv::cli
