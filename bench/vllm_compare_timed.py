"""The connectors bench/vllm_compare.py runs, each timed the same way inside
vLLM's worker process (which vLLM spawns: a patch made in the engine's own
process would not reach it; vLLM imports this module there, by
kv_connector_module_path).

Each load is timed from the step whose connector metadata names it (bound
right before start_load_kv) to the get_finished that reports it; one JSON
line per load goes to $VLLM_COMPARE_LOG.
"""
from __future__ import annotations

import json
import os
import time

import torch

# vLLM's MooncakeConnector asks CUDA for the worker's device index, on CPU
# too; every engine of the benchmark runs on CPU, device 0.
torch.accelerator.current_device_index = lambda: 0

_started: dict = {}
_how: dict = {}  # MstarKVConnector: how each load started (logged with its time)


def _loads_in(meta) -> list:
    """The request ids a connector's step metadata starts loading."""
    step = getattr(meta, "step", None)
    if step is not None:  # MstarKVConnector
        return [ld.req_id for ld in step.load]
    recv = getattr(meta, "reqs_to_recv", None) or {}
    if recv and all(isinstance(v, dict) for v in recv.values()):  # Mooncake: by engine
        return [r for per in recv.values() for r in per]
    return list(recv)  # NIXL


def _ended(req_ids) -> None:
    now = time.perf_counter()
    path = os.environ.get("VLLM_COMPARE_LOG", "")
    for r in req_ids or ():
        t0 = _started.pop(r, None)
        if t0 is not None and path:
            with open(path, "a") as f:
                f.write(json.dumps({"req": r, "pull_s": now - t0, **_how.pop(r, {})}) + "\n")


def _timed(base):
    class Timed(base):
        def bind_connector_metadata(self, meta):
            now = time.perf_counter()
            for r in _loads_in(meta):
                _started.setdefault(r, now)
            out = super().bind_connector_metadata(meta)
            consumer = getattr(self, "consumer", None)
            if consumer is not None and hasattr(consumer, "_loads"):
                # Started on the engine's thread (the peer was connected) or
                # on a load thread; how many prefill ranks were connected.
                peers = consumer.peers() if hasattr(consumer, "peers") else {}
                for r in _loads_in(meta):
                    ld = consumer._loads.get(r)
                    _how[r] = {"direct": bool(ld is not None and ld.direct),
                               "peers_up": sum(p["state"] == "connected"
                                               for p in peers.values())}
            return out

        def get_finished(self, finished_req_ids):
            sending, recving = super().get_finished(finished_req_ids)
            _ended(recving)
            return sending, recving

        def get_transfer_results(self, finished_req_ids):
            # What vLLM 0.32+ calls (NIXL and Mooncake answer here directly).
            res = super().get_transfer_results(finished_req_ids)
            _ended(res.finished_recving)
            _ended(getattr(res, "failed_recving", None))
            return res
    Timed.__name__ = Timed.__qualname__ = "Timed" + base.__name__
    return Timed


def _mstar():
    from mstar_kv.integrations.vllm.connector import MstarKVConnector
    return MstarKVConnector


def _nixl():
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector
    return NixlConnector


def _mooncake():
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.mooncake_connector import (
        MooncakeConnector,
    )
    return MooncakeConnector


def __getattr__(name):
    # Imported lazily: only the benchmarked connector's dependencies load.
    bases = {"TimedMstarKVConnector": _mstar, "TimedNixlConnector": _nixl,
             "TimedMooncakeConnector": _mooncake}
    if name not in bases:
        raise AttributeError(name)
    cls = _timed(bases[name]())
    globals()[name] = cls
    return cls
