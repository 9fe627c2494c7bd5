"""Caches of one region per layer (KVCache.from_layer_tensors: vLLM's per-layer
tensors) and private caches served to other processes (the shm engine's
cross-memory attach): no copy when wrapping, every mismatch named, and pulls
between real processes byte-exact in every combination of caches."""
import os

import mstar_kv as kv
import numpy as np
import pytest
from conftest import SEED, TOKENS, check_layer_by_layer, local_layout, start_stream

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

SENTINEL = 0xA5


def layer_shape(layout):
    return [layout.num_kv, layout.num_pages, layout.page_size, layout.num_kv_heads,
            layout.head_dim]


def layer_arrays(layout, value=0):
    return [np.full(layer_shape(layout), value, dtype=np.uint16) for _ in range(layout.num_layers)]


def test_layer_tensors_are_wrapped_without_a_copy():
    layout = local_layout()
    arrays = layer_arrays(layout)
    cache = kv.KVCache.from_layer_tensors(arrays, layout)
    assert cache.split and cache.num_regions == 4
    assert cache.regions == [(a.ctypes.data, a.nbytes) for a in arrays]
    assert cache.size_bytes == layout.total_bytes
    assert "regions=4 (one per layer)" in repr(cache)
    # The pattern written through the cache lands in the caller's arrays.
    pages = [5, 1, 9, 2, 40, 33, 7]
    cache.fill_pattern(SEED, pages, 0, TOKENS)
    assert cache.verify_pattern(SEED, pages, 0, TOKENS)["ok"]
    assert all(a[:, pages[0]].any() for a in arrays), "a layer's array was not written"
    assert not arrays[3][:, 0].any(), "a page outside the table was written"
    # One region per layer has no single base or tensor view.
    with pytest.raises(kv.InvalidArgumentError, match="regions"):
        _ = cache.data_ptr
    with pytest.raises(kv.InvalidArgumentError, match="no one tensor view"):
        cache.numpy()
    # A one-region cache says so too.
    one = kv.KVCache(layout)
    assert not one.split and one.regions == [(one.data_ptr, layout.total_bytes)]


def test_flat_and_same_size_layer_tensors_are_accepted():
    layout = local_layout()
    flat = [np.zeros(layout.layer_bytes // 2, dtype=np.int16) for _ in range(4)]
    assert kv.KVCache.from_layer_tensors(flat, layout).num_regions == 4
    as_bytes = [np.zeros(layout.layer_bytes, dtype=np.uint8) for _ in range(4)]
    assert kv.KVCache.from_layer_tensors(tuple(as_bytes), layout).split


def test_every_mismatch_is_named():
    layout = local_layout()
    shape = layer_shape(layout)
    arrays = layer_arrays(layout)
    with pytest.raises(kv.InvalidArgumentError, match="got 3 tensors for the layout's 4 layers"):
        kv.KVCache.from_layer_tensors(arrays[:3], layout)
    bad = list(arrays)
    bad[2] = np.zeros([2, 32, 16, 2, 64], dtype=np.uint16)
    with pytest.raises(kv.InvalidArgumentError,
                       match=r"layer 2 tensor shape \[2, 32, 16, 2, 64\] does not match one layer "
                             r".*expected \[2, 64, 16, 2, 64\]"):
        kv.KVCache.from_layer_tensors(bad, layout)
    bad[2] = np.zeros(shape, dtype=np.float32)
    with pytest.raises(kv.InvalidArgumentError, match="layer 2 tensor dtype float32 does not match"):
        kv.KVCache.from_layer_tensors(bad, layout)
    bad[2] = np.zeros(shape[::-1], dtype=np.uint16).T  # the right shape, not C-contiguous
    with pytest.raises(kv.InvalidArgumentError, match="layer 2 tensor stride .* not C-contiguous"):
        kv.KVCache.from_layer_tensors(bad, layout)
    ro = np.zeros(shape, dtype=np.uint16)
    ro.setflags(write=False)
    bad[2] = ro
    with pytest.raises(kv.InvalidArgumentError, match="layer 2 tensor .* read-only"):
        kv.KVCache.from_layer_tensors(bad, layout)
    bad[2] = "not a tensor"
    with pytest.raises(kv.InvalidArgumentError, match="layer 2 tensor of type str is not a tensor"):
        kv.KVCache.from_layer_tensors(bad, layout)
    # Two layers in the same memory: a pull would write both into one.
    with pytest.raises(kv.InvalidArgumentError, match="layer 1 .* overlaps layer 0|overlaps"):
        kv.KVCache.from_layer_tensors([arrays[0], arrays[0], arrays[2], arrays[3]], layout)
    # A page-major cache's layers interleave: no per-layer regions.
    with pytest.raises(kv.InvalidArgumentError, match="page-major"):
        kv.KVCache.from_layer_tensors(arrays, local_layout(cache_order="page"))
    with pytest.raises(kv.InvalidArgumentError, match="list of per-layer tensors"):
        kv.KVCache.from_layer_tensors(5, layout)


def test_torch_layer_tensors_are_wrapped_in_place():
    torch = pytest.importorskip("torch")
    layout = local_layout()
    ts = [torch.zeros(layer_shape(layout), dtype=torch.bfloat16) for _ in range(4)]
    cache = kv.KVCache.from_layer_tensors(ts, layout)
    assert [a for a, _ in cache.regions] == [t.data_ptr() for t in ts]
    cache.fill_pattern(SEED, [3], 0, 16)
    bits = ts[1].view(torch.int16)
    assert (bits[:, 3] != 0).any() and not (bits[:, 4] != 0).any()
    with pytest.raises(kv.InvalidArgumentError, match=r"layer 0 tensor dtype float32"):
        kv.KVCache.from_layer_tensors([t.float() for t in ts], layout)
    with pytest.raises(kv.InvalidArgumentError, match=r"layer 0 tensor stride"):
        swapped = [2, 64, 2, 16, 64]  # the right shape once transposed, not contiguous
        kv.KVCache.from_layer_tensors(
            [torch.zeros(swapped, dtype=torch.bfloat16).transpose(2, 3) for _ in ts], layout)


def sentinel_cache(layout, kind):
    """A reader's cache of `kind` filled with the sentinel: shared, host or
    layers (numpy per layer)."""
    if kind == "layers":
        # The cache keeps its arrays alive.
        return kv.KVCache.from_layer_tensors(layer_arrays(layout, SENTINEL * 0x101), layout)
    cache = kv.KVCache(layout, kind)
    cache.numpy().view("uint8").reshape(-1)[:] = SENTINEL
    return cache


def bytes_of(cache):
    import ctypes
    return b"".join(ctypes.string_at(a, n) for a, n in cache.regions)


def manager(cache, engine):
    return kv.KVTransferManager(kv.TransferEngineInfo("decode", "", engine, {"timeout": 10.0}),
                                cache)


def pull_and_check(mgr, cache, seq, seed, prefix=0):
    local = [(7 * i + 3) % 64 for i in range(len(seq.page_indices))]
    before = bytes_of(cache)
    mgr.sync_retrieve(prefix, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
    assert cache.verify_pattern(seed, local, prefix, seq.num_tokens)["ok"]
    # Pages outside the local table kept the sentinel.
    layout = cache.layout
    untouched = next(p for p in range(64) if p not in local)
    bb = layout.block_bytes
    after = bytes_of(cache)
    for layer in range(layout.num_layers):
        off = (layer * layout.num_kv * layout.num_pages + untouched) * bb
        assert after[off:off + bb] == before[off:off + bb]


OWNER_MEMORIES = ["host", "layers", "torch", "torch-layers"]


@pytest.mark.parametrize("owner", OWNER_MEMORIES)
def test_a_private_owner_serves_same_host_readers_over_shm(peer_factory, owner):
    if owner.startswith("torch"):
        pytest.importorskip("torch")
    peer = peer_factory("shm", "--memory", owner)
    seq = peer.seqs[0]
    info = kv.ShmKVTransferInfo.decode(seq.kv_transfer_info)
    assert info.access == "cma"
    assert len(info.regions) == (4 if owner.endswith("layers") else 1)
    for reader in ("shared", "host", "layers"):
        cache = sentinel_cache(local_layout(), reader)
        with manager(cache, "shm") as mgr:
            pull_and_check(mgr, cache, seq, SEED + 1, prefix=20)
    # A new engine on the same cache (a new anchor): the old descriptor is stale.
    old = peer.seqs[1]
    new = peer.restart()[1]
    cache = sentinel_cache(local_layout(), "host")
    with manager(cache, "shm") as mgr:
        with pytest.raises(kv.StaleDescriptorError, match="engine shut down"):
            mgr.sync_retrieve(0, old.num_tokens, list(range(len(old.page_indices))),
                              old.page_indices, old.kv_transfer_info)
        pull_and_check(mgr, cache, new, SEED + 2)


def _mapped_owner_files():
    with open("/proc/self/maps") as f:
        return sum("memfd:mstar-kv-private" in line for line in f)


@pytest.mark.parametrize("owner", ["torch", "torch-layers"])
def test_a_torch_owner_mapped_in_place_serves_readers_through_its_pages(peer_factory, owner):
    """shm_map_private (docs/engines/shm.md): the owner's torch tensors keep
    their addresses and bytes, their whole pages move into a memfd, and a
    reader maps those pages (its /proc/self/maps shows them) instead of
    copying by cross-memory attach."""
    pytest.importorskip("torch")
    peer = peer_factory("shm", "--memory", owner, env={"MSTAR_KV_SHM_MAP_PRIVATE": "on"})
    seq = peer.seqs[0]
    info = kv.ShmKVTransferInfo.decode(seq.kv_transfer_info)
    assert info.access == "cma" and info.backed, info
    before = _mapped_owner_files()
    for reader in ("host", "layers"):
        cache = sentinel_cache(local_layout(), reader)
        with manager(cache, "shm") as mgr:
            pull_and_check(mgr, cache, seq, SEED + 1, prefix=20)
            assert _mapped_owner_files() == before + 1
    assert _mapped_owner_files() == before


def test_a_private_owner_streams_layer_by_layer_over_shm(peer_factory):
    peer = peer_factory("shm", "--memory", "layers")
    cache = sentinel_cache(local_layout(), "layers")
    with manager(cache, "shm") as mgr:
        seq = start_stream(peer, 150, 4)
        local = list(range(len(seq.page_indices)))
        stream = mgr.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                              seq.kv_transfer_info)
        check_layer_by_layer(stream, 4, seq.num_tokens * local_layout().token_bytes * 2 * 4,
                             cache, local, seq.num_tokens)


@pytest.mark.parametrize("engine", ["ucx", "mooncake"])
def test_layer_split_caches_over_the_remote_engines(peer_factory, engine):
    if engine == "ucx" and "ucx" not in kv.built_engines():
        pytest.skip("the ucx engine is not built")
    if engine == "mooncake":
        te_mod = pytest.importorskip("mooncake.engine")
    peer = peer_factory(engine, "--memory", "layers")
    seq = peer.seqs[0]
    for reader in ("host", "layers"):
        cache = sentinel_cache(local_layout(), reader)
        if engine == "ucx":
            mgr = manager(cache, "ucx")
        else:
            te = te_mod.TransferEngine()
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            mgr = kv.KVTransferManager(kv.MooncakeKVTransferEngine(cache, "decode", te), cache)
        with mgr:
            pull_and_check(mgr, cache, seq, SEED + 1, prefix=20)
