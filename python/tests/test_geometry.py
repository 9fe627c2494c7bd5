"""Caches of different geometry (KVLayout head shards, page sizes, orders):
a decode cache pulls from real prefill processes (peer.py) of another
tensor-parallel split, page size and in-page order, byte-exact by the
library's pattern (keyed by token position and model head)."""
import os
import pickle

import mstar_kv as kv
import pytest
from conftest import SEED

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

try:
    import mooncake.engine as mooncake_engine
except ImportError:
    mooncake_engine = None

ENGINES = [e for e in ("shm", "ucx") if e in kv.built_engines()]
TOKENS = 100


def manager(engine, layout):
    cache = kv.KVCache(layout)
    if engine == "mooncake":  # the PyPI wheel's TransferEngine, as the spec takes it
        te = mooncake_engine.TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        mgr = kv.KVTransferManager(kv.TransferEngineInfo("decode", "", te, {"timeout": 10.0}),
                                   cache)
        mgr._te = te
        return cache, mgr
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


@pytest.mark.parametrize("engine", ENGINES + ["mooncake"])
def test_tp1_to_tp2_with_other_pages_and_order(engine, peer_factory):
    if engine == "mooncake" and mooncake_engine is None:
        pytest.skip("the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")
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


# The third cache order, [layer][page][k|v] (upstream mstar's older KVCache
# [L, P, 2, T, H, D], vLLM FlashInfer's per-layer [blocks, 2, T, H, D]).
ORDERS = ("layer", "page", "layer_page")


def test_layer_page_layout_names_views_and_refusals():
    l = kv.KVLayout(3, 5, 4, 2, 8, cache_order="layer_page")
    assert l.cache_order == "layer_page"
    assert "layer-page-major" in repr(l)
    assert pickle.loads(pickle.dumps(l)) == l
    assert l != kv.KVLayout(3, 5, 4, 2, 8)
    assert l.view_shape == (3, 5, 2, 4, 2, 8)
    assert kv.KVLayout(3, 5, 4, 2, 8, cache_order="layer_page", page_order="hnd").view_shape == \
        (3, 5, 2, 2, 4, 8)
    mla = kv.KVLayout(3, 5, 4, 1, 8, has_v=False, cache_order="layer_page")
    assert mla.view_shape == (3, 5, 1, 4, 1, 8)
    assert mla != kv.KVLayout(3, 5, 4, 1, 8, has_v=False)  # same bytes, a distinct order
    with pytest.raises(kv.InvalidArgumentError,
                       match=r"unknown cache order 'layerpage' \(expected layer, page or layer_page\)"):
        kv.KVLayout(3, 5, 4, 2, 8, cache_order="layerpage")


@pytest.mark.parametrize("page_order", ["nhd", "hnd"])
def test_layer_page_wraps_its_tensor_without_a_copy(page_order):
    """A [L, P, 2, T, H, D] array (HND: [L, P, 2, H, T, D]) wraps as is; its
    elements are where the pattern of a layer-major cache, transposed, puts
    them; an array in another order's shape is refused naming the axes."""
    import numpy as np
    l = kv.KVLayout(3, 5, 4, 2, 8, dtype="fp16", cache_order="layer_page", page_order=page_order)
    arr = np.zeros(l.view_shape, dtype=np.float16)
    cache = kv.KVCache.from_dlpack(arr, l)
    assert cache.data_ptr == arr.ctypes.data
    assert tuple(cache.view_shape) == l.view_shape
    pages = [4, 0, 2]
    cache.fill_pattern(SEED, pages, 0, 11)
    ref = kv.KVCache(kv.KVLayout(3, 5, 4, 2, 8, dtype="fp16", page_order=page_order))
    ref.fill_pattern(SEED, pages, 0, 11)
    # layer-major [L, 2, P, ...] -> [L, P, 2, ...]
    assert np.array_equal(arr.view(np.uint16),
                          ref.numpy().view(np.uint16).transpose(0, 2, 1, 3, 4, 5))
    assert cache.verify_pattern(SEED, pages, 0, 11)["ok"]
    wrong = np.zeros(kv.KVLayout(3, 5, 4, 2, 8, dtype="fp16", page_order=page_order).view_shape,
                     dtype=np.float16)
    with pytest.raises(kv.InvalidArgumentError,
                       match=r"expected \[3, 5, 2, .*\[num_layers, num_pages, num_kv, "):
        kv.KVCache.from_dlpack(wrong, l)


def test_layer_page_wraps_a_torch_tensor_without_a_copy():
    torch = pytest.importorskip("torch")
    for po, shape in (("nhd", (4, 16, 2, 16, 2, 64)), ("hnd", (4, 16, 2, 2, 16, 64))):
        t = torch.zeros(shape, dtype=torch.bfloat16)
        l = kv.KVLayout(4, 16, 16, 2, 64, cache_order="layer_page", page_order=po)
        cache = kv.KVCache.from_dlpack(t, l)
        assert cache.data_ptr == t.data_ptr()
        cache.fill_pattern(SEED, [3], 0, 16)
        assert cache.verify_pattern(SEED, [3], 0, 16)["ok"]
        # Page 3 of every layer is axis 1 of the tensor; nothing else was written.
        assert int(t[:, 3].count_nonzero()) > t[:, 3].numel() // 2
        assert int(t[:, :3].count_nonzero()) == 0 and int(t[:, 4:].count_nonzero()) == 0


@pytest.mark.parametrize("engine", ENGINES + ["mooncake"])
def test_every_pair_of_cache_orders(engine, peer_factory):
    """Pulls between every pair of the three orders, byte-exact, nothing
    outside the named pages written: readers in the owner's geometry, and as
    TP rank 1 of 2 with other pages in the other in-page order, from a prefix
    hit mid-page."""
    from conftest import assert_only_pages_written, sentinel_fill
    if engine == "mooncake" and mooncake_engine is None:
        pytest.skip("the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")
    owners = []  # (what, layout, sequence)
    for rco in ORDERS:
        rpo = "hnd" if rco == "page" else "nhd"
        peer = peer_factory(engine, "--heads", "4", "--cache-order", rco, "--page-order", rpo,
                            "--tokens", str(TOKENS))
        owners.append((f"{rco}/{rpo}", rpo, peer.seqs[0]))
    for lco in ORDERS:
        for po in ("nhd", "hnd"):
            # In the owner's geometry (all 4 heads, 16-token pages) and as
            # TP rank 1 of 2 (heads 2-3) in 8- or 32-token pages.
            ps = 8 if lco == "layer_page" else 32
            for local, start in ((kv.KVLayout(4, 16, 16, 4, 64, cache_order=lco, page_order=po), 0),
                                 (kv.KVLayout(4, 16, ps, 2, 64, cache_order=lco, page_order=po,
                                              total_kv_heads=4, first_kv_head=2), 21)):
                n = (TOKENS + local.page_size - 1) // local.page_size
                pages = [(i * 5 + 3) % 16 for i in range(n)]
                cache, mgr = manager(engine, local)
                with mgr:
                    for what, rpo, seq in owners:
                        if (po == rpo) != (local.num_kv_heads == 4):
                            continue  # same geometry in the owner's page order, the split in the other
                        before = sentinel_fill(cache).copy()
                        n_bytes = mgr.sync_retrieve(start, TOKENS, pages, seq.page_indices,
                                                    seq.kv_transfer_info)
                        assert n_bytes == ((TOKENS - start) * local.token_bytes * local.num_kv *
                                           local.num_layers)
                        v = cache.verify_pattern(SEED + 1, pages, start, TOKENS)
                        assert v["ok"], f"{local!r} <- {what}: {v}"
                        assert_only_pages_written(before, cache.numpy().view("uint8"), local, pages)
