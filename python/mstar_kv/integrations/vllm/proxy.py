"""A small P/D proxy: each completion goes to the prefill engine first (with
kv_transfer_params {"do_remote_decode": true} and max_tokens 1), then to the
decode engine with the kv_transfer_params the prefill returned; the client
gets the decode engine's answer. Standard library only.

    python -m mstar_kv.integrations.vllm.proxy --prefill http://127.0.0.1:8100 \\
        --decode http://127.0.0.1:8200 --port 8000

Serves POST /v1/completions and /v1/chat/completions (non-streaming; a
"stream" request is refused with 400), GET /health. Round-robins over
several --prefill / --decode URLs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATHS = ("/v1/completions", "/v1/chat/completions")


def post_json(url: str, body: dict, timeout: float) -> tuple:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")}


def route(prefill_url: str, decode_url: str, path: str, body: dict, timeout: float) -> tuple:
    """Prefill, then decode with the prefill's kv_transfer_params."""
    first = dict(body, max_tokens=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True})
    first.pop("max_completion_tokens", None)
    status, p = post_json(prefill_url + path, first, timeout)
    if status != 200:
        return status, {"error": f"prefill engine {prefill_url}: {p.get('error', p)}"}
    params = p.get("kv_transfer_params")
    if not params:
        return 502, {"error": f"prefill engine {prefill_url} returned no kv_transfer_params "
                              "(is it started with kv_role kv_producer?)"}
    return post_json(decode_url + path, dict(body, kv_transfer_params=params), timeout)


def make_server(host: str, port: int, prefills, decodes, timeout: float = 600.0):
    p_cycle, d_cycle = itertools.cycle(prefills), itertools.cycle(decodes)
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"prefill": prefills, "decode": decodes})
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self):
            if self.path not in PATHS:
                return self._send(404, {"error": f"no route {self.path}"})
            try:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n))
                assert isinstance(body, dict)
            except Exception:
                return self._send(400, {"error": "the body is not a JSON object"})
            if body.get("stream"):
                return self._send(400, {"error": "streaming is not supported by this proxy"})
            with lock:
                pu, du = next(p_cycle), next(d_cycle)
            try:
                status, out = route(pu, du, self.path, body, timeout)
            except OSError as e:
                status, out = 502, {"error": f"engine unreachable: {e}"}
            self._send(status, out)

        def log_message(self, fmt, *args):
            sys.stderr.write("proxy: " + fmt % args + "\n")

    return ThreadingHTTPServer((host, port), Handler)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="prefill engine URL")
    ap.add_argument("--decode", action="append", required=True, help="decode engine URL")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args(argv)
    srv = make_server(args.host, args.port, [u.rstrip("/") for u in args.prefill],
                      [u.rstrip("/") for u in args.decode])
    print(f"proxy on http://{args.host}:{srv.server_address[1]}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
