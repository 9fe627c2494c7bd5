"""One manager for every engine: a Python-implemented engine and
the native engine it is built on go through the same C++ KVTransferManager,
so statistics, layer-wise streaming, shards, done notices and errors are the
same for both. The Python engine here is a real KVTransferEngine subclass
that delegates each call to a native engine (so any difference is the
manager's), against real owner processes (peer.py)."""
import os

import mstar_kv as kv
import pytest
from conftest import SEED, STREAM_SEED, TOKENS, local_layout, read_marks, start_stream

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

ENGINES = [e for e in ("shm", "ucx") if e in kv.built_engines()]


class PythonEngine(kv.KVTransferEngine):
    """A KVTransferEngine written in Python, over a native engine's calls."""

    def __init__(self, inner):
        self.inner = inner
        self.kv_cache = inner.kv_cache
        self.reads = 0

    def get_kv_transfer_info(self):
        return self.inner.get_kv_transfer_info()

    def remote_layout(self, remote_kv_info):
        return self.inner.remote_layout(remote_kv_info)

    def read_batched_async(self, remote_kv_info, read_info):
        self.reads += 1
        return self.inner.read_batched_async(remote_kv_info, read_info)

    def watch_layers(self, remote_kv_info, read_info):
        return self.inner.watch_layers(remote_kv_info, read_info)

    def notify_done(self, remote_kv_info, seq_id):
        self.inner.notify_done(remote_kv_info, seq_id)

    @property
    def timeout(self):
        return self.inner.timeout

    def shutdown(self):
        self.inner.shutdown()


def native_engine(engine, cache):
    if engine == "shm":
        return kv.ShmKVTransferEngine(cache, timeout=10.0)
    return kv.UcxKVTransferEngine(cache, entity_id="decode", timeout=10.0)


def both(engine, layout):
    """(native manager, Python-engine manager), each over its own cache."""
    out = []
    for wrap in (False, True):
        cache = kv.KVCache(layout)
        e = native_engine(engine, cache)
        mgr = kv.KVTransferManager(PythonEngine(e) if wrap else e, cache)
        out.append((cache, mgr))
    return out


def counts(mgr):
    t = mgr.stats()["total"]
    return (t["reads_started"], t["reads_succeeded"], t["reads_failed"], t["bytes"],
            t["latency"]["transfer"]["count"])


def error_of(fn):
    try:
        fn()
    except kv.KVTransferError as e:
        return type(e), str(e)
    return None


@pytest.mark.parametrize("engine", ENGINES)
def test_same_bytes_stats_and_errors(engine, peer_factory):
    peer = peer_factory(engine)
    seq = peer.seqs[0]
    layout = local_layout()
    (c0, native), (c1, python) = both(engine, layout)
    assert type(python.engine) is PythonEngine
    local = [9, 4, 33, 60, 1, 2, 3]
    for cache, mgr in ((c0, native), (c1, python)):
        assert mgr.sync_retrieve(0, TOKENS, local, seq.page_indices, seq.kv_transfer_info) > 0
        assert mgr.sync_retrieve(40, TOKENS, local, seq.page_indices, seq.kv_transfer_info) > 0
        assert mgr.start_async_retrieve(50, 50, local, seq.page_indices,
                                        seq.kv_transfer_info) is None
        assert cache.verify_pattern(SEED + 1, local, 0, TOKENS)["ok"]
    # The same refusals, named the same way, before any byte moves.
    bad_calls = [
        lambda m: m.start_async_retrieve(0, TOKENS, local[:2], seq.page_indices,
                                         seq.kv_transfer_info),
        lambda m: m.start_async_retrieve(0, TOKENS, local, [999] * 7, seq.kv_transfer_info),
        lambda m: m.start_async_retrieve(0, 10**6, local, seq.page_indices,
                                         seq.kv_transfer_info),
    ]
    for call in bad_calls:
        e0, e1 = error_of(lambda c=call: c(native)), error_of(lambda c=call: c(python))
        assert e0 is not None and e0 == e1, (e0, e1)
    # A corrupted descriptor: refused by both with the engine's decode error.
    corrupt = kv.KVTransferInfo(engine, b"\x00" * 8)
    e0 = error_of(lambda: native.start_async_retrieve(0, TOKENS, local, seq.page_indices, corrupt))
    e1 = error_of(lambda: python.start_async_retrieve(0, TOKENS, local, seq.page_indices, corrupt))
    assert e0 is not None and e0 == e1, (e0, e1)
    # The same statistics: 2 reads succeeded (the empty range is no read),
    # the refused ones counted by code.
    assert counts(native) == counts(python)
    started, ok, failed, nbytes, resolved = counts(native)
    assert ok == 2 and nbytes > 0 and sum(failed.values()) == started - ok
    assert python.engine.reads == 3  # two reads and the empty range's validation
    native.cleanup()
    python.cleanup()
    with pytest.raises(kv.ShutdownError):
        python.start_async_retrieve(0, TOKENS, local, seq.page_indices, seq.kv_transfer_info)


@pytest.mark.parametrize("engine", ENGINES)
def test_same_layer_by_layer_stream(engine, peer_factory):
    layout = local_layout()
    for cache, mgr in both(engine, layout):
        peer = peer_factory(engine)  # one slow owner each: it streams one sequence
        seq = start_stream(peer, 150, layout.num_layers)
        local = list(range(len(seq.page_indices)))
        stream = mgr.start_streaming_retrieve(0, TOKENS, local, seq.page_indices,
                                              seq.kv_transfer_info, ready_timeout=10)
        done = []
        for layer in range(layout.num_layers):
            assert stream.wait_for_layer(layer, timeout=10)
            done.append(stream.layers_done)
        assert done[0] < layout.num_layers, done  # the first layer came before the last mark
        nbytes = stream.future.result(timeout=10)
        assert nbytes == TOKENS * layout.token_bytes * layout.num_kv * layout.num_layers
        assert cache.verify_pattern(STREAM_SEED, local, 0, TOKENS)["ok"]
        read_marks(peer, layout.num_layers)
        assert mgr.stats()["total"]["reads_succeeded"] == 1
        mgr.cleanup()


@pytest.mark.parametrize("engine", ENGINES)
def test_same_shards(engine, peer_factory):
    p0 = peer_factory(engine, "--heads", "2", "--total-heads", "4", "--first-head", "0")
    p1 = peer_factory(engine, "--heads", "2", "--total-heads", "4", "--first-head", "2",
                      "--page-size", "8", "--pages", "128")
    layout = kv.KVLayout(4, 8, 64, 4, 64)
    errors = []
    for cache, mgr in both(engine, layout):
        pages = [5, 2]
        fut = mgr.start_async_retrieve_shards(0, TOKENS, pages, [p0.seqs[0], p1.seqs[0]])
        assert fut.result(timeout=30) == TOKENS * layout.token_bytes * layout.num_kv * 4
        assert cache.verify_pattern(SEED + 1, pages, 0, TOKENS)["ok"]
        errors.append(error_of(lambda m=mgr, p=pages: m.start_async_retrieve_shards(
            0, TOKENS, p, [p0.seqs[0]])))
        assert mgr.stats()["total"]["reads_succeeded"] == 1
        mgr.cleanup()
    assert errors[0] is not None and errors[0][0] is kv.IncompatibleLayoutError
    assert errors[0] == errors[1]


@pytest.mark.parametrize("engine", ENGINES)
def test_same_done_notices(engine, peer_factory):
    peer = peer_factory(engine)
    layout = local_layout()
    outcomes = []
    for i, (_cache, mgr) in enumerate(both(engine, layout)):
        # ucx frees what it is told: sequence 1 for the native manager, 2 for
        # the Python one; shm refuses, the same way for the same sequence.
        seq = peer.seqs[i if engine == "ucx" else 0]
        local = list(range(len(seq.page_indices)))
        assert mgr.sync_retrieve(0, TOKENS, local, seq.page_indices, seq.kv_transfer_info) > 0
        outcomes.append(error_of(lambda m=mgr, s=seq: m.notify_done(s)))
        mgr.cleanup()
    if engine == "shm":
        # No channel back to the owner: both say so, the same way.
        assert outcomes[0] is not None and outcomes[0][0] is kv.NotSupportedError
        assert "side channel" in outcomes[0][1]
        assert outcomes[0] == outcomes[1]
        return
    assert outcomes == [None, None]
    # The owner freed both sequences on the notices: a new pull fails stale.
    reader = kv.KVTransferManager(kv.TransferEngineInfo("d", "", engine, {"timeout": 10.0}),
                                  kv.KVCache(layout))
    for seq in peer.seqs[:2]:
        local = list(range(len(seq.page_indices)))
        for _ in range(100):
            try:
                reader.sync_retrieve(0, TOKENS, local, seq.page_indices, seq.kv_transfer_info)
            except kv.StaleDescriptorError:
                break
            import time
            time.sleep(0.05)
        else:
            pytest.fail(f"sequence {seq.seq_id} was not freed by its done notice")
    reader.cleanup()
