"""KVTransferManager.connect: what a first pull from a peer would open (the
ucx connection and handshake, the shm attach) is opened ahead of it, once;
the pull then adds no connection. A dead or absent owner is an error in
bounded time, never a hang; a local-only descriptor is refused."""
import os
import time

import mstar_kv as kv
import pytest
from conftest import SEED, TOKENS, local_layout


def _ucx_or_skip():
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if "ucx" not in kv.built_engines():
        pytest.skip("the ucx engine is not built")


def _served_connected(owner, want, timeout=10.0):
    deadline = time.monotonic() + timeout
    while owner.stats()["served"]["readers_connected"] < want and time.monotonic() < deadline:
        time.sleep(0.01)
    return owner.stats()["served"]["readers_connected"]


def test_ucx_connect_ahead_then_the_pull_adds_no_connection():
    _ucx_or_skip()
    cache = kv.KVCache(local_layout(), "host")
    owner = kv.KVTransferManager(kv.TransferEngineInfo("owner", "", "ucx", {"timeout": 10}),
                                 cache)
    pool = kv.KVCachePool(cache, owner.get_kv_transfer_info(), scatter_seed=3)
    pool.allocate(1, TOKENS)
    cache.fill_pattern(SEED + 2, pool.pages(1), 0, TOKENS)
    seq = pool.publish(1)
    local_cache = kv.KVCache(local_layout())
    reader = kv.KVTransferManager(kv.TransferEngineInfo("reader", "", "ucx", {"timeout": 10}),
                                  local_cache)
    try:
        assert owner.stats()["served"]["readers_connected"] == 0
        reader.connect(owner.get_kv_transfer_info())  # the cache's descriptor: no epoch
        assert _served_connected(owner, 1) == 1
        assert reader.stats()["total"]["reads_started"] == 0  # not a read
        reader.connect(seq.kv_transfer_info)  # a sequence's: the same peer, kept
        local = list(range(len(seq.page_indices)))
        reader.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
        assert local_cache.verify_pattern(SEED + 2, local, 0, seq.num_tokens)["ok"]
        assert owner.stats()["served"]["readers_connected"] == 1
    finally:
        reader.cleanup()
        owner.cleanup()


def test_ucx_connect_to_a_gone_owner_fails_in_bounded_time():
    _ucx_or_skip()
    owner = kv.KVTransferManager(kv.TransferEngineInfo("owner", "", "ucx", {"timeout": 10}),
                                 kv.KVCache(local_layout(), "host"))
    info = owner.get_kv_transfer_info()
    owner.cleanup()  # its listener is closed
    reader = kv.KVTransferManager(kv.TransferEngineInfo("reader", "", "ucx", {"timeout": 3}),
                                  kv.KVCache(local_layout()))
    try:
        t0 = time.monotonic()
        with pytest.raises(kv.KVTransferError):
            reader.connect(info)
        assert time.monotonic() - t0 < 10
    finally:
        reader.cleanup()


def test_shm_connect_attaches_ahead_and_fails_once_the_owner_died(peer_factory):
    peer = peer_factory("shm")
    seq = peer.seqs[0]
    cache = kv.KVCache(local_layout())
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("reader", "", "shm"), cache)
    try:
        mgr.connect(seq.kv_transfer_info)
        local = list(range(len(seq.page_indices)))
        mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
        assert cache.verify_pattern(SEED + seq.seq_id, local, 0, seq.num_tokens)["ok"]
        peer.kill()
        t0 = time.monotonic()
        with pytest.raises(kv.KVTransferError):  # it opens the owner: a dead one is an error
            mgr.connect(seq.kv_transfer_info)
        assert time.monotonic() - t0 < 10
    finally:
        mgr.cleanup()


def test_connect_to_a_local_only_descriptor_is_refused():
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("reader", "", "shm"),
                               kv.KVCache(local_layout()))
    try:
        with pytest.raises(kv.InvalidArgumentError, match="local-only"):
            mgr.connect(kv.KVTransferInfo())
    finally:
        mgr.cleanup()
