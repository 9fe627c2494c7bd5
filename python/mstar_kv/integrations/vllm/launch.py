"""Starts a prefill vLLM server and a decode vLLM server with MstarKVConnector
and the proxy in front of them, on this host.

    python -m mstar_kv.integrations.vllm.launch --model DIR [--engine ucx]
        [--port 8000] [--prompt-ids 1,2,3 | --prompt TEXT] [--] [vllm serve args...]

Waits until both engines answer /health, prints the proxy's URL, and with
--prompt/--prompt-ids sends one completion through prefill and decode,
prints it and exits; otherwise runs until interrupted. Everything it started
is stopped when it exits.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from .proxy import make_server, post_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cmd(model: str, port: int, role: str, engine: str, side_port: int, extra) -> list:
    cfg = {"kv_connector": "MstarKVConnector",
           "kv_connector_module_path": "mstar_kv.integrations.vllm", "kv_role": role,
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"engine": engine, "side_channel_port": side_port}}
    if role == "kv_consumer":  # connected to the prefill before the first request
        cfg["kv_connector_extra_config"]["prefill_peers"] = [f"127.0.0.1:{side_port}"]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
            "--host", "127.0.0.1", "--port", str(port), "--kv-transfer-config", json.dumps(cfg),
            *extra]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy within {timeout} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", default="ucx")
    ap.add_argument("--port", type=int, default=8000, help="the proxy's port")
    ap.add_argument("--prompt")
    ap.add_argument("--prompt-ids", help="comma-separated token ids")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("serve_args", nargs="*", help="passed to both vLLM servers")
    args = ap.parse_args(argv)
    pp, dp, side = free_port(), free_port(), free_port()
    procs = []
    # Stopped by SIGTERM (a service manager, a test), Python would exit
    # without the finally below and leave both servers running in their own
    # process groups: exit through it instead.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for role, port in (("kv_producer", pp), ("kv_consumer", dp)):
            procs.append(subprocess.Popen(
                serve_cmd(args.model, port, role, args.engine, side, args.serve_args),
                process_group=0, env=dict(os.environ, HF_HUB_OFFLINE="1")))
        urls = [f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{dp}"]
        for u, p in zip(urls, procs):
            wait_healthy(u, p, args.start_timeout)
        srv = make_server("127.0.0.1", args.port, [urls[0]], [urls[1]])
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        proxy = f"http://127.0.0.1:{srv.server_address[1]}"
        print(f"prefill {urls[0]}  decode {urls[1]}  proxy {proxy}", flush=True)
        if args.prompt is None and args.prompt_ids is None:
            while True:
                time.sleep(3600)
        prompt = args.prompt if args.prompt is not None else \
            [int(x) for x in args.prompt_ids.split(",")]
        status, out = post_json(proxy + "/v1/completions",
                                {"model": args.model, "prompt": prompt,
                                 "max_tokens": args.max_tokens, "temperature": 0,
                                 "return_token_ids": True}, 600)
        print(json.dumps({"status": status, "response": out}), flush=True)
        return 0 if status == 200 else 1
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


if __name__ == "__main__":
    sys.exit(main())
