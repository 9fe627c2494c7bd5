"""Worker side, decode engine: pulls a remote request's blocks straight into
vLLM's KV cache, reports them finished (or failed: vLLM recomputes), and
sends the producer its done notice."""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
import time
from typing import Optional

import mstar_kv as kv

from .layout import KV_PLANES, to_mstar_tokens
from .metadata import LoadReq
from .params import ConnectorConfig, RemotePrefill
from .side_channel import SideChannelError, fetch_sequence, send_done

log = logging.getLogger("mstar_kv.vllm")


def _heads(total: int, tp: int, rank: int) -> range:
    if total >= tp:
        n = total // tp
        return range(rank * n, (rank + 1) * n)
    h = (rank * total) // tp
    return range(h, h + 1)


def _overlap(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


class _Load:
    __slots__ = ("req", "future", "stream", "cancelled", "error", "ok", "t0", "t1", "lock",
                 "landed", "digest")

    def __init__(self, req: LoadReq):
        self.req = req
        self.future = None
        self.stream = None
        self.cancelled = False
        self.error: Optional[str] = None
        self.ok = False
        self.t0 = time.monotonic()
        self.t1 = 0.0
        self.lock = threading.Lock()
        self.landed: list = []  # tests: (layer, when it was in vLLM's blocks) of a stream
        self.digest = ""        # tests: of the loaded blocks, before anything else writes them


class Consumer:
    def __init__(self, cfg: ConnectorConfig, manager: "kv.KVTransferManager", tp_rank: int,
                 tp_size: int, reader_name: str, stats_path: str = "",
                 corrupt=None, mapped=None, recorder=None):
        self.cfg = cfg
        self._recorder = recorder
        self.mgr = manager
        self.layout = manager.kv_cache.layout
        self.cell_layout = mapped.cell_layout if mapped is not None else "kv_cells"
        self.block_size = mapped.block_size if mapped is not None else self.layout.page_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.reader = f"{reader_name}:{tp_rank}"
        self.stats_path = stats_path
        self._corrupt = corrupt  # test-only negative control: corrupt(block_ids)
        self._pool = cf.ThreadPoolExecutor(max_workers=4, thread_name_prefix="mstar-kv-load")
        self._lock = threading.Lock()
        self._loads: dict = {}
        self._done: list = []
        self._bad_blocks: set = set()
        self.stats = {"loads_ok": 0, "loads_failed": 0, "tokens_loaded": 0, "bytes_loaded": 0}

    # -- which prefill ranks hold this rank's heads ------------------------
    def _sources(self, rp: RemotePrefill) -> list:
        total = self.layout.model_kv_heads
        mine = range(self.layout.first_kv_head, self.layout.first_kv_head + self.layout.num_kv_heads)
        return [p for p in range(rp.tp_size) if _overlap(_heads(total, rp.tp_size, p), mine)]

    def _readers_of(self, rp: RemotePrefill, p: int) -> int:
        """How many of this engine's ranks read from prefill rank p (each sends done)."""
        total = self.layout.model_kv_heads
        theirs = _heads(total, rp.tp_size, p)
        return sum(1 for d in range(self.tp_size) if _overlap(_heads(total, self.tp_size, d), theirs))

    # -- engine steps -------------------------------------------------------
    def start(self, loads, releases, cancels) -> None:
        for r in loads:
            ld = _Load(r)
            with self._lock:
                self._loads[r.req_id] = ld
            self._pool.submit(self._run, ld)
        for r in releases:
            self._pool.submit(self._notify_done, r.req_id, r.remote)
        for req_id in cancels:
            with self._lock:
                ld = self._loads.get(req_id)
            if ld is not None:
                with ld.lock:
                    ld.cancelled = True
                    if ld.future is not None:
                        ld.future.cancel()

    def _run(self, ld: _Load) -> None:
        r, rp = ld.req, ld.req.remote
        token = self.cfg.engine_options.get("auth_token", "")
        try:
            if rp.engine != self.cfg.engine:
                raise RuntimeError(f"the producer moves KV with {rp.engine!r}, this engine with "
                                   f"{self.cfg.engine!r}")
            if rp.cell_layout != self.cell_layout:
                raise RuntimeError(f"the producer stores K and V as {rp.cell_layout}, this "
                                   f"engine as {self.cell_layout}")
            if self.cell_layout == KV_PLANES and rp.block_size != self.block_size:
                raise RuntimeError(f"K and V planes need one block size: the producer's is "
                                   f"{rp.block_size}, this engine's {self.block_size}")
            start, end = to_mstar_tokens(self.cell_layout, self.block_size, r.start, r.end)
            seqs = []
            for p in self._sources(rp):
                host, port = rp.rank_address(p)
                data = fetch_sequence(host, port, rp.request_id, self.cfg.fetch_timeout_s, token)
                seqs.append(kv.SequenceInfo.from_bytes(data))
            with ld.lock:
                if ld.cancelled:
                    raise kv.TransferCancelledError("aborted before the pull started")
                if self.cfg.layerwise and len(seqs) == 1:
                    ld.stream = self.mgr.start_streaming_retrieve(
                        start, end, r.block_ids, seqs[0].page_indices,
                        seqs[0].kv_transfer_info)
                    ld.future = None if ld.stream is None else ld.stream.future
                elif len(seqs) == 1:
                    ld.future = self.mgr.start_async_retrieve(
                        start, end, r.block_ids, seqs[0].page_indices,
                        seqs[0].kv_transfer_info)
                else:
                    ld.future = self.mgr.start_async_retrieve_shards(start, end, r.block_ids,
                                                                     seqs)
            if ld.stream is not None and self._recorder is not None:
                for layer in range(ld.stream.num_layers):
                    if not ld.stream.wait_for_layer(layer, self.cfg.transfer_timeout_s):
                        break
                    ld.landed.append((layer, time.monotonic()))
            nbytes = 0 if ld.future is None else ld.future.result()
            ps = self.block_size
            if self._recorder is not None:
                ld.digest = self._recorder.digest(r.block_ids[r.start // ps:-(-r.end // ps)])
            if self._corrupt is not None:
                self._corrupt(r.block_ids[r.start // self.block_size:])
            ld.ok = True
            with self._lock:
                self.stats["loads_ok"] += 1
                self.stats["tokens_loaded"] += r.end - r.start
                self.stats["bytes_loaded"] += int(nbytes or 0)
        except (kv.KVTransferError, SideChannelError, RuntimeError, cf.CancelledError) as e:
            ld.error = f"{type(e).__name__}: {e}"
            log.warning("request %s: KV load of tokens [%d, %d) failed (vLLM recomputes): %s",
                        r.req_id, r.start, r.end, ld.error)
            with self._lock:
                self.stats["loads_failed"] += 1
        except Exception as e:  # never leave a request waiting
            ld.error = f"{type(e).__name__}: {e}"
            log.exception("request %s: KV load failed", r.req_id)
            with self._lock:
                self.stats["loads_failed"] += 1
        ld.t1 = time.monotonic()
        self._record(ld)
        with self._lock:
            self._done.append(ld)  # vLLM may run the request now
        self._notify_done(r.req_id, rp)

    def _notify_done(self, req_id: str, rp: RemotePrefill) -> None:
        token = self.cfg.engine_options.get("auth_token", "")
        for p in self._sources(rp):
            host, port = rp.rank_address(p)
            try:
                send_done(host, port, rp.request_id, self.reader, self._readers_of(rp, p), token)
            except SideChannelError as e:  # the lease frees it then
                log.info("request %s: done notice not delivered: %s", req_id, e)

    def _record(self, ld: _Load) -> None:
        if not self.stats_path:
            return
        r = ld.req
        line = {"req": r.req_id, "remote_req": r.remote.request_id, "ok": ld.ok,
                "error": ld.error, "start": r.start, "end": r.end,
                "tokens": (r.end - r.start) if ld.ok else 0,
                "seconds": round(ld.t1 - ld.t0, 6), "rank": self.tp_rank}
        if self._recorder is not None:
            line.update(digest=ld.digest, landed=ld.landed, t_end=ld.t1)
        with open(self.stats_path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def finished_recving(self) -> set:
        with self._lock:
            done, self._done = self._done, []
            out = set()
            for ld in done:
                self._loads.pop(ld.req.req_id, None)
                out.add(ld.req.req_id)
                if not ld.ok:
                    r = ld.req
                    ps = self.block_size
                    self._bad_blocks.update(r.block_ids[r.start // ps:(r.end + ps - 1) // ps])
        return out

    def block_ids_with_load_errors(self) -> set:
        with self._lock:
            bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def wait_layer(self, layer: int, timeout: Optional[float] = None) -> None:
        """Waits until ``layer`` of every streamed load in flight has arrived
        (or its stream failed: get_finished reports that)."""
        with self._lock:
            streams = [ld.stream for ld in self._loads.values() if ld.stream is not None]
        for s in streams:
            try:
                s.wait_for_layer(layer, timeout)
            except kv.KVTransferError:
                pass

    def pending(self) -> int:
        with self._lock:
            return len(self._loads)

    def close(self) -> None:
        with self._lock:
            loads = list(self._loads.values())
        for ld in loads:
            with ld.lock:
                ld.cancelled = True
                if ld.future is not None:
                    ld.future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=False)
