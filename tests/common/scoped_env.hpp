// Copyright mstar-kv authors.
//
// ScopedEnv: sets environment variables for a scope and puts back what was
// there (the old value, or no variable) when it ends. The multi-process
// suites set a case's environment in the test process (its peers inherit
// it); without the restore one case's variables stayed for every later case
// of the same process (a whole binary run by one command, as gpu-check does;
// ctest runs each case alone and never saw it).
#pragma once

#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace mstar::kv::testing {

class ScopedEnv {
 public:
  ScopedEnv() = default;
  ScopedEnv(const char* name, const char* value) { set(name, value); }
  explicit ScopedEnv(const std::map<std::string, std::string>& vars) {
    for (const auto& [k, v] : vars) set(k, v);
  }
  ~ScopedEnv() { restore(); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  // Sets `name`; the first set of a name remembers what to put back.
  void set(const std::string& name, const std::string& value) {
    bool seen = false;
    for (const auto& s : saved_) seen = seen || s.first == name;
    if (!seen) saved_.emplace_back(name, get(name));
    ::setenv(name.c_str(), value.c_str(), 1);
  }

  // Puts back every variable set through this object, last set first.
  void restore() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) {
      if (it->second) {
        ::setenv(it->first.c_str(), it->second->c_str(), 1);
      } else {
        ::unsetenv(it->first.c_str());
      }
    }
    saved_.clear();
  }

  static std::optional<std::string> get(const std::string& name) {
    const char* v = std::getenv(name.c_str());
    return v == nullptr ? std::nullopt : std::optional<std::string>(v);
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace mstar::kv::testing
