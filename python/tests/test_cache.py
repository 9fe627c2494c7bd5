"""Caches from the caller's memory without a copy, and the library's caches
seen from numpy / torch without a copy."""
import gc
import sys
import weakref

import mstar_kv as kv
import numpy as np
import pytest
from conftest import local_layout

try:
    import torch
except ImportError:  # ./scripts/test installs it (scripts/lib/pip-packages.txt)
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def test_numpy_array_wrapped_without_copy_and_kept_alive():
    layout = local_layout(dtype="fp16", num_pages=8)
    arr = np.zeros((4, 2, 8, 16, 2, 64), dtype=np.float16)
    cache = kv.KVCache.from_dlpack(arr, layout)
    assert cache.data_ptr == arr.ctypes.data and cache.memory == "host"
    refs = sys.getrefcount(arr)
    del arr  # the cache keeps it alive
    view = np.asarray(cache)
    view[1, 0, 3] = 7.0  # layer 1, K, page 3
    assert np.all(np.asarray(cache)[1, 0, 3] == 7.0)
    assert refs >= 3


@pytest.mark.parametrize("per_layer", [False, True], ids=["from_dlpack", "from_layer_tensors"])
def test_the_callers_arrays_live_exactly_as_long_as_the_cache(per_layer):
    layout = local_layout(dtype="fp16", num_pages=8)
    if per_layer:
        shape = (layout.num_kv, layout.num_pages, layout.page_size, layout.num_kv_heads,
                 layout.head_dim)
        arrays = [np.zeros(shape, dtype=np.float16) for _ in range(layout.num_layers)]
        cache = kv.KVCache.from_layer_tensors(arrays, layout)
    else:
        arrays = [np.zeros((4, 2, 8, 16, 2, 64), dtype=np.float16)]
        cache = kv.KVCache.from_dlpack(arrays[0], layout)
    alive = [weakref.ref(a) for a in arrays]
    del arrays
    gc.collect()
    assert all(a() is not None for a in alive), "the cache let go of the caller's arrays"
    del cache
    gc.collect()
    assert all(a() is None for a in alive), "the cache's end did not release the arrays"


def test_numpy_bytes_and_same_size_integers_accepted():
    layout = local_layout(num_pages=8)  # bf16: numpy has none
    u16 = np.zeros(layout.total_bytes // 2, dtype=np.uint16)
    assert kv.KVCache.from_dlpack(u16, layout).size_bytes == layout.total_bytes
    u8 = np.zeros(layout.total_bytes, dtype=np.uint8)
    assert kv.KVCache.from_dlpack(u8, layout).data_ptr == u8.ctypes.data
    u8v = np.zeros((4, 2, 8, 16, 2, 128), dtype=np.uint8)  # last axis in bytes
    kv.KVCache.from_dlpack(u8v, layout)


@pytest.mark.parametrize("arr,match", [
    (np.zeros((4, 2, 8, 16, 2, 32), np.float16), r"tensor shape \[4, 2, 8, 16, 2, 32\] does not "
                                                 r"match .* expected \[4, 2, 8, 16, 2, 64\]"),
    (np.zeros(4 * 2 * 8 * 16 * 2 * 64, np.float32), "tensor dtype float32 does not match the "
                                                     "layout's dtype fp16"),
    (np.zeros((4, 2, 8, 16, 64, 2), np.float16).transpose(0, 1, 2, 3, 5, 4),
     "not C-contiguous"),
    (np.zeros(100, np.float16), r"flat \[131072\]"),
])
def test_tensor_mismatch_named(arr, match):
    with pytest.raises(kv.InvalidArgumentError, match=match):
        kv.KVCache.from_dlpack(arr, local_layout(dtype="fp16", num_pages=8))


def test_library_cache_visible_to_numpy_without_copy():
    layout = local_layout(num_pages=8, cache_order="page", page_order="hnd")
    cache = kv.KVCache(layout, "shared")
    assert cache.view_shape == [8, 4, 2, 2, 16, 64]
    a = np.asarray(cache)  # __array_interface__; bf16 as uint16
    assert a.dtype == np.uint16 and list(a.shape) == cache.view_shape
    assert a.__array_interface__["data"][0] == cache.data_ptr
    a[2, 1, 0, 1, 5, :] = 0xABCD  # page 2, layer 1, K, head 1, token 5
    cache.fill_pattern(3, [0], 0, 16)  # the library writes the same memory
    assert np.any(cache.numpy()[0] != 0)
    assert np.all(cache.numpy()[2, 1, 0, 1, 5] == 0xABCD)
    d = np.from_dlpack(kv.KVCache(local_layout(dtype="fp32", num_pages=2)))
    assert d.dtype == np.float32 and d.shape == (4, 2, 2, 16, 2, 64)


def test_pattern_written_by_numpy_is_served():
    """A prefill that writes K/V with numpy into the pages it then publishes."""
    layout = local_layout(num_pages=8)
    src = kv.KVCache(layout, "shared")
    dst = kv.KVCache(layout)
    src_np = src.numpy()
    src_np[...] = np.arange(src_np.size, dtype=np.uint64).astype(np.uint16).reshape(src_np.shape)
    engine = kv.ShmKVTransferEngine(dst)
    m = kv.KVTransferManager(engine, dst)
    assert m.sync_retrieve(0, 16 * 8, list(range(8)), list(range(8)),
                           kv.ShmKVTransferEngine(src).get_kv_transfer_info()) == layout.total_bytes
    assert np.array_equal(dst.numpy(), src_np)


@needs_torch
def test_torch_cpu_tensor_round_trip():
    layout = local_layout(num_pages=8)
    t = torch.zeros(4, 2, 8, 16, 2, 64, dtype=torch.bfloat16)
    cache = kv.KVCache.from_dlpack(t, layout)
    assert cache.data_ptr == t.data_ptr()
    back = torch.from_dlpack(cache)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == t.data_ptr()
    with pytest.raises(kv.InvalidArgumentError, match="not C-contiguous"):
        kv.KVCache.from_dlpack(torch.zeros(4, 2, 8, 16, 64, 2, dtype=torch.bfloat16)
                               .transpose(4, 5), layout)


@needs_torch
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_cuda_tensor_wrapped():
    layout = local_layout(num_pages=8)
    t = torch.zeros(4, 2, 8, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    cache = kv.KVCache.from_dlpack(t, layout)
    assert cache.memory == "device" and cache.data_ptr == t.data_ptr()


def test_non_tensors_and_read_only_arrays_refused():
    layout = local_layout(num_pages=8)
    ro = np.zeros(layout.total_bytes, np.uint8)
    ro.flags.writeable = False
    with pytest.raises(kv.InvalidArgumentError, match="read-only"):
        kv.KVCache.from_dlpack(ro, layout)
    with pytest.raises(kv.InvalidArgumentError, match="type list is not a tensor"):
        kv.KVCache.from_dlpack([1, 2, 3], layout)
