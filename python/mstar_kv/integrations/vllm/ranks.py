"""Decode side: which prefill ranks a decode rank reads from and sends its
done notices to, between engines of any TP sizes, and the checks a
producer's params pass before a pull starts (what the two engines must
agree on, and what this decode engine refuses, naming both sides)."""
from __future__ import annotations

from . import state_tp
from .groups import has_state, state_tp_refusal
from .layout import KV_LATENT, KV_PLANES, heads_of_rank
from .params import ConnectorConfig, RemotePrefill
from .peers import refuse_configured


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


class SourceRanks:
    """Decode rank ``tp_rank`` of ``tp_size``: attention heads come from the
    prefill ranks holding them (a latent cache: from one rank, the decode
    ranks spread over them); a state group's state from this rank's own
    shard, or part by part when it moves between TP sizes (``splits``:
    the consumer has a state_move.StateMover)."""

    def __init__(self, cfg: ConnectorConfig, groups, tp_rank: int, tp_size: int,
                 splits: bool, model_kv_heads: int, cell_layout: str, block_size: int):
        self.cfg = cfg
        self.groups = list(groups)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._can_split = splits
        self._state = bool(self.groups) and has_state(self.groups)
        self.model_kv_heads = model_kv_heads  # of the model, over every rank
        self.cell_layout = cell_layout
        self.block_size = block_size

    def refusal(self, prefill_tp: int, prefill: str) -> str:
        """Why this engine cannot load from a prefill engine of
        ``prefill_tp`` ranks ("" when it can)."""
        if not self.groups:
            return ""
        why = state_tp_refusal(self.groups, prefill_tp, self.tp_size, prefill)
        if not why and prefill_tp != self.tp_size and self._state and not self._can_split:
            why = (f"the prefill engine {prefill} runs TP {prefill_tp}, this decode engine TP "
                   f"{self.tp_size}, and this consumer has no staging cache for a state")
        return why

    def refuse_configured_peers(self) -> None:
        """Engine start: a model with a state group loads from a prefill
        engine of another TP size only when its state splits over both
        (groups.state_tp_refusal); a prefill engine in prefill_peers that
        is up and runs a TP size it cannot load from fails this start,
        naming both. One that is not up yet is checked when the peer keeper
        reaches it, and every request's params before its load starts."""
        if self._state:
            refuse_configured(self.cfg.prefill_peers, self.cfg.engine_options.get(
                "auth_token", ""), self.refusal)

    def sources(self, rp: RemotePrefill) -> list:
        return self.of_tp(rp.tp_size)

    def of_tp(self, tp_size: int) -> list:
        """The ranks of a prefill engine of ``tp_size`` ranks this rank reads."""
        return self.read_by(self.tp_rank, tp_size)

    def splits_state(self, tp_size: int) -> bool:
        """A state group from a prefill engine of another TP size (moved part
        by part, state_move.py)."""
        return self._can_split and tp_size != self.tp_size

    def attention(self, d: int, tp_size: int) -> list:
        """The prefill ranks (of ``tp_size``) decode rank d reads attention from."""
        if self.cell_layout == KV_LATENT:
            # Every prefill rank holds the whole latent: one source, the
            # decode ranks spread over them.
            return [d % tp_size]
        total = self.model_kv_heads
        mine = heads_of_rank(total, self.tp_size, d)
        return [p for p in range(tp_size) if _overlap(heads_of_rank(total, tp_size, p), mine)]

    def read_by(self, d: int, tp_size: int) -> list:
        """Every prefill rank decode rank d reads (attention and state)."""
        if self._state:
            if not self.splits_state(tp_size):
                return [d]  # a state is this rank's shard, whatever the heads
            return sorted(set(self.attention(d, tp_size))
                          | set(state_tp.sources(tp_size, self.tp_size, d)))
        return self.attention(d, tp_size)

    def notified(self, rp: RemotePrefill, d: int) -> list:
        """The prefill ranks decode rank d sends a done notice to: those it
        reads from and, for a latent cache, those no decode rank reads from
        (they hold the request too, until told)."""
        if self._state:
            if self.splits_state(rp.tp_size) and not self.refusal(rp.tp_size, ""):
                return self.read_by(d, rp.tp_size)  # those it read from
            # Its own rank; with another TP size (a refused load: a release)
            # every prefill rank is told by one decode rank.
            return [p for p in range(rp.tp_size) if p % self.tp_size == d]
        if self.cell_layout != KV_LATENT:
            total = self.model_kv_heads
            mine = heads_of_rank(total, self.tp_size, d)
            return [p for p in range(rp.tp_size)
                    if _overlap(heads_of_rank(total, rp.tp_size, p), mine)]
        return sorted({d % rp.tp_size} | {p for p in range(rp.tp_size) if p % self.tp_size == d})

    def readers_of(self, rp: RemotePrefill, p: int) -> int:
        """How many of this engine's ranks send prefill rank p a done notice."""
        return sum(1 for d in range(self.tp_size) if p in self.notified(rp, d))

    def check(self, rp: RemotePrefill) -> None:
        """Raises RuntimeError naming what a producer's params disagree on."""
        if rp.engine != self.cfg.engine:
            raise RuntimeError(f"the producer moves KV with {rp.engine!r}, this engine with "
                               f"{self.cfg.engine!r}")
        if rp.cell_layout != self.cell_layout:
            raise RuntimeError(f"the producer stores K and V as {rp.cell_layout}, this "
                               f"engine as {self.cell_layout}")
        if self.cell_layout == KV_PLANES and rp.block_size != self.block_size:
            raise RuntimeError(f"K and V planes need one block size: the producer's is "
                               f"{rp.block_size}, this engine's {self.block_size}")
        if rp.groups and not self.groups:
            raise RuntimeError(f"the producer has {len(rp.groups)} KV cache groups, this "
                               "engine 1")
        if self.groups and not rp.groups and self._state:
            raise RuntimeError("params that name no KV cache groups (made before the prefill "
                               "ran) cannot say how many tokens a Mamba state holds")
        why = self.refusal(rp.tp_size, f"{rp.host}:{rp.port}")
        if why:
            raise RuntimeError(why)
        if self._state:
            mine = state_tp.conv_layout()
            if rp.conv_layout != mine and (rp.conv_layout or self.splits_state(rp.tp_size)):
                raise RuntimeError(f"the producer's conv state layout is "
                                   f"{rp.conv_layout or 'not said'}, this engine's {mine} "
                                   "(VLLM_SSM_CONV_STATE_LAYOUT must be the same on both)")
        if self.groups and rp.block_size != self.block_size:
            raise RuntimeError(f"several KV cache groups need one block size: the producer's "
                               f"is {rp.block_size}, this engine's {self.block_size}")
