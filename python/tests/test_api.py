"""The spec's names and value types: construction, equality, repr, pickling,
and bad input rejected with the value and its limit."""
import inspect
import pickle

import mstar_kv as kv
import pytest
from conftest import local_layout


def test_spec_names_exist():
    for name in ("CudaIpcKVTransferEngine", "CudaIpcKVTransferInfo", "KVReadInfo",
                 "KVTransferEngine", "KVTransferManager", "LocalOnlyKVTransferEngine",
                 "MooncakeKVTransferEngine", "MooncakeKVTransferInfo", "TransferEngineInfo"):
        assert hasattr(kv, name), name
    assert inspect.isabstract(kv.KVTransferEngine)
    assert set(kv.KVTransferEngine.__abstractmethods__) == {
        "get_kv_transfer_info", "read_batched_async", "shutdown"}
    sig = inspect.signature(kv.KVTransferManager.start_async_retrieve)
    assert list(sig.parameters)[1:] == ["start_len", "end_len", "local_page_indices",
                                        "remote_page_indices", "kv_transfer_info"]
    assert list(inspect.signature(kv.CudaIpcKVTransferEngine).parameters)[:2] == [
        "kv_cache", "max_workers"]
    assert inspect.signature(kv.CudaIpcKVTransferEngine).parameters["max_workers"].default == 3
    assert list(inspect.signature(kv.MooncakeKVTransferEngine).parameters)[:3] == [
        "kv_cache", "entity_id", "transfer_engine"]
    assert list(inspect.signature(kv.CudaIpcKVTransferInfo).parameters)[:7] == [
        "cuda_share", "size", "stride", "offset", "dtype", "requires_grad", "layout"]
    assert list(inspect.signature(kv.TransferEngineInfo).parameters)[:3] == [
        "my_entity_id", "my_session_id", "transfer_engine"]


def test_kv_read_info_keywords_equality_repr_pickle():
    r = kv.KVReadInfo(layer_idx=3, local_page_idx=1, remote_page_idx=9, token_start=2,
                      token_end=16)
    assert (r.layer_idx, r.local_page_idx, r.remote_page_idx, r.token_start, r.token_end) == (
        3, 1, 9, 2, 16)
    assert r == kv.KVReadInfo(3, 1, 9, 2, 16)
    assert r != kv.KVReadInfo(3, 1, 9, 2, 15)
    assert r != "not a read"
    assert repr(r) == ("KVReadInfo(layer_idx=3, local_page_idx=1, remote_page_idx=9, "
                       "token_start=2, token_end=16)")
    assert pickle.loads(pickle.dumps(r)) == r


def test_layout_fields_and_errors():
    l = kv.KVLayout(num_layers=32, num_pages=1024, page_size=16, num_kv_heads=8, head_dim=128,
                    dtype="bf16", cache_order="page", page_order="hnd")
    assert (l.dtype, l.cache_order, l.page_order) == ("bf16", "page", "hnd")
    assert l.block_bytes == 16 * 8 * 128 * 2
    assert l.total_bytes == 32 * 2 * 1024 * l.block_bytes
    assert pickle.loads(pickle.dumps(l)) == l
    assert "32L x 1024P x 16T x 8H x 128D bf16" in repr(l)
    with pytest.raises(kv.InvalidArgumentError, match=r"num_layers 0 out of range \[1, 4096\]") as e:
        kv.KVLayout(0, 8, 16, 8, 128)
    assert e.value.code == kv.StatusCode.INVALID_ARGUMENT
    assert isinstance(e.value, ValueError)
    with pytest.raises(kv.InvalidArgumentError, match="fp7"):
        kv.KVLayout(1, 8, 16, 8, 128, dtype="fp7")
    with pytest.raises(kv.IncompatibleLayoutError, match="head_dim: local 128, remote 64"):
        l.check_compatible(kv.KVLayout(32, 1024, 16, 8, 64))


def test_descriptors_round_trip_and_reject_garbage():
    seq = kv.SequenceInfo(seq_id=5, num_tokens=40, page_indices=[3, 1, 2],
                          kv_transfer_info=kv.KVTransferInfo("shm", b"\x01\x02"), page_size=16)
    data = seq.to_bytes()
    assert kv.SequenceInfo.from_bytes(data) == seq
    assert pickle.loads(pickle.dumps(seq)) == seq
    assert kv.SequenceInfo.from_bytes(data).page_indices == [3, 1, 2]
    with pytest.raises(kv.CorruptDescriptorError):
        kv.SequenceInfo.from_bytes(b"not a descriptor at all")
    for i in range(len(data)):  # every truncation
        with pytest.raises(kv.CorruptDescriptorError):
            kv.SequenceInfo.from_bytes(data[:i])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x40
    with pytest.raises(kv.CorruptDescriptorError):
        kv.SequenceInfo.from_bytes(bytes(flipped))
    with pytest.raises(kv.InvalidArgumentError, match=r"page_indices\[1\] = -1 out of range"):
        kv.SequenceInfo(seq_id=1, num_tokens=1, page_indices=[0, -1], page_size=16)
    # The page count must match the tokens at the page size.
    for tokens, pages in ((100, [0]), (1, [0, 1, 2, 3, 4])):
        bad = kv.SequenceInfo(seq_id=1, num_tokens=tokens, page_indices=pages, page_size=16)
        with pytest.raises(kv.CorruptDescriptorError,
                           match=rf"{len(pages)} pages for {tokens} tokens of page size 16"):
            kv.SequenceInfo.from_bytes(bad.to_bytes())


def test_infos_pickle_through_bytes_and_refuse_other_engines():
    layout = local_layout()
    m = kv.MooncakeKVTransferInfo("prefill", "127.0.0.1:1234", 0x10000, layout,
                                  layout.total_bytes, 77, 0x20000, 0x30000, 0x40000)
    assert pickle.loads(pickle.dumps(m)) == m
    assert kv.MooncakeKVTransferInfo.decode(m.encode()) == m
    assert kv.MooncakeKVTransferInfo.from_bytes(m.to_bytes()) == m
    with pytest.raises(kv.InvalidArgumentError, match="not a Mooncake descriptor"):
        kv.MooncakeKVTransferInfo.decode(kv.KVTransferInfo("shm", b"x"))
    with pytest.raises(kv.InvalidArgumentError, match="'mooncake'"):
        kv.ShmKVTransferInfo.decode(m.encode())
    g = kv.KVTransferInfo("ucx", b"payload")
    assert pickle.loads(pickle.dumps(g)) == g
    assert kv.KVTransferInfo.from_bytes(g.to_bytes()) == g


def test_pool_allocate_free_publish():
    cache = kv.KVCache(local_layout(num_pages=8))
    pool = kv.KVCachePool(cache, kv.KVTransferInfo("shm", b"d"))
    pages = pool.allocate(1, 33)  # 3 pages of 16 tokens
    assert len(pages) == 3 and 1 in pool
    seq = pool.publish(1)
    assert seq.page_indices == pages and seq.num_tokens == 33
    # The descriptor on a SequenceInfo also carries that sequence's page epoch.
    assert seq.kv_transfer_info.engine == "shm" and seq.kv_transfer_info.payload == b"d"
    assert seq.kv_transfer_info.epoch != 0
    with pytest.raises(kv.RetryLaterError):
        pool.allocate(2, 16 * 6)
    pool.free(1)
    assert pool.free_page_count() == 8
    with pytest.raises(kv.InvalidArgumentError):
        pool.free(1)


def test_manager_bad_inputs_before_any_byte(peer_factory):
    cache = kv.KVCache(local_layout())
    m = kv.KVTransferManager(kv.TransferEngineInfo("decode", "", "shm"), cache)
    # Each side's table in its own page size (caches of different geometry):
    # the tables need not be as long as each other, but each must cover end_len.
    with pytest.raises(kv.InvalidArgumentError, match="local page table has 1 entries"):
        m.start_async_retrieve(0, 32, [0], [0, 1, 2], kv.KVTransferInfo("shm", b""))
    with pytest.raises(kv.InvalidArgumentError, match=r"local page 99 .* out of range \[0, 64\)"):
        m.start_async_retrieve(0, 32, [0, 99], [0, 1], kv.KVTransferInfo("shm", b""))
    with pytest.raises(kv.InvalidArgumentError, match="not an int"):
        m.start_async_retrieve(0, 32, [0, "x"], [0, 1], kv.KVTransferInfo("shm", b""))
    with pytest.raises(kv.InvalidArgumentError, match="is not a descriptor"):
        m.start_async_retrieve(0, 32, [0, 1], [0, 1], 12345)
    with pytest.raises(kv.CorruptDescriptorError):
        m.start_async_retrieve(0, 32, [0, 1], [0, 1], b"garbage bytes")
    with pytest.raises(kv.InvalidArgumentError, match="'ucx'"):
        m.start_async_retrieve(0, 32, [0, 1], [0, 1], kv.KVTransferInfo("ucx", b"x"))
    # An empty range is validated first too: this descriptor is
    # no shm descriptor, and the tables must cover end_len.
    with pytest.raises(kv.CorruptDescriptorError):
        m.start_async_retrieve(16, 16, [0, 1], [0, 1], kv.KVTransferInfo("shm", b""))
    with pytest.raises(kv.InvalidArgumentError, match="'ucx'"):
        m.start_async_retrieve(0, 0, [], [], kv.KVTransferInfo("ucx", b"x"))
    owner = kv.KVTransferManager(kv.TransferEngineInfo("prefill", "", "shm"),
                                 kv.KVCache(local_layout(), memory="shared"))
    desc = owner.get_kv_transfer_info()
    with pytest.raises(kv.InvalidArgumentError, match=r"local page 99 .* out of range \[0, 64\)"):
        m.start_async_retrieve(20, 20, [0, 99], [0, 1], desc)
    with pytest.raises(kv.InvalidArgumentError, match="local page table has 1 entries"):
        m.start_async_retrieve(20, 20, [0], [0], desc)
    assert m.start_async_retrieve(16, 16, [0, 1], [0, 1], desc) is None
    narrow = kv.KVTransferManager(kv.TransferEngineInfo("decode", "", "shm"),
                                  kv.KVCache(local_layout(head_dim=32)))
    with pytest.raises(kv.IncompatibleLayoutError, match="head_dim"):
        narrow.start_async_retrieve(16, 16, [0, 1], [0, 1], desc)
    narrow.cleanup()
    owner.cleanup()
    m.cleanup()
    m.cleanup()  # idempotent
    with pytest.raises(kv.ShutdownError, match="after cleanup"):
        m.start_async_retrieve(0, 32, [0, 1], [0, 1], kv.KVTransferInfo("shm", b""))
    with pytest.raises(kv.InvalidArgumentError, match="not an mstar_kv.KVCache"):
        kv.KVTransferManager(None, object())
    with pytest.raises(kv.InvalidArgumentError, match="unknown transfer engine 'warp'"):
        kv.KVTransferManager(kv.TransferEngineInfo("d", "", "warp"), cache)


def test_engines_reject_unknown_keys_of_their_prefix():
    """A typo in an engine's own option is refused, naming the known ones;
    other engines' keys and the shared auth_token are not its business."""
    cache = kv.KVCache(local_layout())
    with pytest.raises(kv.InvalidArgumentError,
                       match=r"unknown shm option 'shm_max_wokers' .*known shm_\* options: "
                             r"shm_map_private"):
        kv.KVTransferManager(kv.TransferEngineInfo("d", "", "shm", {"shm_max_wokers": "2"}),
                             cache)
    m = kv.KVTransferManager(kv.TransferEngineInfo(
        "d", "", "shm", {"auth_token": "x", "ucx_mode": "am", "cuda_ipc_batch": "0"}), cache)
    m.cleanup()
    if "cuda_ipc" in kv.built_engines():
        with pytest.raises(kv.InvalidArgumentError,
                           match=r"unknown cuda_ipc option 'cuda_ipc_bach'.*cuda_ipc_batch, "
                                 r"cuda_ipc_check_owner_pid"):
            kv.KVTransferManager(kv.TransferEngineInfo("d", "", "cuda_ipc",
                                                       {"cuda_ipc_bach": "0"}), cache)


def test_local_only_manager():
    cache = kv.KVCache(local_layout())
    m = kv.KVTransferManager(None, cache)
    assert isinstance(m.engine, kv.LocalOnlyKVTransferEngine)
    assert m.get_kv_transfer_info() is None
    assert m.start_async_retrieve(0, 0, [], [], None) is None
    assert m.sync_retrieve(0, 0, [], [], None) == 0
    # An empty range is validated first.
    with pytest.raises(kv.InvalidArgumentError, match=r"local page 99 .* out of range"):
        m.start_async_retrieve(20, 20, [0, 99], [0, 1], None)
    with pytest.raises(kv.InvalidArgumentError, match="cannot read a 'shm' descriptor"):
        m.start_async_retrieve(0, 0, [], [], kv.KVTransferInfo("shm", b"x"))
    with pytest.raises(kv.InvalidArgumentError, match="local-only"):
        m.start_async_retrieve(0, 16, [0], [0], None)
    e = kv.LocalOnlyKVTransferEngine()
    with pytest.raises(kv.KVTransferError):
        e.read_batched_async(kv.KVTransferInfo("shm", b""), [kv.KVReadInfo(0, 0, 0, 0, 16)])


def test_errors_pickle_and_carry_the_code():
    e = kv.errors.error_from_code(int(kv.StatusCode.PEER_FAILURE), "peer 'a' died")
    assert isinstance(e, kv.PeerFailureError) and isinstance(e, ConnectionError)
    e2 = pickle.loads(pickle.dumps(e))
    assert type(e2) is kv.PeerFailureError and e2.message == "peer 'a' died"
    assert e2.code == kv.StatusCode.PEER_FAILURE
    assert issubclass(kv.TransferTimeoutError, TimeoutError)
    assert issubclass(kv.StaleDescriptorError, kv.KVTransferError)


def test_engine_infos_of_live_engines_pickle():
    import os
    os.environ.setdefault("UCX_TLS", "tcp")
    cache = kv.KVCache(local_layout(num_pages=8))
    ucx = kv.UcxKVTransferEngine(cache, entity_id="e1")
    u = kv.UcxKVTransferInfo.decode(ucx.get_kv_transfer_info())
    assert u.entity_id == "e1" and u.session_id == ucx.session_id
    # No remote key without RDMA unless the owner allows emulated gets.
    assert pickle.loads(pickle.dumps(u)) == u and len(u.rkey) == 0
    ucx.shutdown()
    ucx = kv.UcxKVTransferEngine(cache, entity_id="e1", options={"ucx_emulated_gets": "on"})
    u = kv.UcxKVTransferInfo.decode(ucx.get_kv_transfer_info())
    assert pickle.loads(pickle.dumps(u)) == u and len(u.rkey) > 0
    ucx.shutdown()
    shared = kv.KVCache(local_layout(num_pages=8), "shared")
    s = kv.ShmKVTransferInfo.decode(kv.ShmKVTransferEngine(shared).get_kv_transfer_info())
    assert s.pid == os.getpid() and s.layout == shared.layout
    assert kv.ShmKVTransferInfo.from_bytes(pickle.loads(pickle.dumps(s.to_bytes()))) == s
    # A private cache is served by cross-memory attach (test_regions.py).
    cache = kv.KVCache(local_layout(num_pages=8))
    p = kv.ShmKVTransferInfo.decode(kv.ShmKVTransferEngine(cache).get_kv_transfer_info())
    assert p.access == "cma" and p.regions == [cache.data_ptr] and p.pid == os.getpid()
    assert kv.ShmKVTransferInfo.from_bytes(pickle.loads(pickle.dumps(p.to_bytes()))) == p
