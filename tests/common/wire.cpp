// Copyright mstar-kv authors.
#include "common/wire.hpp"

#include <sstream>
#include <stdexcept>

namespace mstar::kv::testing {

std::string layout_arg(const KVLayout& l) {
  std::ostringstream o;
  o << l.num_layers << ',' << l.num_pages << ',' << l.page_size << ',' << l.num_kv_heads << ','
    << l.head_dim << ',' << to_string(l.dtype) << ',' << (l.has_v ? 1 : 0) << ','
    << to_string(l.cache_order) << ',' << to_string(l.page_order);
  if (l.total_kv_heads != 0 || l.first_kv_head != 0) {
    o << ',' << l.total_kv_heads << ',' << l.first_kv_head;
  }
  return o.str();
}

KVLayout parse_layout_arg(const std::string& s) {
  std::vector<std::string> f;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, ',');) f.push_back(part);
  if (f.size() != 9 && f.size() != 11) {
    throw std::runtime_error("bad layout argument '" + s + "'");
  }
  KVLayout l;
  l.num_layers = static_cast<std::uint32_t>(std::stoul(f[0]));
  l.num_pages = static_cast<std::uint32_t>(std::stoul(f[1]));
  l.page_size = static_cast<std::uint32_t>(std::stoul(f[2]));
  l.num_kv_heads = static_cast<std::uint32_t>(std::stoul(f[3]));
  l.head_dim = static_cast<std::uint32_t>(std::stoul(f[4]));
  l.dtype = parse_dtype(f[5]);
  l.has_v = f[6] == "1";
  l.cache_order = parse_cache_order(f[7]);
  l.page_order = parse_page_order(f[8]);
  if (f.size() == 11) {
    l.total_kv_heads = static_cast<std::uint32_t>(std::stoul(f[9]));
    l.first_kv_head = static_cast<std::uint32_t>(std::stoul(f[10]));
  }
  l.validate();
  return l;
}

}  // namespace mstar::kv::testing
