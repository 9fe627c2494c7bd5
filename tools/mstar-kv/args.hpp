// Copyright mstar-kv authors.
//
// A small flag parser for the CLI: "--name value", "--name=value" and bare
// "--flag". Unknown flags are an error naming the flag and the known ones.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace mstar::kv::cli {

class Args {
 public:
  // `flags` take no value; `options` take one. Throws Error on a bad argv.
  Args(int argc, char** argv, std::set<std::string> flags, std::set<std::string> options);

  bool flag(const std::string& name) const { return flags_.count(name) != 0; }
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string str(const std::string& name, const std::string& def) const;
  std::uint64_t u64(const std::string& name, std::uint64_t def) const;
  double f64(const std::string& name, double def) const;
  const std::vector<std::string>& positional() const { return positional_; }

 private:
  std::set<std::string> flags_;
  std::map<std::string, std::string> values_;
  std::vector<std::string> positional_;
};

// The names in `names`, separated by `sep` ("shm, ucx").
std::string joined(const std::vector<std::string>& names, const std::string& sep = ", ");

}  // namespace mstar::kv::cli
