"""mstar_kv.integrations.mstar in one process: upstream mstar's caches in
both tensor orders wrapped without a copy, its transfer engines dispatched as
upstream does, request-scoped descriptors (equal, picklable, namespaced by
resource key, stale after remove_request / a new reset_generation /
cleanup), only the requested pages and tokens pulled, and every failure of a
pull on its future. The objects upstream would pass are shaped like its own
(mstar_upstream.py); two processes: test_mstar_two_process.py."""
import concurrent.futures
import dataclasses
import pickle

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (./scripts/test installs it)")

import mstar_kv as kv  # noqa: E402
import mstar_upstream as up  # noqa: E402
from mstar_kv.integrations.mstar import (  # noqa: E402
    CudaIpcKVTransferEngine,
    KVReadInfo,
    KVTransferManager,
    LocalOnlyKVTransferEngine,
    MooncakeKVTransferEngine,
    ShmKVTransferEngine,
    ShmKVTransferInfo,
    TransferEngineInfo,
    make_deployment_kv_shm_dir,
)
from mstar_kv.integrations.mstar.cache import wrap_kv_cache  # noqa: E402


def manager(cache, resource_key="kv", needs_remote_transfer=True, entity="w", **info):
    te = info.pop("te", None) or up.LocalTransferEngine(entity)
    return KVTransferManager(TransferEngineInfo(entity, "session", te, **info), cache,
                             resource_key=resource_key, needs_remote_transfer=needs_remote_transfer)


def producer_and_consumer(order, **kw):
    src = up.KVCache(order, **kw)
    src.tensor.copy_(up.content(src, 1))
    dst = up.KVCache(order, **kw)
    return src, manager(src, entity="producer"), dst, manager(dst, entity="consumer")


def publish(m, rid, pages, seq_len, label="main", gen=None):
    return m.get_kv_transfer_info(request_id=rid, label=label, page_indices=pages,
                                  seq_len=seq_len, reset_generation=gen)


@pytest.mark.parametrize("order", up.ORDERS)
def test_both_orders_wrap_without_a_copy(order):
    cache = up.KVCache(order, layers=3, pages=5, page_size=4, heads=2, head_dim=8,
                       dtype=torch.bfloat16)
    wrapped = wrap_kv_cache(cache)
    assert wrapped.data_ptr == cache.tensor.data_ptr()
    lay = wrapped.layout
    assert (lay.num_layers, lay.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim) == \
        (3, 5, 4, 2, 8)
    assert lay.cache_order == order and lay.dtype == "bf16"
    # mstar_kv addresses tokens [1, 3) of K and V of a (layer, page) where
    # upstream's own addressing (chunk_ptrs) puts them.
    base = cache.data_ptr()
    for layer, page in ((0, 0), (2, 4), (1, 3)):
        local, _, lengths = kv.plan_copy_addresses(lay, base, lay, base,
                                                   [kv.KVReadInfo(layer, page, page, 1, 3)])
        ptrs, nbytes = cache.chunk_ptrs(layer, page, 1, 3)
        assert sorted(local) == sorted(ptrs) and lengths == [nbytes, nbytes]
    assert wrap_kv_cache(cache.tensor).data_ptr == cache.tensor.data_ptr()  # a bare tensor too


def test_shapes_and_dtypes_the_layout_cannot_describe_name_the_dimension():
    cache = up.KVCache("layer_page")
    bad = [(torch.zeros(2, 8, 2, 4, 2), "has 5 dimensions"),
           (torch.zeros(2, 8, 3, 4, 2, 8), "dimension 1 (8) or dimension 2 (3) must be 2"),
           (torch.zeros(2, 8, 2, 4, 2, 8, dtype=torch.int32), "dtype torch.int32"),
           (torch.zeros(2, 2, 8, 4, 2, 8).transpose(1, 2), "not contiguous")]
    for tensor, message in bad:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            wrap_kv_cache(tensor)
    cache.config.max_num_pages = 9
    with pytest.raises(ValueError, match=r"dimension 1 \(max_num_pages\) is 8, its config says 9"):
        wrap_kv_cache(cache)
    # Two pages: both dimensions are 2, and only the cache's addressing tells.
    for order in up.ORDERS:
        two = up.KVCache(order, pages=2)
        assert wrap_kv_cache(two).layout.cache_order == order
        with pytest.raises(ValueError, match="ambiguous"):
            wrap_kv_cache(two.tensor)


def test_engines_are_dispatched_as_upstream_does():
    cache = up.KVCache("layer")
    assert isinstance(manager(cache)._kv_transfer_engine, ShmKVTransferEngine)
    calls = []
    local = manager(cache, resource_key="local_kv", needs_remote_transfer=False,
                    shm_dir_factory=lambda: calls.append(1) or "/unused")
    assert isinstance(local._kv_transfer_engine, LocalOnlyKVTransferEngine)
    assert publish(local, "request", [0], 1) is None
    assert calls == []  # no directory is made for a cache nothing reads remotely
    with pytest.raises(ValueError, match="Unsupported transfer engine type"):
        KVTransferManager(TransferEngineInfo("w", "s", object()), cache)
    if torch.cuda.is_available() and "cuda_ipc" in kv.built_engines():
        gpu = up.KVCache("layer", device="cuda")
        assert isinstance(manager(gpu)._kv_transfer_engine, CudaIpcKVTransferEngine)


@pytest.mark.parametrize("order", up.ORDERS)
def test_pull_moves_only_the_requested_pages_and_tokens(order):
    src, producer, dst, consumer = producer_and_consumer(order)
    info = publish(producer, "r", [5, 2, 7], 10, label="cfg_text")
    assert isinstance(info, ShmKVTransferInfo)
    before = dst.tensor.clone()
    # Tokens [0, 10): pages 5 and 2 whole, the first 2 tokens of page 7.
    assert consumer.start_async_retrieve(0, 10, [1, 3, 6], [5, 2, 7], info).result() > 0
    assert torch.equal(dst.page(1), src.page(5)) and torch.equal(dst.page(3), src.page(2))
    assert torch.equal(dst.page(6)[:, :, :2], src.page(7)[:, :, :2])
    assert torch.equal(dst.page(6)[:, :, 2:], dst.page(6, before)[:, :, 2:])
    for page in (0, 2, 4, 5, 7):
        assert torch.equal(dst.page(page), dst.page(page, before)), page
    # A later range only (a cached prefix skipped): tokens [6, 10).
    dst.tensor.zero_()
    assert consumer.start_async_retrieve(6, 10, [1, 3, 6], [5, 2, 7], info).result() > 0
    assert not dst.page(1).any()
    assert torch.equal(dst.page(3)[:, :, 2:], src.page(2)[:, :, 2:])
    assert not dst.page(3)[:, :, :2].any()


def test_upstreams_engine_level_read_with_its_own_read_infos():
    @dataclasses.dataclass
    class UpstreamReadInfo:  # upstream's KVReadInfo, a plain dataclass
        layer_idx: int
        local_page_idx: int
        remote_page_idx: int
        token_start: int
        token_end: int

    src, producer, dst, consumer = producer_and_consumer("layer_page", pages=4)
    info = publish(producer, "request", [1, 3], 6, label="cfg_text")
    reads = [UpstreamReadInfo(layer, 0, 1, 0, 4) for layer in range(2)]
    reads += [KVReadInfo(layer, 2, 3, 0, 2) for layer in range(2)]
    future = consumer._kv_transfer_engine.read_batched_async(info, reads)
    assert future.result() > 0
    assert torch.equal(dst.tensor[:, 0], src.tensor[:, 1])
    assert torch.equal(dst.tensor[:, 2, :, :2], src.tensor[:, 3, :, :2])
    assert torch.count_nonzero(dst.tensor[:, 1]) == 0
    assert consumer._kv_transfer_engine.read_batched_async(info, []) is None
    # A page the descriptor did not publish, or tokens beyond its seq_len: on the future.
    with pytest.raises(kv.InvalidArgumentError, match="remote page 2 is not one of the 2 pages"):
        consumer._kv_transfer_engine.read_batched_async(info, [KVReadInfo(0, 0, 2, 0, 4)]).result()
    with pytest.raises(kv.InvalidArgumentError, match="beyond the 6 tokens"):
        consumer._kv_transfer_engine.read_batched_async(info, [KVReadInfo(0, 0, 3, 0, 4)]).result()


def test_descriptors_are_equal_for_equal_arguments_picklable_and_owned():
    _, producer, _, consumer = producer_and_consumer("layer")
    a = publish(producer, "r", [1, 2], 8, gen=3)
    b = publish(producer, "r", [1, 2], 8, gen=3)
    assert a == b and hash(a) == hash(b)
    c = pickle.loads(pickle.dumps(a))
    assert c == a and type(c) is ShmKVTransferInfo
    assert (c.request_id, c.label, c.reset_generation, c.seq_len, c.page_indices) == \
        ("r", "main", 3, 8, (1, 2))
    assert publish(producer, "r", [1, 2], 7, gen=3) != a
    assert producer.owns_transfer_info(c, "r", "main")
    assert not producer.owns_transfer_info(c, "r", "cfg_text")
    assert not consumer.owns_transfer_info(c, "r", "main")
    # An argument missing: nothing published (as upstream).
    assert producer.get_kv_transfer_info(request_id="r", label="main") is None
    assert producer.get_kv_transfer_info() is None


def test_resource_keys_namespace_descriptors():
    src = up.KVCache("layer")
    src.tensor.copy_(up.content(src, 1))
    thinker = manager(src, resource_key="thinker_kv", entity="producer")
    talker = manager(src, resource_key="talker_kv", entity="producer")
    first = publish(thinker, "request", [0], 1)
    second = publish(talker, "request", [0], 1)
    assert first != second
    assert thinker.owns_transfer_info(first, "request", "main")
    assert not thinker.owns_transfer_info(second, "request", "main")
    dst = up.KVCache("layer")
    reader = manager(dst, resource_key="thinker_kv", entity="consumer")
    assert reader.start_async_retrieve(0, 1, [0], [0], first).result() > 0
    error = reader.start_async_retrieve(0, 1, [0], [0], second).exception()
    assert isinstance(error, kv.InvalidArgumentError)
    assert "resource 'talker_kv'" in str(error) and "resource 'thinker_kv'" in str(error)


def test_a_new_reset_generation_is_read_again_and_the_old_one_is_stale():
    src, producer, dst, consumer = producer_and_consumer("layer_page")
    old = publish(producer, "r", [4], 4, gen=0)
    assert consumer.start_async_retrieve(0, 4, [0], [4], old).result() > 0
    assert torch.equal(dst.page(0), src.page(4))
    src.page(4).copy_(src.page(4, up.content(src, 9)))  # the request is computed again
    new = publish(producer, "r", [4], 4, gen=1)
    error = consumer.start_async_retrieve(0, 4, [0], [4], old).exception()
    assert isinstance(error, kv.StaleDescriptorError), error
    assert consumer.start_async_retrieve(0, 4, [0], [4], new).result() > 0
    assert torch.equal(dst.page(0), src.page(4, up.content(src, 9)))


def test_removed_requests_and_cleaned_up_managers_fail_on_the_future():
    src, producer, dst, consumer = producer_and_consumer("layer")
    one = publish(producer, "one", [1], 4)
    two = publish(producer, "two", [2], 4)
    producer.remove_request("one")
    assert not producer.owns_transfer_info(one, "one", "main")
    failed = consumer.start_async_retrieve(0, 4, [0], [1], one)
    assert isinstance(failed.exception(), kv.StaleDescriptorError)
    assert not dst.page(0).any()  # nothing landed
    assert consumer.start_async_retrieve(0, 4, [3], [2], two).result() > 0  # the other proceeds
    producer.cleanup()
    assert isinstance(consumer.start_async_retrieve(0, 4, [3], [2], two).exception(),
                      kv.KVTransferError)


def test_bad_descriptors_fail_on_the_future_naming_the_mismatch():
    src, producer, dst, consumer = producer_and_consumer("layer")
    info = publish(producer, "r", [1, 2], 8)
    assert consumer.start_async_retrieve(5, 5, None, None, "anything") is None  # first
    assert consumer.start_async_retrieve(6, 5, [0], [1], None) is None

    def error_of(descriptor, remote=(1, 2)):
        future = consumer.start_async_retrieve(0, 8, [0, 1], list(remote), descriptor)
        assert isinstance(future, concurrent.futures.Future)
        return future.exception(timeout=10)

    data = bytearray(pickle.dumps(info))
    at = bytes(data).index(b"main")
    data[at] ^= 0x20  # 'main' -> 'Main' inside the descriptor's frame
    corrupt = pickle.loads(bytes(data))  # loads: checked where it is read
    e = error_of(corrupt)
    assert isinstance(e, kv.CorruptDescriptorError) and "checksum" in str(e)
    e = error_of(None)
    assert isinstance(e, kv.InvalidArgumentError) and "published nothing" in str(e)

    @dataclasses.dataclass
    class UpstreamShmInfo:  # upstream's own descriptor type: not this module's
        path: str
        page_indices: tuple

    e = error_of(UpstreamShmInfo("/dev/shm/x.pt", (1, 2)))
    assert isinstance(e, kv.InvalidArgumentError) and "UpstreamShmInfo" in str(e)
    e = error_of(info, remote=(1, 3))
    assert "remote_page_indices[1] = 3" in str(e) and "published page 2" in str(e)
    e = consumer.start_async_retrieve(0, 9, [0, 1, 2], [1, 2, 3], info).exception()
    assert "beyond the 8 tokens" in str(e)
    local_only = manager(up.KVCache("layer"), needs_remote_transfer=False)
    e = local_only.start_async_retrieve(0, 8, [0, 1], [1, 2], info).exception()
    assert isinstance(e, kv.NotSupportedError)


def test_a_descriptor_of_another_engine_fails_on_the_future():
    mooncake = pytest.importorskip("mooncake.engine", reason="the Mooncake wheel is not installed")
    del mooncake
    src = up.KVCache("layer")
    producer = manager(src, te=up.MooncakeTransferEngine())
    assert isinstance(producer._kv_transfer_engine, MooncakeKVTransferEngine)
    info = publish(producer, "r", [1], 4)
    consumer = manager(up.KVCache("layer"))  # shm
    e = consumer.start_async_retrieve(0, 4, [0], [1], info).exception()
    assert isinstance(e, kv.InvalidArgumentError) and "mooncake" in str(e) and "shm" in str(e)
    producer.cleanup()


def test_deployment_directory_is_private_and_stale_ones_are_swept(tmp_path, monkeypatch):
    import os
    monkeypatch.setenv("MSTAR_KV_SHM_DIR", str(tmp_path))
    uid = os.getuid()
    stale = tmp_path / f"mstar_kv_{uid}_99999999_stale"
    stale.mkdir()
    (stale / "orphan.pt").touch()
    first = make_deployment_kv_shm_dir("/tmp/a", "tcp://h:1", owner_pid=os.getpid())
    second = make_deployment_kv_shm_dir("/tmp/b", "tcp://h:2", owner_pid=os.getpid())
    assert first != second and not stale.exists()
    assert os.stat(first).st_mode & 0o777 == 0o700
