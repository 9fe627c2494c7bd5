// Copyright mstar-kv authors.
//
// The cuda_ipc copy kernel: each thread runs core/span_walk.hpp's
// copy_tile_thread, the very code the host tests run for every (block,
// thread) of a grid (tests/core/span_walk_test.cpp).
#include <cuda_runtime.h>

#include "core/span_walk.hpp"
#include "span_kernel.hpp"

namespace mstar::kv::cuda_ipc {

namespace {

__global__ void __launch_bounds__(walk::kThreads)
    span_copy_kernel(walk::WalkTable table, const std::byte* __restrict__ src,
                     std::byte* __restrict__ dst) {
  walk::copy_tile_thread(table, src, dst, blockIdx.x, gridDim.x, threadIdx.x);
}

}  // namespace

cudaError_t launch_span_copy(const walk::WalkTable& table, const std::byte* src_base,
                             std::byte* dst_base, unsigned max_blocks, cudaStream_t stream) {
  if (table.units == 0) return cudaSuccess;
  const std::uint64_t tiles = walk::tiles_of(table.units);
  const unsigned grid = static_cast<unsigned>(tiles < max_blocks ? tiles : max_blocks);
  // clang-format 14 reads a kernel launch as shifts (it broke "<<<" into "< <<").
  // clang-format off
  span_copy_kernel<<<grid < 1 ? 1 : grid, walk::kThreads, 0, stream>>>(table, src_base, dst_base);
  // clang-format on
  return cudaGetLastError();
}

}  // namespace mstar::kv::cuda_ipc
