"""Upstream mstar's KVCache seen as an mstar_kv.KVCache, without a copy.

Upstream's KVCache (mstar.engine.resources.kv.cache) is duck-typed: its
``.tensor`` (or a bare tensor, as its older kv_store passed) is one 6-D torch
tensor on any device, in one of two orders:

* ``[num_layers, max_num_pages, 2, page_size, num_kv_heads, head_dim]``
  (K and V inside each page of a layer): cache order "layer_page";
* ``[num_layers, 2, max_num_pages, page_size, num_kv_heads, head_dim]``
  (all K pages of a layer, then all V pages): cache order "layer".

Pages are NHD (token, head, dim). A shape or dtype the layout cannot describe
is a ValueError naming the dimension.
"""
from __future__ import annotations

from typing import Any

import mstar_kv as kv

# torch dtype names -> mstar_kv's.
_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2"}
_SHAPES = ("[num_layers, max_num_pages, 2, page_size, num_kv_heads, head_dim] or "
           "[num_layers, 2, max_num_pages, page_size, num_kv_heads, head_dim]")
# (config attribute, tensor dimension) per order: what a config must agree with.
_DIMS = {"layer_page": (("num_layers", 0), ("max_num_pages", 1), ("page_size", 3),
                        ("num_kv_heads", 4), ("head_dim", 5)),
         "layer": (("num_layers", 0), ("max_num_pages", 2), ("page_size", 3),
                   ("num_kv_heads", 4), ("head_dim", 5))}


def cache_tensor(kv_cache: Any) -> Any:
    """The tensor behind upstream's KVCache (or the tensor itself)."""
    tensor = getattr(kv_cache, "tensor", None)
    if tensor is None and hasattr(kv_cache, "shape") and hasattr(kv_cache, "dtype"):
        tensor = kv_cache
    if tensor is None:
        raise ValueError(f"kv_cache of type {type(kv_cache).__name__} has no .tensor and is not "
                         "a tensor: pass upstream mstar's KVCache or its tensor")
    return tensor


def is_cuda(kv_cache: Any) -> bool:
    device = getattr(cache_tensor(kv_cache), "device", None)
    return getattr(device, "type", None) == "cuda"


def _kv_order(kv_cache: Any, shape: tuple, element_size: int) -> str:
    """Which dimension holds K|V: 2 ("layer_page") or 1 ("layer")."""
    one, two = shape[1] == 2, shape[2] == 2
    if one != two:
        return "layer" if one else "layer_page"
    if not one:
        raise ValueError(f"KV cache tensor of shape {list(shape)}: dimension 1 ({shape[1]}) or "
                         f"dimension 2 ({shape[2]}) must be 2 (K and V); expected {_SHAPES}")
    # Both are 2 (two pages): the cache's own addressing tells, where it has it.
    chunk_ptrs = getattr(kv_cache, "chunk_ptrs", None)
    if chunk_ptrs is None:
        raise ValueError(f"KV cache tensor of shape {list(shape)} is ambiguous: dimensions 1 "
                         "and 2 are both 2 and the cache has no chunk_ptrs to tell which is K|V")
    ptrs, _ = chunk_ptrs(layer_idx=0, page_idx=0, token_start=0, token_end=1)
    block = shape[3] * shape[4] * shape[5] * element_size
    step = ptrs[1] - ptrs[0]
    if step == block:
        return "layer_page"
    if step == 2 * block:
        return "layer"
    raise ValueError(f"KV cache of shape {list(shape)}: its chunk_ptrs put V {step} bytes after "
                     f"K, neither one page ({block}) nor two ({2 * block})")


def wrap_kv_cache(kv_cache: Any) -> "kv.KVCache":
    """mstar_kv's KVCache over upstream's tensor (no copy; the tensor stays
    alive as long as the cache). ValueError names what does not fit."""
    tensor = cache_tensor(kv_cache)
    shape = tuple(int(s) for s in tensor.shape)
    if len(shape) != 6:
        raise ValueError(f"KV cache tensor of shape {list(shape)} has {len(shape)} dimensions; "
                         f"expected 6: {_SHAPES}")
    dtype = str(tensor.dtype).split(".")[-1]
    if dtype not in _DTYPES:
        raise ValueError(f"KV cache dtype {tensor.dtype} is not one mstar_kv moves "
                         f"({', '.join(sorted(_DTYPES))})")
    # Upstream's config layout (KVLayout.NHD); a bare tensor's .layout is torch's.
    page_layout = getattr(kv_cache, "layout", None) if tensor is not kv_cache else None
    if page_layout is not None:
        name = str(getattr(page_layout, "value", getattr(page_layout, "name", page_layout)))
        if name.upper() != "NHD":
            raise ValueError(f"KV cache layout {page_layout} is not NHD ([page_size, "
                             "num_kv_heads, head_dim] pages)")
    element_size = int(tensor.element_size()) if hasattr(tensor, "element_size") else 0
    order = _kv_order(kv_cache, shape, element_size)
    config = getattr(kv_cache, "config", None)
    for attr, dim in _DIMS[order]:
        want = getattr(config, attr, None)
        if isinstance(want, int) and want != shape[dim]:
            raise ValueError(f"KV cache tensor dimension {dim} ({attr}) is {shape[dim]}, its "
                             f"config says {want}")
    if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous():
        raise ValueError(f"KV cache tensor of shape {list(shape)} is not contiguous (strides "
                         f"{list(tensor.stride())})")
    num_pages = shape[2] if order == "layer" else shape[1]
    layout = kv.KVLayout(num_layers=shape[0], num_pages=num_pages, page_size=shape[3],
                         num_kv_heads=shape[4], head_dim=shape[5], dtype=_DTYPES[dtype],
                         cache_order=order)
    if getattr(tensor, "requires_grad", False):
        tensor = tensor.detach()
    return kv.KVCache.from_dlpack(tensor, layout)
