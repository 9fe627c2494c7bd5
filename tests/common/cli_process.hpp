// Copyright mstar-kv authors.
//
// `mstar-kv <args>` as a test runs it: the CLI under test (MSTAR_KV_CLI_PATH,
// set by CMake on the test target) with stdout and stderr on a pipe; killed
// and reaped by the destructor if it still runs.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "toolkit/child.hpp"

#ifndef MSTAR_KV_CLI_PATH
#error "MSTAR_KV_CLI_PATH must name the mstar-kv executable"
#endif

namespace mstar::kv::testing {

class CliProcess : public toolkit::Child {
 public:
  explicit CliProcess(std::vector<std::string> args,
                      const std::map<std::string, std::string>& env = {})
      : Child(with_cli(std::move(args)), env) {}

 private:
  static std::vector<std::string> with_cli(std::vector<std::string> args) {
    args.insert(args.begin(), MSTAR_KV_CLI_PATH);
    return args;
  }
};

}  // namespace mstar::kv::testing
