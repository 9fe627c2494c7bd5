"""vLLM's KV cache groups (its hybrid memory allocator) as one mstar-kv cache.

A hybrid model (sliding-window layers beside full-attention ones: Gemma 3,
gpt-oss, Llama 4) gets one KV cache group per kind of layer. vLLM overlays
the groups on one backing allocation: layer i of every group addresses the
same bytes (one KVCacheTensor region each), and a block id is owned by one
group at a time, so the groups' blocks of one request are distinct pages
of the same regions. The connector maps the distinct regions once (one
cache, one pool, one descriptor: layout.map_kv_caches over one tensor per
region) and moves, per request, the pages each group needs:

* a full-attention group: every block of the prompt;
* a sliding-window group: only the blocks holding the tokens the decode's
  first computed token attends to (vLLM's own rule,
  SlidingWindowManager.get_num_skipped_tokens: the last ``window - 1``
  tokens before it), which are those vLLM keeps; the decode's blocks
  before them are vLLM's null block and are not written.

A request's pages are published as one list, group after group; the params
name each group's segment (its kind, the block index of its first page,
its page count), and the decode pairs them with its own block table of the
same group, block index by block index, skipping the null blocks vLLM put
where a group keeps nothing. Mamba / linear-attention state groups are
refused at engine start, by name (check_groups).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .layout import LayoutError

FULL, SLIDING = "full", "sliding_window"
# vLLM's specs this connector moves, by exact class: a subclass may keep its
# blocks otherwise (chunked local attention, a circular buffer, sinks).
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_SLIDING_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec")
NULL_BLOCK = 0  # vLLM's null block: a block a group keeps nothing in


@dataclasses.dataclass(frozen=True)
class Group:
    """One KV cache group: what it keeps of a request."""
    kind: str                   # FULL or SLIDING
    window: int                 # tokens (SLIDING), 0 for FULL
    block_size: int
    layer_names: tuple

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.window}" if self.kind == SLIDING else self.kind

    def first_block(self, num_tokens: int) -> int:
        """The index of the first block a request of ``num_tokens`` computed
        tokens needs (the decode computes token num_tokens - 1 again, or the
        next one: the window of the earlier)."""
        if self.kind != SLIDING:
            return 0
        return max(0, num_tokens - self.window) // self.block_size


def check_groups(kv_cache_config) -> list:
    """The model's KV cache groups as Groups; raises LayoutError at engine
    start naming each group this connector cannot move."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    out, bad = [], []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kind = type(spec).__name__
        names = tuple(g.layer_names)
        where = f"group {i} ({kind}, {len(names)} layers: {names[0] if names else '-'}, ...)"
        bs = int(getattr(spec, "block_size", 0) or 0)
        if kind in _FULL_SPECS:
            out.append(Group(FULL, 0, bs, names))
        elif kind in _SLIDING_SPECS and int(getattr(spec, "sliding_window", 0) or 0) > 0:
            out.append(Group(SLIDING, int(spec.sliding_window), bs, names))
        elif kind == "MambaSpec":
            bad.append(f"{where}: Mamba / linear-attention state is not moved by "
                       "MstarKVConnector yet")
        else:
            bad.append(f"{where}: a {kind} keeps its blocks in a way MstarKVConnector "
                       "does not move")
    if bad:
        raise LayoutError("KV cache groups MstarKVConnector cannot move: " + "; ".join(bad))
    if len(out) > 1 and len({g.block_size for g in out}) != 1:
        raise LayoutError("KV cache groups of several block sizes ("
                          + ", ".join(f"{g.name}: {g.block_size}" for g in out)
                          + "): MstarKVConnector moves groups of one block size")
    return out


def publish_pages(groups: Sequence[Group], block_ids: Sequence[Sequence[int]],
                  num_tokens: int) -> tuple:
    """(pages, segments) of a request with ``num_tokens`` computed tokens:
    the pages to publish, group after group, and per group [name, first
    block index, page count]. Raises LayoutError when vLLM's table of a
    group does not fit (fewer blocks than the tokens, a needed null block)."""
    if len(block_ids) != len(groups):
        raise LayoutError(f"{len(block_ids)} block tables for {len(groups)} KV cache groups")
    pages, segs = [], []
    for g, ids in zip(groups, block_ids):
        end = -(-num_tokens // g.block_size)
        first = g.first_block(num_tokens)
        mine = list(ids[first:end])
        if len(mine) != end - first or NULL_BLOCK in mine:
            raise LayoutError(f"group {g.name}: blocks [{first}, {end}) of a request of "
                              f"{num_tokens} tokens are not all held ({list(ids)})")
        pages.extend(mine)
        segs.append([g.name, first, len(mine)])
    return pages, segs


def pair_pages(groups: Sequence[Group], segments: Sequence, remote_pages: Sequence[int],
               local_ids: Sequence[Sequence[int]], start: int, end: int) -> tuple:
    """(remote pages, local pages) to move for tokens [start, end): per
    group, the blocks the producer published and the decode holds (not
    the null block). Raises LayoutError when the groups differ."""
    if len(segments) != len(groups) or len(local_ids) != len(groups):
        raise LayoutError(f"the producer has {len(segments)} KV cache groups "
                          f"({[s[0] for s in segments]}), this engine "
                          f"{[g.name for g in groups]}")
    total = sum(int(s[2]) for s in segments)
    if total != len(remote_pages):
        raise LayoutError(f"the groups name {total} pages, the producer published "
                          f"{len(remote_pages)}")
    remote, local, off = [], [], 0
    for g, (name, first, count), ids in zip(groups, segments, local_ids):
        if name != g.name:
            raise LayoutError(f"the producer's group {name} is this engine's {g.name}")
        lo = max(int(first), start // g.block_size)
        hi = min(int(first) + int(count), -(-end // g.block_size), len(ids))
        for j in range(lo, hi):
            if ids[j] != NULL_BLOCK:
                remote.append(int(remote_pages[off + j - int(first)]))
                local.append(int(ids[j]))
        off += int(count)
    return remote, local


def region_tensors(kv_caches: dict) -> tuple:
    """({representative layer: tensor} with one tensor per distinct region,
    {layer name: region index ready once it is saved, -1 for none}).

    Layer i of every group addresses region i; a region holds its final
    bytes once every layer on it has been saved, which the layer order of
    the model's forward pass (the names' numbers) says."""
    from .layout import _layer_key

    by_ptr: dict = {}
    for n in sorted(kv_caches, key=_layer_key):
        by_ptr.setdefault(kv_caches[n].data_ptr(), []).append(n)
    regions = sorted(by_ptr.items())  # address order, as map_kv_caches orders layers
    reps = {names[0]: kv_caches[names[0]] for _, names in regions}
    region_of = {n: i for i, (_, names) in enumerate(regions) for n in names}
    pending = [len(names) for _, names in regions]
    ready, out = 0, {}
    for n in sorted(region_of, key=_layer_key):
        pending[region_of[n]] -= 1
        while ready < len(pending) and pending[ready] == 0:
            ready += 1
        out[n] = ready - 1
    return reps, out
