"""A Mamba state between engines of different TP sizes: which bytes of
which prefill rank's state page go where in a decode rank's page.

A rank's state page (vLLM, VLLM_SSM_CONV_STATE_LAYOUT=DS) starts with its
conv state, [conv channels, kernel - 1] (a channel's rows contiguous), then
its temporal (SSM) state. The conv channels are sub-projections, each
sharded by TP on its own, and so is the temporal state (vLLM's
MambaStateShapeCalculator; NixlConnector reads the same parts,
ssm_conv_transfer_utils.py):

  Mamba2  x  intermediate_size channels     rank r of T: [r I/T, (r+1) I/T)
          B  n_groups * d_state channels    groups [r G/T, (r+1) G/T); with
          C  as B                           one group and T > 1 every rank
                                            holds group 0
          SSM [heads, head_dim, d_state]    heads [r H/T, (r+1) H/T)
  Mamba1  x  intermediate_size channels; SSM [channels, d_state] by channel
  GDN     Q, K  key_dim channels each; V value_dim channels;
          SSM [v heads, v head_dim, k head_dim] by v head

so a Mamba2 rank's page is |x_r|B_r|C_r|SSM_r| (GDN |Q_r|K_r|V_r|SSM_r|,
Mamba1 |x_r|SSM_r|), and another TP size needs a slice of each part of
every source page. Each part is a run of units (a channel's rows, a
group's d_state channels, an SSM head or channel) split like KV heads:
``copies`` intersects the unit ranges a decode rank needs with those each
source rank holds, in page bytes. SD conv layout ([kernel - 1, channels]:
a part is strided by the row) is refused by name.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from .layout import LayoutError

KINDS = ("MAMBA2", "MAMBA1", "GDN")


@dataclasses.dataclass(frozen=True)
class StateGeom:
    """A Mamba layer's state, the model's (global) sizes."""
    rows: int           # conv kernel - 1: the rows of one conv channel
    conv_es: int        # bytes of a conv element
    x: int              # Mamba1/2: intermediate_size (x channels); GDN: V channels
    n_groups: int       # Mamba2: the model's B (and C) groups; else 0
    d_state: int        # Mamba2: channels of one group; else 0
    heads: int          # units of the temporal state: SSM heads (Mamba2), channels
                        # (Mamba1), v heads (GDN)
    head_bytes: int     # one such unit's bytes
    kind: str = "MAMBA2"
    qk: int = 0         # GDN: Q (and K) channels

    def groups_at(self, tp: int) -> int:
        """vLLM's groups at TP ``tp`` (mamba_mixer2: one group is replicated
        on every rank, extra_groups_for_head_shards)."""
        return self.n_groups if self.n_groups % tp == 0 else tp

    def check_tp(self, tp: int) -> str:
        """Why vLLM cannot shard this state over ``tp`` ranks ("" when it can)."""
        if self.kind == "GDN":
            if self.qk % tp or self.x % tp or self.heads % tp:
                return (f"key_dim {self.qk} / value_dim {self.x} / {self.heads} v heads do not "
                        f"split over TP {tp}")
            return ""
        if self.x % tp or self.heads % tp:
            return f"intermediate_size {self.x} / {self.heads} SSM heads do not split over TP {tp}"
        if self.kind == "MAMBA2" and self.n_groups % tp and self.n_groups != 1:
            return f"n_groups {self.n_groups} neither divides by TP {tp} nor is 1"
        return ""

    def conv_bytes(self, tp: int) -> int:
        if self.kind == "MAMBA2":
            channels = self.x // tp + 2 * self.groups_at(tp) * self.d_state // tp
        else:  # Mamba1: x alone (qk 0); GDN: Q, K, V
            channels = (2 * self.qk + self.x) // tp
        return channels * self.rows * self.conv_es

    def state_bytes(self, tp: int) -> int:
        """One rank's state of one layer (conv then SSM) at TP ``tp``."""
        return self.conv_bytes(tp) + self.heads // tp * self.head_bytes

    def parts(self, tp: int, rank: int) -> list:
        """[(part, first unit, end unit, byte offset in the page, unit bytes)]
        of rank ``rank`` of ``tp``, units in the model's numbering."""
        ch = self.rows * self.conv_es
        nx = self.x // tp
        h = self.heads // tp
        ssm = ("ssm", rank * h, (rank + 1) * h, self.conv_bytes(tp), self.head_bytes)
        if self.kind == "MAMBA1":
            return [("x", rank * nx, (rank + 1) * nx, 0, ch), ssm]
        if self.kind == "GDN":
            nq = self.qk // tp
            return [("Q", rank * nq, (rank + 1) * nq, 0, ch),
                    ("K", rank * nq, (rank + 1) * nq, nq * ch, ch),
                    ("V", rank * nx, (rank + 1) * nx, 2 * nq * ch, ch), ssm]
        g = self.groups_at(tp) // tp
        g0 = rank * g if self.n_groups % tp == 0 else 0
        gb = self.d_state * ch
        return [("x", rank * nx, (rank + 1) * nx, 0, ch),
                ("B", g0, g0 + g, nx * ch, gb),
                ("C", g0, g0 + g, nx * ch + g * gb, gb), ssm]


def conv_layout() -> str:
    """This process's conv state layout, vLLM's: "DS" or "SD"."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
        return "DS" if is_conv_state_dim_first() else "SD"
    except Exception:  # no such vLLM: SD, the layout it always had
        return "SD"


def geometry(spec, hf_config, tp: int):
    """The StateGeom of a vLLM MambaSpec at this engine's TP ``tp``, or a
    string saying why this connector cannot move it between TP sizes."""
    mtype = getattr(spec, "mamba_type", "MAMBA2")
    mtype = getattr(mtype, "name", str(mtype))
    kind = next((k for k in KINDS if mtype.upper().startswith(k)), "")
    if not kind:
        return (f"its state is a {mtype} layer's (between TP sizes: Mamba1, Mamba2 and GDN, "
                "as vLLM's NixlConnector)")
    if conv_layout() != "DS":
        return ("its conv state is laid out SD ([kernel - 1, channels]): between TP sizes "
                "it needs VLLM_SSM_CONV_STATE_LAYOUT=DS on both engines, as vLLM's "
                "NixlConnector does")
    shapes = [tuple(int(d) for d in s) for s in spec.shapes]
    import torch
    es = [torch.empty(0, dtype=d).element_size() for d in spec.dtypes]
    if kind != "MAMBA2":
        return _geometry_of(kind, shapes, es, tp)
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return f"state shapes {shapes} are not Mamba2's (conv [C, K-1], SSM [H, P, N])"
    (dim_l, rows), (heads_l, head_dim, d_state) = shapes
    n_groups = next((int(getattr(hf_config, a)) for a in ("mamba_n_groups", "n_groups",
                                                          "ngroups")
                     if isinstance(getattr(hf_config, a, None), int)), 0)
    if n_groups <= 0:
        return "the model config names no n_groups (mamba_n_groups, n_groups)"
    geom = StateGeom(rows=rows, conv_es=es[0], x=heads_l * tp * head_dim, n_groups=n_groups,
                     d_state=d_state, heads=heads_l * tp,
                     head_bytes=head_dim * d_state * es[1])
    why = geom.check_tp(tp)
    if why:
        return why
    if dim_l * tp != geom.x + 2 * geom.groups_at(tp) * d_state:
        return (f"conv channels {dim_l} x TP {tp} are not intermediate_size {geom.x} + 2 x "
                f"{geom.groups_at(tp)} groups x d_state {d_state}")
    return geom


def _geometry_of(kind: str, shapes: list, es: list, tp: int):
    """geometry() of a Mamba1 or GDN layer from its rank's shapes."""
    if kind == "MAMBA1":
        if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 2 or \
                shapes[0][0] != shapes[1][0]:
            return f"state shapes {shapes} are not Mamba1's (conv [C, K-1], SSM [C, N])"
        (dim_l, rows), (_, d_state) = shapes
        geom = StateGeom(rows=rows, conv_es=es[0], x=dim_l * tp, n_groups=0, d_state=0,
                         heads=dim_l * tp, head_bytes=d_state * es[1], kind=kind)
        return geom.check_tp(tp) or geom
    if len(shapes) != 2 or len(shapes[0]) != 2 or len(shapes[1]) != 3:
        return f"state shapes {shapes} are not GDN's (conv [C, K-1], SSM [Hv, Dv, Dk])"
    (dim_l, rows), (heads_l, v_dim, k_dim) = shapes
    value_l = heads_l * v_dim
    if dim_l <= value_l or (dim_l - value_l) % 2:
        return (f"conv channels {dim_l} are not 2 x key_dim + value_dim {value_l} "
                f"({heads_l} v heads x {v_dim})")
    geom = StateGeom(rows=rows, conv_es=es[0], x=value_l * tp, n_groups=0, d_state=0,
                     heads=heads_l * tp, head_bytes=v_dim * k_dim * es[1], kind=kind,
                     qk=(dim_l - value_l) // 2 * tp)
    return geom.check_tp(tp) or geom


def sources(prefill_tp: int, decode_tp: int, rank: int) -> list:
    """The prefill ranks decode rank ``rank`` reads its state from."""
    if prefill_tp >= decode_tp:
        k = prefill_tp // decode_tp
        return list(range(rank * k, (rank + 1) * k))
    return [rank // (decode_tp // prefill_tp)]


def refusal(geom, prefill_tp: int, decode_tp: int) -> str:
    """Why a state of ``geom`` (a StateGeom, or why there is none) cannot
    move from TP ``prefill_tp`` to TP ``decode_tp`` ("" when it can)."""
    if not isinstance(geom, StateGeom):
        return str(geom or "its geometry is unknown")
    big, small = max(prefill_tp, decode_tp), min(prefill_tp, decode_tp)
    if big % small:
        return f"TP {big} is not a multiple of TP {small}"
    return geom.check_tp(prefill_tp) or geom.check_tp(decode_tp)


def copies(geom: StateGeom, prefill_tp: int, srcs: Sequence[int], decode_tp: int,
           rank: int) -> list:
    """[(source index into ``srcs``, source offset, destination offset,
    bytes)]: every byte of decode rank ``rank``'s state page, from the
    first source holding it, neighbours merged. Raises LayoutError naming a
    part no source holds."""
    out: list = []
    theirs = [geom.parts(prefill_tp, p) for p in srcs]
    for k, (name, lo, hi, off, unit) in enumerate(geom.parts(decode_tp, rank)):
        u = lo
        while u < hi:
            for i, parts in enumerate(theirs):
                _, plo, phi, poff, _ = parts[k]
                if plo <= u < phi:
                    end = min(hi, phi)
                    run = (i, poff + (u - plo) * unit, off + (u - lo) * unit, (end - u) * unit)
                    if out and out[-1][0] == i and out[-1][1] + out[-1][3] == run[1] \
                            and out[-1][2] + out[-1][3] == run[2]:
                        out[-1] = (i, out[-1][1], out[-1][2], out[-1][3] + run[3])
                    else:
                        out.append(run)
                    u = end
                    break
            else:
                raise LayoutError(f"state part {name} unit {u} of decode rank {rank} (TP "
                                  f"{decode_tp}) is on none of prefill ranks {list(srcs)} "
                                  f"(TP {prefill_tp})")
    return out
