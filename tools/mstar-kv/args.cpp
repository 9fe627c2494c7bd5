// Copyright mstar-kv authors.
#include "args.hpp"

#include <string>

#include "mstar/kv/util/status.hpp"
#include "util/parse.hpp"

namespace mstar::kv::cli {

namespace {

std::string known_list(const std::set<std::string>& a, const std::set<std::string>& b) {
  std::string out;
  for (const auto& s : a) out += (out.empty() ? "--" : ", --") + s;
  for (const auto& s : b) out += (out.empty() ? "--" : ", --") + s;
  return out;
}

}  // namespace

Args::Args(int argc, char** argv, std::set<std::string> flags, std::set<std::string> options) {
  for (int i = 0; i < argc; ++i) {
    std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      positional_.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::optional<std::string> value;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (flags.count(name) != 0) {
      if (value) {
        throw Error(StatusCode::kInvalidArgument, "flag --" + name + " takes no value");
      }
      flags_.insert(name);
    } else if (options.count(name) != 0) {
      if (!value) {
        if (i + 1 >= argc) {
          throw Error(StatusCode::kInvalidArgument, "option --" + name + " needs a value");
        }
        value = argv[++i];
      }
      values_[name] = *value;
    } else {
      throw Error(StatusCode::kInvalidArgument,
                  "unknown option --" + name + " (known: " + known_list(flags, options) + ")");
    }
  }
}

std::string Args::str(const std::string& name, const std::string& def) const {
  auto it = values_.find(name);
  return it == values_.end() ? def : it->second;
}

std::uint64_t Args::u64(const std::string& name, std::uint64_t def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  return util::parse_u64(it->second, "option --" + name);
}

double Args::f64(const std::string& name, double def) const {
  auto it = values_.find(name);
  if (it == values_.end()) return def;
  return util::parse_f64(it->second, "option --" + name);
}

std::string joined(const std::vector<std::string>& names, const std::string& sep) {
  std::string s;
  for (const std::string& n : names) s += (s.empty() ? "" : sep) + n;
  return s;
}

}  // namespace mstar::kv::cli
