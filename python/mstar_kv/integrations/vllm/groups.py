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
where a group keeps nothing. A Mamba / linear-attention state group
(Granite 4.0-H, Nemotron-H, Jamba, Qwen3-Next, ...) moves the request's
running state (conv and SSM state): the last block its table holds, as
NixlConnector's clip_ssm_state_blocks takes it. With mamba_cache_mode
"none" that is the request's one state block; with "align" (vLLM's mode
when prefix caching is on) the table has a slot per block of tokens, the
earlier ones null or prefix-cache checkpoints, and the state after the
computed tokens is in the last. vLLM pads every group's page to one size and places a
layer's states at the start of its page in the region, whatever their
shapes: the connector moves the whole page of each region, so the states
arrive byte for byte. vLLM's own convention (NixlConnector): the prefill
stops one token short of the prompt (on_new_request), so the state is
h(N-1) and the decode computes the last prompt token itself.

Several groups need one block size for the attention groups. A state
group between engines of different TP sizes moves each part of the state
(conv x, B, C, SSM heads) from the prefill ranks holding it (state_tp.py,
Mamba2 with VLLM_SSM_CONV_STATE_LAYOUT=DS); what it cannot move is refused,
naming it.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .layout import LayoutError

FULL, SLIDING, MAMBA = "full", "sliding_window", "mamba"
# vLLM's specs this connector moves, by exact class: a subclass may keep its
# blocks otherwise (chunked local attention, a circular buffer, sinks).
_FULL_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
_SLIDING_SPECS = ("SlidingWindowSpec", "SlidingWindowMLASpec")
NULL_BLOCK = 0  # vLLM's null block: a block a group keeps nothing in
# Mamba cache modes whose running state is the last block of the table
# ("all" keeps a state per token block and computes into several).
_STATE_MODES = ("none", "align")


@dataclasses.dataclass(frozen=True)
class Group:
    """One KV cache group: what it keeps of a request."""
    kind: str                   # FULL, SLIDING or MAMBA
    window: int                 # tokens (SLIDING), 0 for FULL
    block_size: int
    layer_names: tuple
    # MAMBA: its state_tp.StateGeom, or why it cannot move between TP sizes
    state: object = dataclasses.field(default=None, compare=False)

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.window}" if self.kind == SLIDING else self.kind

    def first_block(self, num_tokens: int) -> int:
        """The index of the first block a request of ``num_tokens`` computed
        tokens needs (the decode computes token num_tokens - 1 again, or the
        next one: the window of the earlier)."""
        if self.kind != SLIDING:  # FULL: every block; MAMBA: its state block(s)
            return 0
        return max(0, num_tokens - self.window) // self.block_size


def check_groups(kv_cache_config, hf_config=None, tp_size: int = 1) -> list:
    """A hybrid model's KV cache groups as Groups ([] for one group);
    raises LayoutError at engine start naming each group this connector
    cannot move. ``hf_config`` (the model's) and ``tp_size`` (this
    engine's) give a state group its geometry (state_tp.geometry)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if len(groups) <= 1:
        return []  # one group: the connector maps its tensors as they are (layout.py)
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
            mode = str(getattr(spec, "mamba_cache_mode", "none"))
            spec_blocks = int(getattr(spec, "num_speculative_blocks", 0) or 0)
            if mode not in _STATE_MODES or spec_blocks:
                bad.append(f"{where}: Mamba state with mamba_cache_mode {mode!r} and "
                           f"{spec_blocks} speculative blocks is not moved; MstarKVConnector "
                           f"moves mamba_cache_mode {' or '.join(map(repr, _STATE_MODES))} "
                           "with none")
            else:
                from .state_tp import geometry
                try:
                    geom = geometry(spec, hf_config, tp_size)
                except Exception as e:  # an unexpected spec: only one TP size
                    geom = f"its geometry is unknown ({type(e).__name__}: {e})"
                out.append(Group(MAMBA, 0, bs, names, geom))
        else:
            bad.append(f"{where}: a {kind} keeps its blocks in a way MstarKVConnector "
                       "does not move")
    if bad:
        raise LayoutError("KV cache groups MstarKVConnector cannot move: " + "; ".join(bad))
    attn = [g for g in out if g.kind != MAMBA]
    if len({g.block_size for g in attn}) > 1:
        raise LayoutError("KV cache groups of several block sizes ("
                          + ", ".join(f"{g.name}: {g.block_size}" for g in attn)
                          + "): MstarKVConnector moves groups of one block size")
    if not attn:
        raise LayoutError("KV cache groups of Mamba state alone: MstarKVConnector describes "
                          "the cache by an attention layer's tensors")
    return out


def block_size(groups: Sequence[Group], default: int) -> int:
    """The attention groups' tokens per block (vLLM's backend may choose
    another than the configured one; a state group's is not a block's)."""
    sizes = {g.block_size for g in groups if g.kind != MAMBA and g.block_size}
    return sizes.pop() if len(sizes) == 1 else default


def has_state(groups: Sequence[Group]) -> bool:
    return any(g.kind == MAMBA for g in groups)


def state_tp_refusal(groups: Sequence[Group], prefill_tp: int, decode_tp: int,
                     prefill: str) -> str:
    """Why a state group cannot move from a prefill engine of
    ``prefill_tp`` ranks (``prefill``: where it is) to this decode engine of
    ``decode_tp`` ranks, or "" when it can (no state group, one TP size, or
    a Mamba1, Mamba2 or GDN state whose parts split over both: state_tp.refusal)."""
    if prefill_tp == decode_tp:
        return ""
    from .state_tp import refusal
    states = [g for g in groups if g.kind == MAMBA]
    for g in states:
        why = refusal(g.state, prefill_tp, decode_tp)
        if not why and g.state != states[0].state:
            why = f"its state's geometry {g.state} is not group 0's {states[0].state}"
        if why:
            first = g.layer_names[0] if g.layer_names else "-"
            return (f"KV cache group {g.name!r} (Mamba state, {len(g.layer_names)} layers: "
                    f"{first}, ...): the prefill engine {prefill} runs TP {prefill_tp}, this "
                    f"decode engine TP {decode_tp}; MstarKVConnector cannot move this state "
                    f"between TP sizes: {why}")
    return ""


def state_group(groups: Sequence[Group]):
    """The state group, or None."""
    return next((g for g in groups if g.kind == MAMBA), None)


def running_state(ids: Sequence[int]) -> list:
    """The state block of a state group's table: its last non-null block
    ([] for none). vLLM's align mode leaves null slots and prefix-cache
    checkpoints before it; the state after the computed tokens is last."""
    held = [int(b) for b in ids if b != NULL_BLOCK]
    return held[-1:]


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
        if g.kind == MAMBA:
            mine = running_state(ids)
            if not mine:
                raise LayoutError(f"group {g.name}: the request holds no state block ({ids})")
            pages.extend(mine)
            segs.append([g.name, 0, len(mine)])
            continue
        end = -(-num_tokens // g.block_size)
        first = g.first_block(num_tokens)
        mine = list(ids[first:end])
        if len(mine) != end - first or NULL_BLOCK in mine:
            raise LayoutError(f"group {g.name}: blocks [{first}, {end}) of a request of "
                              f"{num_tokens} tokens are not all held ({list(ids)})")
        pages.extend(mine)
        segs.append([g.name, first, len(mine)])
    return pages, segs


def segments(groups: Sequence[Group], num_tokens: int) -> list:
    """The segments a producer of these groups publishes for a request of
    ``num_tokens`` tokens (publish_pages), for params made before the
    prefill ran (a proxy's: they name no groups). A state group moves one
    block: its running state (running_state)."""
    out = []
    for g in groups:
        if g.kind == MAMBA:
            out.append([g.name, 0, 1])
            continue
        first = g.first_block(num_tokens)
        out.append([g.name, first, -(-num_tokens // g.block_size) - first])
    return out


def pair_pages(groups: Sequence[Group], segments: Sequence, remote_pages: Sequence[int],
               local_ids: Sequence[Sequence[int]], start: int, end: int,
               kinds: list = None) -> tuple:
    """(remote pages, local pages) to move for tokens [start, end): per
    group, the blocks the producer published and the decode holds (not
    the null block); ``kinds``, when given, gets each pair's group kind.
    Raises LayoutError when the groups differ."""
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
        if g.kind == MAMBA:  # the state after the loaded tokens, whole
            mine = running_state(ids)
            if len(mine) != int(count):
                raise LayoutError(f"group {g.name}: the producer published {count} state "
                                  f"blocks, this engine holds {len(mine)}")
            remote.extend(int(p) for p in remote_pages[off:off + int(count)])
            local.extend(mine)
            if kinds is not None:
                kinds.extend([MAMBA] * len(mine))
            off += int(count)
            continue
        lo = max(int(first), start // g.block_size)
        hi = min(int(first) + int(count), -(-end // g.block_size), len(ids))
        for j in range(lo, hi):
            if ids[j] != NULL_BLOCK:
                remote.append(int(remote_pages[off + j - int(first)]))
                local.append(int(ids[j]))
                if kinds is not None:
                    kinds.append(g.kind)
        off += int(count)
    return remote, local


def region_tensors(kv_caches: dict, state_layers=()) -> tuple:
    """({representative layer: tensor} with one tensor per distinct region,
    {layer name: region index ready once it is saved, -1 for none}).

    A region is described by an attention layer's view of it (a state
    layer's tensor is vLLM's raw bytes): a region no attention layer uses
    gets that view at its own address.

    Layer i of every group addresses region i; a region holds its final
    bytes once every layer on it has been saved, which the layer order of
    the model's forward pass (the names' numbers) says."""
    from .layout import _layer_key

    by_ptr: dict = {}
    for n in sorted(kv_caches, key=_layer_key):
        by_ptr.setdefault(kv_caches[n].data_ptr(), []).append(n)
    regions = sorted(by_ptr.items())  # address order, as map_kv_caches orders layers
    state = set(state_layers)
    attn = [n for _, names in regions for n in names if n not in state]
    if not attn:
        raise LayoutError("no attention layer describes vLLM's KV cache regions")
    t0 = kv_caches[attn[0]]
    stride = int(t0.stride(0)) * t0.element_size()
    reps = {}
    for ptr, names in regions:
        a = [n for n in names if n not in state]
        if a:
            reps[a[0]] = kv_caches[a[0]]
            continue
        off = ptr - t0.data_ptr()
        if off % t0.element_size():
            raise LayoutError(f"the region of {names[0]} at +{off} B is not aligned to "
                              f"{attn[0]}'s elements")
        import torch
        reps[names[0]] = torch.as_strided(t0, t0.size(), t0.stride(),
                                          t0.storage_offset() + off // t0.element_size())
    for n in state:  # every group's pages are one size (vLLM pads them)
        t = kv_caches.get(n)
        if t is not None and int(t.stride(0)) * t.element_size() != stride:
            raise LayoutError(f"layer {n}: its block stride {t.stride(0) * t.element_size()} "
                              f"B is not {attn[0]}'s {stride} B")
    region_of = {n: i for i, (_, names) in enumerate(regions) for n in names}
    pending = [len(names) for _, names in regions]
    ready, out = 0, {}
    for n in sorted(region_of, key=_layer_key):
        pending[region_of[n]] -= 1
        while ready < len(pending) and pending[ready] == 0:
            ready += 1
        out[n] = ready - 1
    return reps, out
