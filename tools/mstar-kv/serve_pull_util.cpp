// Copyright mstar-kv authors.
#include "serve_pull_util.hpp"
#include "util/parse.hpp"

#include <algorithm>
#include <cstdlib>
#include <sstream>

namespace mstar::kv::cli {

std::string layout_json(const KVLayout& l) {
  std::ostringstream o;
  o << "{\"num_layers\":" << l.num_layers << ",\"num_pages\":" << l.num_pages
    << ",\"page_size\":" << l.page_size << ",\"num_kv_heads\":" << l.num_kv_heads
    << ",\"head_dim\":" << l.head_dim << ",\"dtype\":\"" << to_string(l.dtype)
    << "\",\"has_v\":" << (l.has_v ? "true" : "false") << ",\"cache_order\":\""
    << to_string(l.cache_order) << "\",\"page_order\":\"" << to_string(l.page_order) << "\"}";
  return o.str();
}

std::string json_value(const std::string& json, const std::string& key) {
  const std::string needle = "\"" + key + "\":";
  const auto at = json.find(needle);
  if (at == std::string::npos) {
    throw Error(StatusCode::kCorruptDescriptor, "server metadata lacks '" + key + "'");
  }
  std::size_t i = at + needle.size();
  if (i < json.size() && json[i] == '"') {
    const auto end = json.find('"', i + 1);
    if (end == std::string::npos) {
      throw Error(StatusCode::kCorruptDescriptor, "server metadata: bad '" + key + "'");
    }
    return json.substr(i + 1, end - i - 1);
  }
  std::size_t end = i;
  while (end < json.size() && json[end] != ',' && json[end] != '}') ++end;
  return json.substr(i, end - i);
}

std::uint64_t json_u64(const std::string& json, const std::string& key) {
  const std::string v = json_value(json, key);
  try {
    return util::parse_u64(v, "server metadata '" + key + "'");
  } catch (const Error& e) {
    throw Error(StatusCode::kCorruptDescriptor, e.status().message());  // untrusted bytes
  }
}

bool parse_id(const std::string& s, std::uint64_t* id) {
  if (s.empty() || s.size() > 19) return false;
  std::uint64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + static_cast<std::uint64_t>(c - '0');
  }
  *id = v;
  return true;
}

void parse_extra(const Args& args, EngineOptions& o) {
  if (args.has("mooncake-lib")) o.extra["mooncake_lib"] = args.str("mooncake-lib", "");
  if (!args.has("extra")) return;
  std::stringstream ss(args.str("extra", ""));
  for (std::string kv; std::getline(ss, kv, ',');) {
    const auto eq = kv.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw Error(StatusCode::kInvalidArgument, "--extra '" + kv + "' is not KEY=VALUE");
    }
    o.extra[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
}

SignalWaiter::SignalWaiter() {
  sigemptyset(&set_);
  sigaddset(&set_, SIGINT);
  sigaddset(&set_, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set_, nullptr);
}

bool SignalWaiter::wait(const std::atomic<bool>& stop) {
  timespec ts{0, 50 * 1000 * 1000};
  while (!stop.load(std::memory_order_acquire)) {
    if (sigtimedwait(&set_, nullptr, &ts) > 0) return true;
  }
  return false;
}

KVLayout layout_from_meta(const std::string& meta, const Args& args, std::uint32_t num_pages) {
  const auto lpos = meta.find("\"layout\":");
  if (lpos == std::string::npos) {
    throw Error(StatusCode::kCorruptDescriptor, "server metadata lacks the layout");
  }
  const std::string lj = meta.substr(lpos);
  KVLayout layout;
  layout.num_layers = static_cast<std::uint32_t>(json_u64(lj, "num_layers"));
  layout.page_size = static_cast<std::uint32_t>(json_u64(lj, "page_size"));
  layout.num_kv_heads = static_cast<std::uint32_t>(json_u64(lj, "num_kv_heads"));
  layout.head_dim = static_cast<std::uint32_t>(json_u64(lj, "head_dim"));
  layout.dtype = parse_dtype(json_value(lj, "dtype"));
  layout.has_v = json_value(lj, "has_v") == "true";
  layout.cache_order =
      parse_cache_order(args.str("cache-order", std::string(json_value(lj, "cache_order"))));
  layout.page_order =
      parse_page_order(args.str("page-order", std::string(json_value(lj, "page_order"))));
  layout.num_pages = std::max<std::uint32_t>(num_pages, 1);
  layout.validate();
  return layout;
}

}  // namespace mstar::kv::cli
