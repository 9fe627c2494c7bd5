// Copyright mstar-kv authors.
#include "cuda_ipc_test_util.hpp"

#ifndef CUDA_IPC_OWNER_PATH
#error "CUDA_IPC_OWNER_PATH must name the owner executable"
#endif

namespace mstar::kv::cuda_test {

OwnerProcess::OwnerProcess(const OwnerSpec& spec, std::chrono::milliseconds timeout)
    : Peer({CUDA_IPC_OWNER_PATH, "--layout", testing::layout_arg(spec.layout), "--tokens",
            std::to_string(spec.tokens), "--seed", std::to_string(spec.seed), "--scatter",
            std::to_string(spec.scatter_seed), "--wrap-offset", std::to_string(spec.wrap_offset)},
           {}, timeout) {}

}  // namespace mstar::kv::cuda_test
