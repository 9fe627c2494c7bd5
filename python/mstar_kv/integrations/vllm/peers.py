"""Decode side: the prefill ranks a decode worker stays connected to, so
that no pull waits for a connect.

Connecting is the costly part of a first pull from a new peer: over ucx a
connection and its handshake (about 15 times a small pull), over shm the
cross-memory attach. PeerKeeper does it on its own thread, ahead of the
pulls: for each prefill engine named in prefill_peers when the worker
starts, and for every other one from its first pull on. For each prefill
rank this worker reads from it holds a watch on the rank's side channel
(side_channel.py): the reply carries the rank's cache descriptor, which it
connects to (KVTransferManager.connect); the watch's connection ending
tells it that the producer stopped or died, and it connects again, to the
new descriptor, once the producer is back. Pulls whose sources are all
connected start on the engine's thread (consumer.py).

Nothing here polls a peer that is up: the thread sleeps in select() on the
watches. A peer that is down is retried with a backoff from 0.1 s to 2 s;
one that was only learned from a pull is forgotten after 5 minutes down
(its next pull learns it again). Every network call is bounded: the watch
by CONNECT_TIMEOUT_S, the connect by the engine's timeout.
"""
from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from typing import Callable, Optional

import mstar_kv as kv

from .side_channel import SideChannelError, open_watch

log = logging.getLogger("mstar_kv.vllm")

# Engines whose KVTransferManager.connect opens what a first pull would
# (the others, cuda_ipc, have nothing to open ahead: their first pull opens
# its handles itself, so it stays off the engine's thread).
CONNECTS_AHEAD = ("ucx", "shm", "mooncake")
CONNECT_TIMEOUT_S = 2.0
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 2.0
FORGET_LEARNED_S = 300.0
MAX_LOST_KEYS = 1024


def refuse_configured(peers, token: str, refusal: Callable[[int, str], str]) -> None:
    """Engine start: asks each prefill engine of ``peers`` ((host, port), ...)
    that is up its TP size, and raises LayoutError with ``refusal(tp_size,
    where)`` when that is not "" (one not up is checked by the keeper when
    it is). Bounded: CONNECT_TIMEOUT_S an engine."""
    from .layout import LayoutError
    for host, port in peers:
        try:
            sock, rep = open_watch(host, port, token, CONNECT_TIMEOUT_S)
        except (SideChannelError, OSError, ValueError) as e:
            log.info("MstarKVConnector: prefill engine %s:%d not up at start (its TP size is "
                     "checked when it is): %s", host, port, e)
            continue
        sock.close()
        why = refusal(rep["tp_size"], f"{host}:{port} (prefill_peers)")
        if why:
            raise LayoutError(why)


def peer_key(info: "kv.KVTransferInfo") -> tuple:
    """A producer rank's cache, whatever the epoch of one sequence in it."""
    return info.engine, bytes(info.payload)


class PeerRefused(RuntimeError):
    """A prefill engine this worker cannot load from (another TP size with
    a state group): not connected, said as an error."""


class _Engine:
    """A prefill engine: the side channel of its rank 0."""
    __slots__ = ("host", "port", "tp_size", "configured")

    def __init__(self, host: str, port: int, tp_size: Optional[int], configured: bool):
        self.host, self.port, self.tp_size, self.configured = host, port, tp_size, configured


class _Rank:
    __slots__ = ("engine", "rank", "sock", "info", "key", "delay", "next_try", "down_since",
                 "error", "recheck", "connects")

    def __init__(self, engine: _Engine, rank: int):
        self.engine = engine
        self.rank = rank
        self.sock: Optional[socket.socket] = None
        self.info = None
        self.key: Optional[tuple] = None
        self.delay = FIRST_RETRY_S
        self.next_try = 0.0
        self.down_since: Optional[float] = None
        self.error = ""
        self.recheck = False
        self.connects = 0

    @property
    def addr(self) -> tuple:
        return self.engine.host, self.engine.port + self.rank


class PeerKeeper:
    """``connect(info)`` opens a descriptor's peer (the manager's connect);
    ``on_up(key)`` / ``on_down(key)`` tell the consumer which caches are
    connected (peer_key); ``sources(tp_size)`` are the prefill ranks this
    worker reads from; ``engine`` the transfer engine both sides must use;
    ``refusal(tp_size, "HOST:PORT")`` why this worker cannot load from a
    prefill engine of that TP size ("" when it can): such an engine is not
    connected (an error in the log, retried in case it restarts with
    another). For an engine not in CONNECTS_AHEAD it keeps nothing (no
    thread)."""

    def __init__(self, connect: Callable, on_up: Callable, on_down: Callable,
                 sources: Callable[[int], list], engine: str, token: str = "",
                 refusal: Optional[Callable[[int, str], str]] = None):
        self._connect = connect
        self._refusal = refusal
        self._on_up = on_up
        self._on_down = on_down
        self._sources = sources
        self._engine_name = engine
        self._token = token
        self._lock = threading.Lock()
        self._engines: dict = {}   # (host, port) -> _Engine
        self._ranks: dict = {}     # (host, port + rank) -> _Rank
        self._inbox: list = []     # (what, args) for the thread
        self._lost: set = set()    # keys whose watch ended (not connected any more)
        self._closed = engine not in CONNECTS_AHEAD
        self.stats = {"peer_connects": 0, "peer_connect_failures": 0, "peers_lost": 0}
        if self._closed:
            self._thread = None
            return
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="mstar-kv-peers", daemon=True)
        self._thread.start()

    # -- any thread ---------------------------------------------------------
    def add(self, host: str, port: int, tp_size: Optional[int] = None,
            configured: bool = False) -> None:
        """Keep the prefill engine whose rank 0 side channel is host:port
        connected (tp_size None: asked of its rank 0)."""
        self._post("add", (host, int(port), tp_size, configured))

    def learn(self, host: str, port: int, tp_size: int) -> None:
        """A pull named this engine (the engine's thread: a lookup unless new)."""
        if self._thread is not None and (host, port) not in self._engines:
            self._post("add", (host, int(port), int(tp_size), False))

    def recheck(self, key: tuple) -> None:
        """A pull from this cache failed: connect again in the background (a
        no-op for a connection that is fine), and say so when it is up."""
        self._post("recheck", (key,))

    def lost(self, key: tuple) -> bool:
        """This cache's producer went away (its watch ended) and has not
        been connected again under this descriptor."""
        return key in self._lost

    def status(self) -> dict:
        """{"HOST:PORT": {"state": "connected" | "down", "error", "connects"}}
        of each prefill rank kept, PORT its side channel's."""
        with self._lock:
            return {f"{r.addr[0]}:{r.addr[1]}": {
                "state": "connected" if r.sock is not None else "down",
                "error": r.error, "connects": r.connects} for r in self._ranks.values()}

    def close(self, timeout: float = 5.0) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._closed = True
        self._wake()
        self._thread.join(timeout)

    def _post(self, what: str, args: tuple) -> None:
        with self._lock:
            if self._closed:
                return
            self._inbox.append((what, args))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # full (a wake-up is pending already) or closed
            pass

    # -- the keeper's thread -------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    inbox, self._inbox = self._inbox, []
                for what, args in inbox:
                    if what == "add":
                        self._add(*args)
                    else:
                        self._recheck_key(*args)
                now = time.monotonic()
                for r in list(self._ranks.values()):
                    if r.sock is None and r.next_try <= now:
                        self._bring_up(r)
                    elif r.sock is not None and r.recheck:
                        self._recheck(r)
                self._forget_learned()
                waits = [r.next_try for r in self._ranks.values() if r.sock is None]
                timeout = max(0.0, min(waits) - time.monotonic()) if waits else None
                for key, _ in self._sel.select(timeout):
                    if key.data is None:
                        try:
                            while self._wake_r.recv(4096):
                                pass
                        except OSError:
                            pass
                    else:
                        self._check(key.data)
        except Exception:  # never silently: pulls then connect on their own path
            log.exception("MstarKVConnector: the peer keeper stopped")
        finally:
            self._shut()

    def _add(self, host: str, port: int, tp_size: Optional[int], configured: bool) -> None:
        e = self._engines.get((host, port))
        if e is None:
            e = _Engine(host, port, tp_size, configured)
            with self._lock:
                self._engines[(host, port)] = e
        e.configured = e.configured or configured
        if tp_size is not None and e.tp_size != tp_size:
            e.tp_size = tp_size
        self._place_ranks(e)

    def _place_ranks(self, e: _Engine) -> None:
        """The ranks of ``e`` to keep: rank 0 while its TP size is unknown,
        then the ranks this worker reads from."""
        want = {0} if e.tp_size is None else set(self._sources(e.tp_size))
        with self._lock:
            for rank in want:
                addr = (e.host, e.port + rank)
                if addr not in self._ranks:
                    self._ranks[addr] = _Rank(e, rank)
            drop = [r for r in self._ranks.values() if r.engine is e and r.rank not in want]
            for r in drop:
                del self._ranks[r.addr]
        for r in drop:
            self._close_rank(r)

    def _bring_up(self, r: _Rank) -> None:
        host, port = r.addr
        try:
            sock, rep = open_watch(host, port, self._token, CONNECT_TIMEOUT_S)
        except SideChannelError as e:
            return self._failed(r, e)
        try:
            if rep["engine"] != self._engine_name:
                raise RuntimeError(f"the producer moves KV with {rep['engine']!r}, this engine "
                                   f"with {self._engine_name!r}")
            e = r.engine
            why = self._refusal(rep["tp_size"], f"{e.host}:{e.port}") if self._refusal else ""
            if why:
                raise PeerRefused(why)
            if e.tp_size != rep["tp_size"]:
                e.tp_size = rep["tp_size"]
                self._place_ranks(e)
                if self._ranks.get(r.addr) is not r:  # not a rank this worker reads from
                    sock.close()
                    return None
            info = kv.KVTransferInfo.from_bytes(rep["desc"])
            self._connect(info)  # bounded by the engine's timeout
        except Exception as e:  # a refused or broken peer: retried, never raised
            sock.close()
            return self._failed(r, e)
        key = peer_key(info)
        was_down = r.down_since is not None and r.connects > 0
        with self._lock:
            r.sock, r.info, r.key = sock, info, key
            r.delay, r.error, r.down_since, r.recheck = FIRST_RETRY_S, "", None, False
            r.connects += 1
            self.stats["peer_connects"] += 1
            self._lost.discard(key)
        self._sel.register(sock, selectors.EVENT_READ, r)
        self._on_up(key)
        log.info("MstarKVConnector: %s prefill rank %s:%d (rank %d)", "reconnected to" if
                 was_down else "connected to", host, port, r.rank)
        return None

    def _failed(self, r: _Rank, e: BaseException) -> None:
        now = time.monotonic()
        with self._lock:
            first = r.down_since is None or not r.error
            changed = r.error != f"{type(e).__name__}: {e}"
            r.error = f"{type(e).__name__}: {e}"
            if r.down_since is None:
                r.down_since = now
            r.next_try = now + r.delay
            r.delay = min(r.delay * 2, MAX_RETRY_S)
            self.stats["peer_connect_failures"] += 1
        if isinstance(e, PeerRefused):
            (log.error if changed else log.debug)("MstarKVConnector: prefill rank %s:%d refused "
                                                  "(not connected): %s", *r.addr, r.error)
            return
        (log.warning if first else log.debug)(
            "MstarKVConnector: prefill rank %s:%d not connected (retrying in the "
            "background, pulls from it connect on their own): %s", r.addr[0], r.addr[1], r.error)

    def _check(self, r: _Rank) -> None:
        """The watch of ``r`` is readable: the producer closed it (or sent
        bytes it should not: dropped)."""
        try:
            if r.sock.recv(256):
                return
            why = "the producer closed its side channel"
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            why = f"side channel: {e}"
        self._down(r, why)

    def _down(self, r: _Rank, why: str) -> None:
        self._close_rank(r)
        with self._lock:
            r.error = why
            r.down_since = time.monotonic()
            r.next_try = r.down_since  # a restart: try again at once
            r.delay = FIRST_RETRY_S
            self.stats["peers_lost"] += 1
        log.info("MstarKVConnector: prefill rank %s:%d gone (%s); reconnecting in the "
                 "background", r.addr[0], r.addr[1], why)

    def _close_rank(self, r: _Rank) -> None:
        if r.sock is not None:
            try:
                self._sel.unregister(r.sock)
            except (KeyError, ValueError):
                pass
            r.sock.close()
        with self._lock:
            r.sock = None
            if r.key is not None:
                if len(self._lost) >= MAX_LOST_KEYS:
                    self._lost.clear()
                self._lost.add(r.key)
        if r.key is not None:
            self._on_down(r.key)
        r.key = r.info = None

    def _recheck_key(self, key: tuple) -> None:
        for r in self._ranks.values():
            if r.key == key and r.sock is not None:
                r.recheck = True

    def _recheck(self, r: _Rank) -> None:
        r.recheck = False
        try:
            self._connect(r.info)  # the cached connection, or a new one
        except Exception as e:
            self._down(r, f"{type(e).__name__}: {e}")
            return
        self._on_up(r.key)

    def _forget_learned(self) -> None:
        now = time.monotonic()
        for e in list(self._engines.values()):
            ranks = [r for r in self._ranks.values() if r.engine is e]
            if e.configured or not ranks or any(
                    r.down_since is None or now - r.down_since < FORGET_LEARNED_S for r in ranks):
                continue
            with self._lock:
                del self._engines[(e.host, e.port)]
                for r in ranks:
                    self._ranks.pop(r.addr, None)
            for r in ranks:
                self._close_rank(r)

    def _shut(self) -> None:
        for r in list(self._ranks.values()):
            self._close_rank(r)
        self._sel.close()
        self._wake_r.close()
        self._wake_w.close()
