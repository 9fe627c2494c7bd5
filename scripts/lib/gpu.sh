# Shared by scripts/gpu-check and scripts/gpu-pack: what the GPU check
# builds and how. Sourced after common.sh, not run.

# Where a pack's build lives, on the machine that builds it and on the GPU
# machine that unpacks it: one fixed path, since the test binaries find
# their peer processes (cuda_ipc_owner, kv_conformance_peer, mstar-kv) by
# the absolute paths they were built with.
GPU_PACK_ROOT=${GPU_PACK_ROOT:-/tmp/mstar-kv-gpu-pack}
GPU_PACK_FILE=${GPU_PACK_FILE:-$MSTAR_ROOT/.gpu-pack/gpu-pack.tar.xz}

# The targets of the check: the cuda_ipc engine's tests, its owner and its
# benchmark, and the multi-process suites (their cuda_ipc, cuda_ipc-kernel
# and ucx-tcp-device cases) with their peer.
GPU_CHECK_TARGETS=(cuda_ipc_tests cuda_ipc_owner cuda_ipc_bench
                   engine_conformance_tests engine_streaming_tests engine_sparse_pages_tests
                   kv_conformance_peer)
# ... and where UCX is built: the staging tests and the CLI's benchmark.
GPU_CHECK_UCX_TARGETS=(ucx_engine_tests mstar-kv)
# The same targets as paths in a build tree (what a pack holds).
GPU_CHECK_BINARIES=(tests/engines/cuda_ipc/cuda_ipc_tests tests/engines/cuda_ipc/cuda_ipc_owner
                    bench/cuda_ipc_bench
                    tests/engines/conformance/engine_conformance_tests
                    tests/engines/conformance/engine_streaming_tests
                    tests/engines/conformance/engine_sparse_pages_tests
                    tests/engines/conformance/kv_conformance_peer)
GPU_CHECK_UCX_BINARIES=(tests/engines/ucx/ucx_engine_tests tools/mstar-kv)

# gpu_configure BUILD_DIR LOG [cmake args...]: the check's build (Release,
# cuda_ipc with its kernel, ucx where UCX is found, no Mooncake, no fuzz).
gpu_configure() {
  local dir=$1 log=$2
  shift 2
  cmake -S "$MSTAR_ROOT" -B "$dir" -DCMAKE_BUILD_TYPE=Release \
    -DMSTAR_KV_ENGINE_CUDA_IPC=ON -DMSTAR_KV_ENGINE_UCX=ON -DMSTAR_KV_ENGINE_MOONCAKE=OFF \
    -DMSTAR_KV_BUILD_TOOLS=ON -DMSTAR_KV_BUILD_FUZZ=OFF \
    -DCUDAToolkit_ROOT="${CUDA_HOME:-/usr/local/cuda}" "$@" >"$log" 2>&1
}

# gpu_ucx_found LOG: whether the configure log says UCX was found.
gpu_ucx_found() { ! grep -q "UCX not found" "$1"; }

# gpu_build BUILD_DIR LOG UCX: builds the check's targets, the ucx ones too
# when UCX is 1.
gpu_build() {
  local dir=$1 log=$2 targets=("${GPU_CHECK_TARGETS[@]}")
  [ "$3" != 1 ] || targets+=("${GPU_CHECK_UCX_TARGETS[@]}")
  cmake --build "$dir" -j "$MSTAR_JOBS" --target "${targets[@]}" >"$log" 2>&1
}
