"""The producer's side channel: published sequences out, done notices in.

One small TCP listener per prefill worker (TP rank r on port + r). Each
connection carries one JSON line and gets one JSON line back:

  {"op": "seq", "req": ID, "timeout": S, "token": T, "stream": B}
      -> {"ok": true, "seq": "<base64 SequenceInfo bytes>"} once the worker
         published request ID and wrote every layer of it (with "stream":
         true, once it published it: the reader streams the layers as they
         are marked), waiting at most S seconds, or {"ok": false, "error":
         "..."} (unknown, freed, timed out).
  {"op": "done", "req": ID, "reader": NAME, "readers": N, "token": T}
      -> {"ok": true}; the request's blocks are freed once N distinct readers
         (the decode engine's TP ranks) sent it, or when its lease expires.

It exists because mstar-kv's shm and cuda_ipc engines have no channel from
reader to owner (the done notice), and for params that do not carry the
descriptors (too large, or made by a client before the prefill ran), or
whose predicted epochs turned out stale. A pull whose params carry them
does not use it before the pull. ``token`` is checked (constant time) when the producer has an
auth_token. Every read and write has a timeout: a dead peer is an error in
bounded time.
"""
from __future__ import annotations

import base64
import hmac
import json
import socket
import socketserver
import threading
from typing import Callable, Optional

MAX_LINE = 1 << 16


class SideChannelError(RuntimeError):
    """The producer could not be reached, or refused (the message says why)."""


def _read_line(sock: socket.socket) -> bytes:
    buf = bytearray()
    while not buf.endswith(b"\n"):
        chunk = sock.recv(4096)
        if not chunk:
            break
        buf += chunk
        if len(buf) > MAX_LINE:
            raise SideChannelError(f"side channel line longer than {MAX_LINE} bytes")
    return bytes(buf)


def call(host: str, port: int, msg: dict, timeout: float) -> dict:
    """Sends one request, returns the reply; SideChannelError within
    ``timeout`` (plus the reply's own wait) when the peer is unreachable."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout + float(msg.get("timeout", 0.0)))
            s.sendall(json.dumps(msg).encode() + b"\n")
            line = _read_line(s)
    except OSError as e:
        raise SideChannelError(f"side channel {host}:{port} ({msg.get('op')}): {e}") from None
    if not line:
        raise SideChannelError(f"side channel {host}:{port} closed without a reply")
    try:
        reply = json.loads(line)
    except ValueError:
        raise SideChannelError(f"side channel {host}:{port}: reply is not JSON") from None
    if not isinstance(reply, dict):
        raise SideChannelError(f"side channel {host}:{port}: reply is not an object")
    return reply


def fetch_sequence(host: str, port: int, request_id: str, wait: float, token: str = "",
                   connect_timeout: float = 5.0, stream: bool = False) -> bytes:
    """The SequenceInfo bytes the producer published for ``request_id``
    (once every layer is written, unless ``stream``)."""
    r = call(host, port, {"op": "seq", "req": request_id, "timeout": wait, "token": token,
                          "stream": bool(stream)}, connect_timeout)
    if not r.get("ok"):
        raise SideChannelError(f"producer {host}:{port} has no sequence for request "
                               f"{request_id!r}: {r.get('error')}")
    try:
        return base64.b64decode(r["seq"], validate=True)
    except (KeyError, ValueError, TypeError):
        raise SideChannelError(f"producer {host}:{port}: malformed sequence reply") from None


def send_done(host: str, port: int, request_id: str, reader: str, readers: int,
              token: str = "", timeout: float = 5.0) -> None:
    r = call(host, port, {"op": "done", "req": request_id, "reader": reader,
                          "readers": int(readers), "token": token}, timeout)
    if not r.get("ok"):
        raise SideChannelError(f"producer {host}:{port} refused the done notice of "
                               f"{request_id!r}: {r.get('error')}")


class SideChannelServer:
    """The listener of one producer worker.

    ``lookup(req_id, stream)`` returns the published SequenceInfo bytes, None
    while not published yet (or, unless ``stream``, not written yet), or raises KeyError(reason) when it never will be;
    ``on_done(req_id, reader, readers)`` records a done notice. Call
    ``published()`` after each publish so that waiting lookups wake up.
    """

    def __init__(self, host: str, port: int, lookup: Callable[[str, bool], Optional[bytes]],
                 on_done: Callable[[str, str, int], None], token: str = ""):
        self._lookup = lookup
        self._on_done = on_done
        self._token = token
        self._cond = threading.Condition()
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = 10.0

            def handle(self):
                try:
                    line = self.rfile.readline(MAX_LINE + 1)
                    reply = outer._handle(line)
                except Exception as e:  # a bad peer never takes the listener down
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        try:
            self._server = Server((host, port), Handler)
        except OSError as e:
            raise SideChannelError(f"side channel cannot listen on {host}:{port}: {e}") from None
        self.address = self._server.server_address
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="mstar-kv-side-channel", daemon=True)
        self._thread.start()

    def published(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _handle(self, line: bytes) -> dict:
        if len(line) > MAX_LINE:
            return {"ok": False, "error": f"request longer than {MAX_LINE} bytes"}
        msg = json.loads(line)
        if not isinstance(msg, dict):
            return {"ok": False, "error": "request is not an object"}
        if self._token and not hmac.compare_digest(str(msg.get("token", "")).encode(),
                                                   self._token.encode()):
            return {"ok": False, "error": "permission denied (auth_token)"}
        op, req = msg.get("op"), msg.get("req")
        if not isinstance(req, str):
            return {"ok": False, "error": f"req {req!r} is not a string"}
        if op == "seq":
            wait = min(max(float(msg.get("timeout", 0.0)), 0.0), 600.0)
            stream = msg.get("stream", False) is True
            with self._cond:
                try:
                    ok = self._cond.wait_for(lambda: self._lookup(req, stream) is not None, wait)
                except KeyError as e:
                    return {"ok": False, "error": str(e.args[0] if e.args else e)}
                if not ok:
                    return {"ok": False, "error": f"not published within {wait} s"}
                data = self._lookup(req, stream)
            return {"ok": True, "seq": base64.b64encode(data).decode()}
        if op == "done":
            readers = int(msg.get("readers", 1))
            if not 1 <= readers <= 1024:
                return {"ok": False, "error": f"readers {readers} out of range [1, 1024]"}
            self._on_done(req, str(msg.get("reader", "")), readers)
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self.published()
