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
  {"op": "watch", "token": T}
      -> {"ok": true, "desc": "<base64 cache descriptor>", "tp_size": N,
         "engine": E}, and the connection stays open, idle, for as long as
         both sides live: a decode worker connects to the cache ahead of its
         first pull and learns from the connection's end (the producer
         stopped or died: the kernel closes it) that it must connect again.

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
MAX_WATCHERS = 4096  # one per decode rank and prefill rank it reads from


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


def open_watch(host: str, port: int, token: str = "", timeout: float = 2.0) -> tuple:
    """(socket, reply) of a watch (above): the producer's cache descriptor
    (bytes), tp_size and engine, on a connection that ends when the producer
    does. The socket is non-blocking, with TCP keepalive (a peer whose host
    vanished ends it within about 30 s); the caller closes it."""
    try:
        s = socket.create_connection((host, port), timeout=timeout)
    except OSError as e:
        raise SideChannelError(f"side channel {host}:{port} (watch): {e}") from None
    try:
        s.settimeout(timeout)
        s.sendall(json.dumps({"op": "watch", "token": token}).encode() + b"\n")
        line = _read_line(s)
        reply = json.loads(line) if line else None
        if not isinstance(reply, dict):
            raise SideChannelError(f"side channel {host}:{port}: no watch reply")
        if not reply.get("ok"):
            raise SideChannelError(f"producer {host}:{port} refused the watch: "
                                   f"{reply.get('error')}")
        desc = base64.b64decode(reply["desc"], validate=True)
        tp_size = int(reply["tp_size"])
        if not 1 <= tp_size <= 1024:
            raise ValueError(f"tp_size {tp_size}")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, v in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
            if hasattr(socket, opt):
                s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), v)
        s.setblocking(False)
        return s, {"desc": desc, "tp_size": tp_size, "engine": str(reply.get("engine", ""))}
    except OSError as e:
        s.close()
        raise SideChannelError(f"side channel {host}:{port} (watch): {e}") from None
    except (KeyError, ValueError, TypeError) as e:
        s.close()
        raise SideChannelError(f"side channel {host}:{port}: malformed watch reply "
                               f"({type(e).__name__}: {e})") from None
    except BaseException:
        s.close()
        raise


class SideChannelServer:
    """The listener of one producer worker.

    ``lookup(req_id, stream)`` returns the published SequenceInfo bytes, None
    while not published yet (or, unless ``stream``, not written yet), or raises KeyError(reason) when it never will be;
    ``on_done(req_id, reader, readers)`` records a done notice. Call
    ``published()`` after each publish so that waiting lookups wake up.
    ``describe()`` answers a watch: {"desc": bytes, "tp_size": int, "engine":
    str} (None: watches are refused).
    """

    def __init__(self, host: str, port: int, lookup: Callable[[str, bool], Optional[bytes]],
                 on_done: Callable[[str, str, int], None], token: str = "",
                 describe: Optional[Callable[[], dict]] = None):
        self._lookup = lookup
        self._on_done = on_done
        self._describe = describe
        self._token = token
        self._cond = threading.Condition()
        self._watchers: set = set()  # open watch connections, closed by close()
        self._closed = False
        outer = self

        class Handler(socketserver.StreamRequestHandler):
            timeout = 10.0

            def handle(self):
                try:
                    line = self.rfile.readline(MAX_LINE + 1)
                    reply = outer._handle(line)
                except Exception as e:  # a bad peer never takes the listener down
                    reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                watch = reply.pop("_watch", False)
                try:
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()
                except OSError:
                    return
                if watch:
                    outer._hold(self.connection)

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

    def _hold(self, conn: socket.socket) -> None:
        """A watch: keeps the connection until the watcher closes it or
        close() does (this handler's thread waits in recv, nothing polls)."""
        with self._cond:
            if self._closed:
                return
            self._watchers.add(conn)
        try:
            conn.settimeout(None)
            while conn.recv(256):
                pass  # a watcher sends nothing; bytes from a confused one are dropped
        except OSError:
            pass
        finally:
            with self._cond:
                self._watchers.discard(conn)

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
        if not isinstance(req, str) and op != "watch":
            return {"ok": False, "error": f"req {req!r} is not a string"}
        if op == "watch":
            if self._describe is None:
                return {"ok": False, "error": "this side channel serves no watch"}
            with self._cond:
                if len(self._watchers) >= MAX_WATCHERS:
                    return {"ok": False, "error": f"{MAX_WATCHERS} watches open already"}
            d = self._describe()
            return {"ok": True, "desc": base64.b64encode(d["desc"]).decode(),
                    "tp_size": int(d["tp_size"]), "engine": str(d["engine"]), "_watch": True}
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
        with self._cond:
            self._closed = True
            watchers, self._watchers = list(self._watchers), set()
        for conn in watchers:  # the watchers learn that this producer is gone
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.published()
