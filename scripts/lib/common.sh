# Shared by scripts/*: installs what is missing, configures and builds.
# Sourced, not run.
set -euo pipefail

MSTAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MSTAR_JOBS=${MSTAR_JOBS:-$(nproc)}
# No pip download cache: torch with its nvidia-* wheels is about 5 GB
# installed and as much again cached, and the CI machine's disk is shared
# (a run once failed with ENOSPC making the vLLM environments).
export PIP_NO_CACHE_DIR=1

# Debian packages, each installed only if absent, in two sets.
# The demo's: what builds the mstar-kv target in the demo preset
# (CMakePresets.json: the shm engine; no tests, benchmarks, serve/pull or
# other engines) and runs `mstar-kv demo` over shared memory. Nothing else: a first run should take
# a couple of minutes, not wait for test tools and a 5 GB torch.
MSTAR_DEMO_APT_PACKAGES=(cmake g++ make)
# Everything: the demo's, then the release build's optional parts (the ucx
# engine, serve/pull's HTTP libraries), the tests and the tools
# ./scripts/test runs.
MSTAR_APT_PACKAGES=(
  "${MSTAR_DEMO_APT_PACKAGES[@]}" pkg-config
  libgtest-dev libgmock-dev libbenchmark-dev
  libucx-dev ucx-utils
  libcpp-httplib-dev libmicrohttpd-dev
  iperf3 iproute2
  nftables  # the network fault tests' loss, partitions and relay redirect
  clang libclang-rt-14-dev clang-format
  libc++-14-dev libc++abi-14-dev clang-tidy
)

ensure_apt() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing Debian packages: ${missing[*]}"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Python packages from PyPI, installed only if absent. Failure is not fatal:
# what needs them skips with the reason printed.
ensure_pip() {
  local py=${PYTHON:-python3}
  for spec in "$@"; do
    local name=${spec%%[=<>]*} have
    # pip show fails for an absent package: with pipefail and set -e that
    # would end the script on a fresh machine, hence the || true.
    have=$("$py" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    # absent, or not the version a '==' pin names
    if [ -z "$have" ] || { [[ $spec == *==* ]] && [ "$have" != "${spec##*==}" ]; }; then
      echo "== installing PyPI package: $spec"
      "$py" -m pip install -q "$spec" || echo "== warning: pip could not install $spec; dependent checks will skip"
    fi
  done
}

# What ./scripts/demo needs, and no more.
ensure_demo_deps() {
  ensure_apt "${MSTAR_DEMO_APT_PACKAGES[@]}"
}

# Everything the builds, the tests and the benchmarks use (what a clean CI
# machine needs for ./scripts/test): every Debian package above and the PyPI
# packages of scripts/lib/pip-packages.txt.
ensure_deps() {
  ensure_apt "${MSTAR_APT_PACKAGES[@]}"
  if [ -f "$MSTAR_ROOT/scripts/lib/pip-packages.txt" ]; then
    mapfile -t pkgs < <(grep -v '^#' "$MSTAR_ROOT/scripts/lib/pip-packages.txt" | grep -v '^$')
    [ ${#pkgs[@]} -eq 0 ] || ensure_pip "${pkgs[@]}"
  fi
}

# Builds and installs the Python package from python/ (scikit-build-core +
# nanobind, installed by ensure_deps) into the current interpreter.
# The wheel is kept in build/wheels/ so that the vLLM environments
# (scripts/lib/vllm-envs.sh) install the same build instead of compiling again.
build_python() {
  local py=${PYTHON:-python3}
  rm -rf "$MSTAR_ROOT/build/wheels"
  "$py" -m pip wheel -q --no-build-isolation --no-deps -w "$MSTAR_ROOT/build/wheels" \
    "$MSTAR_ROOT/python" 2> >(grep -v "Running pip as the 'root' user" >&2)
  "$py" -m pip install -q --no-deps --force-reinstall "$MSTAR_ROOT"/build/wheels/mstar_kv-*.whl \
    2> >(grep -v "Running pip as the 'root' user" >&2)
}

# The conventions the tools hold: every tracked C/C++ file formatted as
# .clang-format says (tests, fuzz and bench included: code nobody formats
# drifts), the include directions of the layers (check_layers.py), Python
# clean under ruff.toml.
check_conventions() {
  local py=${PYTHON:-python3}
  (cd "$MSTAR_ROOT" &&
     git ls-files -z -- '*.hpp' '*.cpp' '*.h' '*.c' '*.cc' '*.cu' '*.cuh' |
     xargs -0 clang-format --dry-run -Werror)
  "$py" "$MSTAR_ROOT/scripts/lib/check_layers.py" --root "$MSTAR_ROOT"
  (cd "$MSTAR_ROOT" && "$py" -m ruff check -q python bench scripts tests)
}

# build PRESET [extra cmake args...]
build_preset() {
  local preset=$1
  shift
  cmake --preset "$preset" -S "$MSTAR_ROOT" "$@" >/dev/null
  cmake --build "$MSTAR_ROOT/build/$preset" -j "$MSTAR_JOBS"
}
