"""Worker side, prefill engine: publishes finished requests' blocks and frees
them on the readers' done notices or when their lease expires."""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Optional

import mstar_kv as kv

from .layout import to_mstar_tokens
from .metadata import PublishReq
from .params import ConnectorConfig
from .side_channel import SideChannelServer

log = logging.getLogger("mstar_kv.vllm")


def seq_id_of(req_id: str) -> int:
    """A stable 63-bit sequence id for a vLLM request id."""
    return int.from_bytes(hashlib.blake2b(req_id.encode(), digest_size=8).digest(), "little") >> 1


class _Published:
    __slots__ = ("req_id", "seq_id", "data", "deadline", "readers_done", "error", "req",
                 "complete")

    def __init__(self, req_id: str, seq_id: int, data: Optional[bytes], deadline: float,
                 error: str = "", req: Optional[PublishReq] = None):
        self.req_id = req_id
        self.req = req
        self.seq_id = seq_id
        self.data = data
        self.deadline = deadline
        self.readers_done: set = set()
        self.error = error
        # Every layer written: a reader that does not stream may have it.
        self.complete = req is None or req.layers_ready is None


class Producer:
    def __init__(self, cfg: ConnectorConfig, manager: "kv.KVTransferManager", tp_rank: int,
                 mapped=None, tp_size: int = 1):
        self.cfg = cfg
        self.tp_size = tp_size
        self._streaming: dict = {}  # name -> layers marked, of requests published early
        self.mapped = mapped
        self.cache = manager.kv_cache
        # Leases are the connector's (a vLLM request's blocks are freed by
        # vLLM once get_finished reports it): the pool's never expire.
        self.pool = kv.KVCachePool(self.cache, manager, lease=0)
        info = manager.get_kv_transfer_info()
        self.descriptor = b"" if info is None else bytes(info.to_bytes())
        if info is None or (hasattr(info, "empty") and info.empty()):
            raise RuntimeError(
                f"the {cfg.engine} engine cannot serve vLLM's KV cache ({self.cache.memory} "
                "memory): it publishes no descriptor. shm serves private (torch-allocated) "
                "caches only with cross-memory attach; use engine 'ucx' meanwhile")
        self._lock = threading.Lock()
        self._pub: dict = {}          # published name -> _Published
        self._forgotten: dict = {}    # name -> why (freed), bounded
        self._to_report: set = set()  # freed, not yet reported finished_sending
        self._seen_finished: set = set()
        self.stats = {"published": 0, "freed_done": 0, "freed_lease": 0, "publish_failed": 0}
        self.server = SideChannelServer(cfg.host, cfg.side_channel_port + tp_rank, self._lookup,
                                        self._on_done, cfg.engine_options.get("auth_token", ""),
                                        describe=self._describe)

    def _describe(self) -> dict:
        """A watch's answer: what a decode worker connects to ahead of its
        first pull (the cache descriptor the params carry too)."""
        return {"desc": self.descriptor, "tp_size": self.tp_size, "engine": self.cfg.engine}

    # -- side channel (its threads) ----------------------------------------
    def _lookup(self, name: str, stream: bool = False) -> Optional[bytes]:
        with self._lock:
            p = self._pub.get(name)
            if p is None:
                why = self._forgotten.get(name)
                if why is not None:
                    raise KeyError(why)
                return None  # not published yet: the lookup waits
            if p.data is None:
                raise KeyError(p.error)
            # Published before its forward pass: a reader that does not
            # stream waits until every layer is written.
            return p.data if stream or p.complete else None

    def _on_done(self, name: str, reader: str, readers: int) -> None:
        with self._lock:
            p = self._pub.get(name)
            if p is None:
                return
            p.readers_done.add(reader)
            if len(p.readers_done) >= readers:
                self._free_locked(name, "done")

    # -- engine steps (the worker's thread) --------------------------------
    def publish(self, reqs) -> None:
        for r in reqs:
            self._publish_one(r)
        if reqs:
            self.server.published()

    def _publish_one(self, r: PublishReq) -> None:
        sid = seq_id_of(r.name)
        deadline = time.monotonic() + self.cfg.lease_s
        n = r.num_tokens
        if self.mapped is not None:  # K and V planes: whole blocks of 2N rows
            _, n = to_mstar_tokens(self.mapped.cell_layout, self.mapped.block_size, 0, n)
        try:
            # A page another published request holds (a prefix-cache hit of
            # this engine) is shared and keeps its epoch; the others get the
            # epoch the scheduler chose, which the params name.
            self.pool.adopt(sid, n, r.block_ids, allow_shared=True, epoch=r.epoch)
            data = self.pool.publish(sid, r.layers_ready).to_bytes()
            p = _Published(r.req_id, sid, bytes(data), deadline, req=r)
            self.stats["published"] += 1
        except kv.KVTransferError as e:
            # E.g. a name published twice: the reader fails and recomputes.
            log.warning("request %s: not published as %r: %s", r.req_id, r.name, e)
            p = _Published(r.req_id, sid, None, deadline, f"not published: {e}")
            self.stats["publish_failed"] += 1
        with self._lock:
            if r.name in self._pub:  # a second request under one name: refuse it alone
                log.warning("request %s: %r is published already", r.req_id, r.name)
                self._to_report.add(r.req_id)
                return
            self._forgotten.pop(r.name, None)
            self._pub[r.name] = p
            if p.data is None:
                self._free_locked(r.name, "failed")
            elif r.layers_ready == 0:
                self._streaming[r.name] = 0
            else:
                self._on_complete(p)

    def mark_layers_ready(self, name: str, layers_done: int) -> None:
        """Layers [0, layers_done) of a request published with layers_ready=0
        hold their final KV (save_kv_layer): readers streaming it
        (layerwise) pull them now."""
        with self._lock:
            p = self._pub.get(name)
            if p is None or p.data is None:
                return
            self.pool.mark_layers_ready(p.seq_id, layers_done)

    def layer_saved(self, layer: int) -> None:
        """save_kv_layer: layer ``layer`` of this step's forward pass is in
        vLLM's cache, so is every earlier one: each request published early
        gets layers [0, layer + 1) marked ready."""
        if not self._streaming:
            return
        now = time.monotonic()
        completed = False
        with self._lock:
            for name, done in list(self._streaming.items()):
                if layer + 1 <= done:
                    continue
                p = self._pub.get(name)
                if p is None or p.data is None:
                    del self._streaming[name]
                    continue
                try:
                    self.pool.mark_layers_ready(p.seq_id, layer + 1)
                except kv.KVTransferError as e:
                    log.warning("request %s: layer %d not marked ready: %s", p.req_id, layer, e)
                    continue
                self._streaming[name] = layer + 1
                self._on_marked(p, range(done, layer + 1), now)
                if layer + 1 >= self.cache.layout.num_layers:
                    # Every layer is ready: a reader may be done (and free it)
                    # before wait_for_save.
                    del self._streaming[name]
                    p.complete = True
                    completed = True
                    self._on_complete(p)
        if completed:
            self.server.published()

    def step_saved(self, num_layers: int) -> None:
        """wait_for_save: the forward pass is over, every layer is written:
        what save_kv_layer did not mark (a layer it was not called for) is
        marked now, and the requests published early stop streaming."""
        if not self._streaming:
            return
        now = time.monotonic()
        with self._lock:
            streaming, self._streaming = self._streaming, {}
            for name, done in streaming.items():
                p = self._pub.get(name)
                if p is None or p.data is None:
                    continue
                if done < num_layers:
                    try:
                        self.pool.mark_layers_ready(p.seq_id, num_layers)
                    except kv.KVTransferError as e:
                        log.warning("request %s: layers not marked ready: %s", p.req_id, e)
                    else:
                        self._on_marked(p, range(done, num_layers), now)
                p.complete = True
                self._on_complete(p)
        self.server.published()

    def unpublish(self, reqs) -> None:
        with self._lock:
            for r in reqs:
                p = self._pub.get(r.name)
                self._streaming.pop(r.name, None)
                if p is None or p.req_id != r.req_id:
                    if r.report:
                        self._to_report.add(r.req_id)
                    continue
                self._free_locked(r.name, "unpublished", report=r.report)

    # Override points, called with the lock held, on the engine's thread:
    # a subclass may watch a publication's layers become readable.
    def _on_marked(self, p: _Published, layers: range, when: float) -> None:
        """``layers`` of ``p`` (published early) were marked ready at
        ``when`` (time.monotonic())."""

    def _on_complete(self, p: _Published) -> None:
        """Every layer of ``p`` is in vLLM's blocks and readable: published
        whole, or the last of its layers was marked."""

    def _free_locked(self, name: str, why: str, report: bool = True) -> None:
        p = self._pub.pop(name, None)
        if p is None:
            return
        if p.data is not None:
            self.pool.done(p.seq_id)  # epochs go to 0 before vLLM may reuse the blocks
            self.stats["freed_done" if why == "done" else "freed_lease"] += 1
        if len(self._forgotten) > 65536:
            self._forgotten.clear()
        if report:
            self._forgotten[name] = f"request {name} was freed ({why})" if p.data is not None \
                else p.error
            self._to_report.add(p.req_id)

    def finished_sending(self, finished_req_ids) -> set:
        now = time.monotonic()
        with self._lock:
            self._seen_finished.update(finished_req_ids or ())
            for name in [n for n, p in self._pub.items() if p.deadline <= now]:
                log.warning("request %s: lease of %.1f s expired before its reader was done",
                            name, self.cfg.lease_s)
                self._free_locked(name, "lease expired")
            out = self._to_report & self._seen_finished
            self._to_report -= out
            self._seen_finished -= out
        return out

    def pending(self) -> int:
        with self._lock:
            return len(self._pub)

    def close(self) -> None:
        self.server.close()
