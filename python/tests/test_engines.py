"""Two real processes: a prefill peer (peer.py) publishes, this process pulls
over shm, UCX (tcp) and Mooncake (the PyPI wheel), and every byte is checked."""
import os
import time

import mstar_kv as kv
import numpy as np
import pytest
from conftest import SEED, TOKENS, assert_only_pages_written, local_layout, sentinel_fill

# UCX over TCP on loopback, in this process and in the peers it starts.
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

try:
    import mooncake.engine as mooncake_engine
except ImportError:
    mooncake_engine = None

ENGINES = ["shm", "ucx", "mooncake"]


def make_reader(engine, cache, timeout=10.0):
    if engine == "shm":
        return kv.KVTransferManager(kv.TransferEngineInfo("decode", "", "shm"), cache)
    if engine == "ucx":
        return kv.KVTransferManager(
            kv.TransferEngineInfo("decode", "", "ucx", {"timeout": timeout}), cache)
    if mooncake_engine is None:
        pytest.skip("the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")
    te = mooncake_engine.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("decode", "", te, {"timeout": timeout}),
                               cache)
    mgr._te = te  # keep the application's engine alive as long as the manager
    return mgr


@pytest.fixture(params=ENGINES)
def engine(request):
    if request.param == "mooncake" and mooncake_engine is None:
        pytest.skip("the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")
    return request.param


def test_full_pull_every_byte(engine, peer_factory):
    peer = peer_factory(engine)
    seq = peer.seqs[0]
    cache = kv.KVCache(local_layout())
    before = sentinel_fill(cache).copy()
    mgr = make_reader(engine, cache)
    local = list(range(10, 10 + len(seq.page_indices)))  # another page table than the peer's
    fut = mgr.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                   seq.kv_transfer_info)
    n = fut.result(timeout=30)
    layout = cache.layout
    # 100 tokens: 6 full pages + 4 tokens of the 7th, K and V, every layer.
    assert n == layout.num_layers * 2 * TOKENS * layout.token_bytes
    res = cache.verify_pattern(SEED + 1, local, 0, seq.num_tokens)
    assert res["ok"], res["first_mismatch"]
    assert_only_pages_written(before, cache.numpy().view(np.uint8), layout, local)
    mgr.cleanup()


def test_prefix_hit_pulls_only_the_tail(engine, peer_factory):
    peer = peer_factory(engine)
    seq = peer.seqs[1]
    cache = kv.KVCache(local_layout())
    mgr = make_reader(engine, cache)
    local = list(range(len(seq.page_indices)))
    start = 75  # 75 tokens cached: the pull starts inside page 4
    sentinel_fill(cache, 0x11)
    n = mgr.sync_retrieve(start, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
    layout = cache.layout
    assert n == layout.num_layers * 2 * (TOKENS - start) * layout.token_bytes
    assert cache.verify_pattern(SEED + 2, local, start, seq.num_tokens)["ok"]
    # Tokens before `start` were not touched: still the sentinel.
    a = cache.numpy().view(np.uint8)
    assert np.all(a[0, 0, local[4], :start - 64] == 0x11)
    assert np.all(a[:, :, local[0]] == 0x11)
    mgr.cleanup()


def test_bad_descriptor_rejected_before_any_byte(engine, peer_factory):
    peer = peer_factory(engine)
    seq = peer.seqs[0]
    cache = kv.KVCache(local_layout(head_dim=32))  # incompatible with the peer's 64
    before = sentinel_fill(cache).copy()
    mgr = make_reader(engine, cache)
    with pytest.raises(kv.IncompatibleLayoutError, match="head_dim"):
        mgr.start_async_retrieve(0, seq.num_tokens, list(range(7)), seq.page_indices,
                                 seq.kv_transfer_info)
    assert np.array_equal(cache.numpy().view(np.uint8).reshape(-1), before)
    good = kv.KVCache(local_layout())
    before = sentinel_fill(good).copy()
    mgr2 = make_reader(engine, good)
    # Named by the caller's table entry, not an index into the plan.
    with pytest.raises(kv.InvalidArgumentError,
                       match=r"remote page 99 \(table entry 0\) out of range"):
        mgr2.start_async_retrieve(0, 16, [0], [99], seq.kv_transfer_info)
    with pytest.raises(kv.InvalidArgumentError,
                       match=r"local page 3 appears twice in the local page table \(entries 0 "
                             r"and 1\)"):
        mgr2.start_async_retrieve(0, 32, [3, 3], seq.page_indices[:2], seq.kv_transfer_info)
    with pytest.raises(kv.InvalidArgumentError, match=r"0 <= start < end <= 16"):
        mgr2.engine.read_batched_async(seq.kv_transfer_info, [kv.KVReadInfo(0, 0, 0, 0, 17)])
    assert np.array_equal(good.numpy().view(np.uint8).reshape(-1), before)


def test_dead_peer_fails_in_bounded_time(engine, peer_factory):
    peer = peer_factory(engine)
    seq = peer.seqs[0]
    cache = kv.KVCache(local_layout())
    mgr = make_reader(engine, cache, timeout=5.0)
    local = list(range(len(seq.page_indices)))
    assert mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices,
                             seq.kv_transfer_info) > 0  # connected, verified
    peer.kill()
    t0 = time.monotonic()
    with pytest.raises((kv.NotFoundError, kv.PeerFailureError, kv.TransferTimeoutError)):
        fut = mgr.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                       seq.kv_transfer_info)
        fut.result(timeout=60)
    assert time.monotonic() - t0 < 30
    mgr.cleanup()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_restarted_peer_descriptor_is_stale(engine, peer_factory):
    if engine == "ucx":  # the new engine listens where the old one did
        peer = peer_factory(engine, "--session", f"127.0.0.1:{_free_port()}",
                            env={"UCX_TCP_CM_REUSEADDR": "y"})
    else:
        peer = peer_factory(engine)
    old = peer.seqs[0]
    new = peer.restart()[0]  # same process and cache, new engine: new generation
    assert old.kv_transfer_info != new.kv_transfer_info
    cache = kv.KVCache(local_layout())
    mgr = make_reader(engine, cache)
    local = list(range(len(old.page_indices)))
    # shm: the old memfd is gone (NotFound) or its fd now holds the new cache (Stale).
    # mooncake: the old identity page is no longer registered, and Mooncake cannot tell
    # a stale address from a gone owner (PeerFailure, as the C++ Mooncake engine says).
    stale = {"shm": (kv.StaleDescriptorError, kv.NotFoundError),
             "ucx": kv.StaleDescriptorError, "mooncake": kv.PeerFailureError}[engine]
    before = sentinel_fill(cache).copy()
    with pytest.raises(stale):
        f = mgr.start_async_retrieve(0, old.num_tokens, local, old.page_indices,
                                     old.kv_transfer_info)
        f.result(timeout=30)
    assert np.array_equal(cache.numpy().view(np.uint8).reshape(-1), before)
    assert mgr.sync_retrieve(0, new.num_tokens, local, new.page_indices,
                             new.kv_transfer_info) > 0
    assert cache.verify_pattern(SEED + 1, local, 0, new.num_tokens)["ok"]


def test_two_requests_concurrently(engine, peer_factory):
    peer = peer_factory(engine)
    cache = kv.KVCache(local_layout())
    mgr = make_reader(engine, cache)
    futs = []
    for i, seq in enumerate(peer.seqs):
        local = list(range(20 * i, 20 * i + len(seq.page_indices)))
        futs.append((seq, local, mgr.start_async_retrieve(0, seq.num_tokens, local,
                                                          seq.page_indices,
                                                          seq.kv_transfer_info)))
    for i, (seq, local, f) in enumerate(futs):
        assert f.result(timeout=30) > 0
        assert cache.verify_pattern(SEED + 1 + i, local, 0, seq.num_tokens)["ok"]
