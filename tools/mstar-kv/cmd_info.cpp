// Copyright mstar-kv authors.
#include <cstdio>

#include "args.hpp"
#include "commands.hpp"
#include "layout_args.hpp"
#include "mstar/kv/kv.hpp"

namespace mstar::kv::cli {

int cmd_info(int argc, char** argv) {
  Args args(argc, argv, {"help"}, layout_options());
  if (args.flag("help")) {
    std::printf("usage: mstar-kv info [layout options]\n%s", layout_help());
    return 0;
  }
  std::printf("engines built:");
  for (const auto& e : built_engines()) std::printf(" %s", e.c_str());
  const KVLayout l = layout_from_args(args);
  std::printf("\nlayout: %s\n", l.to_string().c_str());
  std::printf("block (one layer, k|v, page): %llu bytes\n",
              static_cast<unsigned long long>(l.block_bytes()));
  std::printf("one token, all layers: %llu bytes\n",
              static_cast<unsigned long long>(l.token_bytes()) * l.num_kv() * l.num_layers);
  std::printf("whole cache: %llu bytes\n", static_cast<unsigned long long>(l.total_bytes()));
  return 0;
}

}  // namespace mstar::kv::cli
