// Copyright mstar-kv authors.
//
// Each case's environment is its own: the variables of its loopback setup
// are set while it runs and put back after it (EngineSuite::SetUp checks it
// at the start of every case). ctest runs each case in a process of its
// own; the test `engine_conformance_case_env_one_process` runs these two
// tests, every case of each, in one process, as scripts/gpu-check runs a
// whole suite: the second test's cases start after the first test's last
// case, each having set its own variables (MSTAR_KV_UCX_STAGING=on of
// ucx-tcp-staged, MSTAR_KV_CUDA_IPC_COPY=kernel of cuda_ipc-kernel, ...).
#include <gtest/gtest.h>

#include "engine_suite.hpp"

namespace mstar::kv::testing {
namespace {

class CaseEnv : public EngineSuite {
 protected:
  // The case's variables are set, every other case's are as at the start.
  void expect_own_environment() const {
    for (const auto& [k, start] : case_env_at_start()) {
      const auto own = GetParam().env.find(k);
      if (own != GetParam().env.end()) {
        EXPECT_EQ(ScopedEnv::get(k), own->second) << k << " of this case";
      } else {
        EXPECT_EQ(ScopedEnv::get(k), start) << k << " of another case";
      }
    }
  }
};

TEST_P(CaseEnv, TheCaseSetsItsOwnVariables) { expect_own_environment(); }

TEST_P(CaseEnv, AndNoEarlierCaseLeftItsVariables) { expect_own_environment(); }

INSTANTIATE_TEST_SUITE_P(Engines, CaseEnv, ::testing::ValuesIn(engine_cases()),
                         [](const ::testing::TestParamInfo<EngineCase>& p) {
                           return p.param.label;
                         });

}  // namespace
}  // namespace mstar::kv::testing
