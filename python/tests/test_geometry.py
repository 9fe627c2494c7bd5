"""Caches of different geometry (KVLayout head shards, page sizes, orders):
a decode cache pulls from real prefill processes (peer.py) of another
tensor-parallel split, page size and in-page order, byte-exact by the
library's pattern (keyed by token position and model head)."""
import os
import pickle

import pytest

import mstar_kv as kv
from conftest import SEED

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

ENGINES = [e for e in ("shm", "ucx") if e in kv.built_engines()]
TOKENS = 100


def manager(engine, layout):
    cache = kv.KVCache(layout)
    return cache, kv.KVTransferManager(kv.TransferEngineInfo("decode", "", engine,
                                                             {"timeout": 10.0}), cache)


def test_layout_and_read_info_carry_the_new_fields():
    l = kv.KVLayout(2, 8, 16, 4, 64, total_kv_heads=8, first_kv_head=4)
    assert (l.total_kv_heads, l.first_kv_head, l.model_kv_heads) == (8, 4, 8)
    assert pickle.loads(pickle.dumps(l)) == l
    assert "heads 4-8 of 8" in repr(l)
    with pytest.raises(kv.InvalidArgumentError, match="out of range"):
        kv.KVLayout(2, 8, 16, 4, 64, total_kv_heads=8, first_kv_head=6)
    r = kv.KVReadInfo(0, 1, 2, 0, 8, remote_token_start=16, head_start=4, head_end=8)
    assert pickle.loads(pickle.dumps(r)) == r
    assert "remote_token_start=16" in repr(r)
    full = kv.KVLayout(2, 8, 64, 8, 64)
    reads = kv.plan_reads(l, 0, 40, [0, 1, 2], [5], remote_layout=full)
    assert [(x.local_page_idx, x.remote_token_start) for x in reads[:3]] == [(0, 0), (1, 16), (2, 32)]


@pytest.mark.parametrize("engine", ENGINES)
def test_tp1_to_tp2_with_other_pages_and_order(engine, peer_factory):
    # The prefill cache: all 4 heads, 16-token NHD pages.
    peer = peer_factory(engine, "--heads", "4", "--tokens", str(TOKENS))
    seq = peer.seqs[0]
    # Decode rank 1 of TP=2: heads 2-3, 32-token HND pages, page-major.
    local = kv.KVLayout(4, 16, 32, 2, 64, cache_order="page", page_order="hnd",
                        total_kv_heads=4, first_kv_head=2)
    cache, mgr = manager(engine, local)
    pages = [7, 3, 11, 0]
    with mgr:
        n = mgr.sync_retrieve(20, TOKENS, pages, seq.page_indices, seq.kv_transfer_info)
        assert n == (TOKENS - 20) * local.token_bytes * local.num_kv * local.num_layers
        assert cache.verify_pattern(SEED + 1, pages, 20, TOKENS)["ok"]


@pytest.mark.parametrize("engine", ENGINES)
def test_tp2_to_tp1_merge_from_two_peers(engine, peer_factory):
    p0 = peer_factory(engine, "--heads", "2", "--total-heads", "4", "--first-head", "0",
                      "--tokens", str(TOKENS))
    p1 = peer_factory(engine, "--heads", "2", "--total-heads", "4", "--first-head", "2",
                      "--page-size", "8", "--pages", "128", "--tokens", str(TOKENS))
    local = kv.KVLayout(4, 8, 64, 4, 64)
    cache, mgr = manager(engine, local)
    pages = [5, 2]
    with mgr:
        fut = mgr.start_async_retrieve_shards(0, TOKENS, pages, [p0.seqs[0], p1.seqs[0]])
        assert fut.result(timeout=30) == TOKENS * local.token_bytes * local.num_kv * local.num_layers
        assert cache.verify_pattern(SEED + 1, pages, 0, TOKENS)["ok"]
        with pytest.raises(kv.IncompatibleLayoutError, match=r"heads \[2, 4\) of 4 are held by none"):
            mgr.start_async_retrieve_shards(0, TOKENS, pages, [p0.seqs[0]])
