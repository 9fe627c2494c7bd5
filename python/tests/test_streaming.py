"""Layer-wise streaming from Python against a real, deliberately slow owner
process (peer.py "stream"): not-ready layers hold poison, so a read of a
layer before the owner marked it would fail the byte-exact verify."""
import concurrent.futures
import os
import time

import mstar_kv as kv
import pytest
from conftest import TOKENS, check_layer_by_layer, local_layout, read_marks, start_stream

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

SENTINEL = 0xA5


def sentinel_cache():
    import ctypes
    cache = kv.KVCache(local_layout())
    ctypes.memset(cache.data_ptr, SENTINEL, cache.size_bytes)
    return cache


def manager(cache, engine="shm", timeout=5.0):
    return kv.KVTransferManager(kv.TransferEngineInfo("decode", "", engine, {"timeout": timeout}),
                                cache)


def test_pool_marks_layers_monotonically():
    cache = kv.KVCache(local_layout(), "host")
    pool = kv.KVCachePool(cache, None)
    pool.allocate(1, TOKENS)
    pool.publish(1, layers_ready=0)
    assert pool.layers_ready(1) == 0
    pool.mark_layers_ready(1, 2)
    pool.mark_layers_ready(1, 2)  # the same again: a no-op
    with pytest.raises(kv.InvalidArgumentError, match="would go backwards from 2"):
        pool.mark_layers_ready(1, 1)
    with pytest.raises(kv.InvalidArgumentError, match="5 layers ready is beyond the layout's 4"):
        pool.mark_layers_ready(1, 5)
    with pytest.raises(kv.NotFoundError):
        pool.mark_layers_ready(9, 1)
    pool.publish(1)  # a finished sequence: every layer
    assert pool.layers_ready(1) == 4


@pytest.mark.parametrize("engine", ["shm", "ucx"])
def test_streamed_pull_waits_for_each_layer_and_is_byte_exact(peer_factory, engine):
    if engine not in kv.built_engines():
        pytest.skip(f"the {engine} engine is not built")
    peer = peer_factory(engine)
    cache = sentinel_cache()
    with manager(cache, engine) as mgr:  # before the owner starts marking
        seq = start_stream(peer, 150, 4)
        local = list(range(len(seq.page_indices)))
        stream = mgr.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                              seq.kv_transfer_info)
        # Layer by layer, about 150 ms apart: not all at the end.
        check_layer_by_layer(stream, 4, TOKENS * 2 * 2 * 64 * 2 * 4, cache, local, TOKENS)
    assert read_marks(peer, 4) == [0, 1, 2, 3]


@pytest.mark.skipif("shm" not in kv.built_engines(), reason="the shm engine is not built")
def test_a_layer_never_marked_times_out_and_cancel_stops(peer_factory):
    peer = peer_factory("shm")
    seq = start_stream(peer, 0, 1)  # layers 1..3 never marked
    cache = sentinel_cache()
    local = list(range(len(seq.page_indices)))
    with manager(cache) as mgr:
        stream = mgr.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                              seq.kv_transfer_info, ready_timeout=0.5)
        assert stream.wait_for_layer(0, timeout=10)
        assert stream.wait_for_layer(1, timeout=0.05) is False  # still waiting
        with pytest.raises(kv.TransferTimeoutError, match="layer 1 of 4"):
            stream.wait_for_layer(1, timeout=10)
        with pytest.raises(kv.TransferTimeoutError):
            stream.future.result(timeout=10)
    peer2 = peer_factory("shm")
    seq2 = start_stream(peer2, 300, 4)
    with manager(sentinel_cache()) as mgr:
        stream = mgr.start_streaming_retrieve(0, seq2.num_tokens, local, seq2.page_indices,
                                              seq2.kv_transfer_info)
        assert stream.wait_for_layer(0, timeout=10)
        stream.cancel()
        # A cancelled read is a cancelled concurrent.futures.Future.
        with pytest.raises(concurrent.futures.CancelledError):
            stream.future.result(timeout=2)
        assert stream.future.cancelled()
        with pytest.raises(kv.TransferCancelledError):
            stream.wait_for_layer(3, timeout=1)


# shm sees the owner's process gone (NotFoundError); over ucx, where the
# readiness comes in notices from the owner, the lost connection tells.
@pytest.mark.parametrize("engine,error", [("shm", kv.NotFoundError), ("ucx", kv.PeerFailureError)])
def test_owner_death_mid_stream_fails_the_stream(peer_factory, engine, error):
    if engine not in kv.built_engines():
        pytest.skip(f"the {engine} engine is not built")
    peer = peer_factory(engine)
    seq = start_stream(peer, 200, 4)
    local = list(range(len(seq.page_indices)))
    with manager(sentinel_cache(), engine) as mgr:
        stream = mgr.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                              seq.kv_transfer_info)
        assert stream.wait_for_layer(0, timeout=10)
        peer.kill()
        t0 = time.monotonic()
        with pytest.raises(error):
            stream.future.result(timeout=10)
        assert time.monotonic() - t0 < 2