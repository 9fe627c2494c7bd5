"""Worker side, decode engine: pulls a remote request's blocks straight into
vLLM's KV cache, reports them finished (or failed: vLLM recomputes), and
sends the producer its done notice."""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from typing import NamedTuple, Optional

import mstar_kv as kv

from . import state_tp
from .groups import MAMBA, pair_pages, segments, state_group
from .layout import to_mstar_tokens
from .metadata import LoadReq
from .params import ConnectorConfig, RemotePrefill
from .peers import PeerKeeper, peer_key
from .ranks import SourceRanks
from .side_channel import SideChannelError, fetch_sequence, send_done

log = logging.getLogger("mstar_kv.vllm")


class _Source(NamedTuple):
    """One source rank's part of a pull (the fields of a SequenceInfo that
    start_async_retrieve and start_async_retrieve_shards read)."""
    page_indices: list
    kv_transfer_info: "kv.KVTransferInfo"


_peer_key = peer_key


LOAD_THREADS = 4


def _start_threads(pool: cf.ThreadPoolExecutor, n: int) -> None:
    """Starts the pool's ``n`` threads now: an executor starts a thread
    inside submit() when none is idle, and Thread.start waits until the new
    thread runs, which on a busy host (vLLM's loop holding the GIL) took
    tens of milliseconds on the engine's thread, inside the first pulls (their
    done notices). Each task waits for the others, so each gets a thread."""
    barrier = threading.Barrier(n)

    def wait() -> None:
        try:
            barrier.wait(10.0)
        except threading.BrokenBarrierError:
            pass

    for _ in range(n):
        pool.submit(wait)


class _Done:
    """The future of a pull with nothing to move."""

    def cancel(self) -> bool:
        return False

    def done(self) -> bool:
        return True


_DONE = _Done()


class _Load:
    __slots__ = ("req", "future", "stream", "cancelled", "error", "ok", "t0", "t1", "lock",
                 "direct", "seqs", "nbytes", "started", "ended", "via", "retried", "pages")

    def __init__(self, req: LoadReq):
        self.req = req
        self.future = None      # set once the pull started (on any thread)
        self.stream = None
        self.cancelled = False
        self.error: Optional[str] = None
        self.ok = False
        self.t0 = time.monotonic()
        self.t1 = 0.0
        self.lock = threading.Lock()
        self.direct = False     # started on the engine's thread from the params
        self.via = ""           # where its sequences came from: "params" or "side_channel"
        self.retried = False    # pulled again after its params' epochs were stale
        self.seqs: list = []    # the SequenceInfos pulled from (the done notice names them)
        self.nbytes = 0
        self.started = False    # its future may be reaped
        self.ended = False
        self.pages = None       # several groups: the local pages it writes


class Consumer:
    """Loads start on the engine's thread when the step's metadata is bound,
    from the descriptors the params carry (no round trip before the pull),
    and are reaped in get_finished by looking at their futures: no thread
    and no wait between a pull's end and vLLM learning of it. The peers are
    connected ahead of the pulls (peers.py: prefill_peers from the start,
    any other prefill engine from its first pull on). A load whose params
    carry no descriptor (or whose peer is not connected: connecting may take
    a round trip) starts on a load thread, which asks the producer's side
    channel for the sequence; so does a direct load that failed as stale (a
    prediction the producer overtook). Done notices go out on a load thread
    after the load is reported."""

    def __init__(self, cfg: ConnectorConfig, manager: "kv.KVTransferManager", tp_rank: int,
                 tp_size: int, reader_name: str, mapped=None, failure_policy: str = "recompute",
                 kv_stats=None, groups=(), state_info=None):
        self.cfg = cfg
        # Several KV cache groups (groups.py): a load pairs each group's
        # published pages with this engine's blocks of the group.
        self.groups = list(groups)
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        # A Mamba state from prefill engines of another TP size moves part
        # by part through a staging cache (state_move.py).
        self._state = None
        sg = state_group(self.groups)
        if sg is not None and isinstance(sg.state, state_tp.StateGeom) and mapped is not None \
                and state_info is not None:
            from .state_move import StateMover
            self._state = StateMover(mapped, sg.state, tp_rank, tp_size, state_info,
                                     cfg.state_staging_pages, cfg.transfer_timeout_s)
        self._kv_stats = kv_stats  # stats.StatsRecorder (vLLM's connector metrics), or None
        self._recomputes = failure_policy == "recompute"
        # What vLLM does with a failed load's request (kv_load_failure_policy).
        self._after_failure = "vLLM recomputes" if failure_policy == "recompute" else \
            f"vLLM fails the request: kv_load_failure_policy={failure_policy!r}"
        self.mgr = manager
        self.layout = manager.kv_cache.layout
        self.cell_layout = mapped.cell_layout if mapped is not None else "kv_cells"
        self.block_size = mapped.block_size if mapped is not None else self.layout.page_size
        self.ranks = SourceRanks(cfg, self.groups, tp_rank, tp_size, self._state is not None,
                                 self.layout.model_kv_heads, self.cell_layout, self.block_size)
        self.ranks.refuse_configured_peers()
        self.reader = f"{reader_name}:{tp_rank}"
        self._pool = cf.ThreadPoolExecutor(max_workers=LOAD_THREADS,
                                           thread_name_prefix="mstar-kv-load")
        _start_threads(self._pool, LOAD_THREADS)
        self._lock = threading.Lock()
        self._loads: dict = {}
        self._done: list = []   # loads that ended before a future existed (errors)
        self._bad_blocks: set = set()
        self._failed_reqs: set = set()
        # Caches connected (by the keeper, or pulled from before): cheap to start.
        self._peers: set = set()
        self.stats = {"loads_ok": 0, "loads_failed": 0, "tokens_loaded": 0, "bytes_loaded": 0,
                      "loads_direct": 0, "loads_side_channel": 0, "loads_retried_stale": 0}
        self._keeper = PeerKeeper(manager.connect, self._peers.add, self._peers.discard,
                                  self.ranks.of_tp, cfg.engine,
                                  cfg.engine_options.get("auth_token", ""),
                                  refusal=self.ranks.refusal)
        for host, port in cfg.prefill_peers:
            self._keeper.add(host, port, configured=True)

    def peers(self) -> dict:
        """The prefill ranks kept connected (PeerKeeper.status)."""
        return self._keeper.status()

    # -- engine steps -------------------------------------------------------
    def start(self, loads, releases, cancels) -> None:
        for r in loads:
            # Kept connected from now on (a lookup unless the engine is new).
            self._keeper.learn(r.remote.host, r.remote.port, r.remote.tp_size)
            ld = _Load(r)
            with self._lock:
                self._loads[r.req_id] = ld
            if not self._start_direct(ld):
                self._pool.submit(self._run, ld, False)
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

    def _paired(self, ld: _Load, seqs: list) -> tuple:
        """Several groups: (rows, local pages, sources over the remote pages
        paired with them); else (None, None, seqs)."""
        if not self.groups:
            return None, None, seqs
        r = ld.req
        # Params a proxy made before the prefill ran name no groups: those
        # the producer publishes for this model (its groups are this
        # engine's) and the prompt's tokens.
        segs = r.remote.groups or segments(self.groups, r.remote.num_tokens)
        remote, local = pair_pages(self.groups, segs, list(seqs[0].page_indices),
                                   r.block_ids, r.start, r.end)
        if any(list(s.page_indices) != list(seqs[0].page_indices) for s in seqs[1:]):
            raise RuntimeError("the producer's ranks published other pages for one request")
        ld.pages = local
        return self.layout.page_size * len(local), local, [_Source(remote, s.kv_transfer_info) for s in seqs]

    def _direct_seqs(self, rp: RemotePrefill) -> list:
        """What to pull from each source rank, from the params alone."""
        out = []
        for p in self.ranks.sources(rp):
            info = kv.KVTransferInfo.from_bytes(rp.descs[p])
            info.epoch = rp.epoch
            if rp.page_epochs:
                info.page_epochs = list(rp.page_epochs)
            out.append(_Source(list(rp.pages), info))
        return out

    def _start_direct(self, ld: _Load) -> bool:
        """Starts the pull on this thread when the params carry the
        descriptors and every source is a peer pulled from before; False
        sends it to a load thread."""
        rp = ld.req.remote
        if not rp.direct or self.cfg.layerwise or self.ranks.splits_state(rp.tp_size):
            # (a state between TP sizes pulls into a staging cache that may
            # still have to connect to the peer: not on the engine's thread)
            return False
        try:
            self.ranks.check(rp)
            seqs = self._direct_seqs(rp)
        except Exception as e:  # untrusted params: fail the load, never the engine's step
            self._fail(ld, e)
            return True
        if not all(_peer_key(s.kv_transfer_info) in self._peers for s in seqs):
            return False  # connecting to a new peer may take a round trip: not here
        try:
            ld.direct = True
            ld.via = "params"
            self._issue(ld, seqs)
            self._on_issued(ld)
            ld.started = True
        except Exception as e:  # as above: the load fails, vLLM goes on
            self._fail(ld, e)
        return True

    def _issue(self, ld: _Load, seqs: list) -> None:
        r = ld.req
        if self.ranks.splits_state(r.remote.tp_size):
            return self._issue_split(ld, seqs)
        start, end = to_mstar_tokens(self.cell_layout, self.block_size, r.start, r.end)
        blocks = r.block_ids
        rows, local, seqs = self._paired(ld, seqs)
        if rows is not None:  # the groups' pages, whole, one after another
            start, end, blocks = 0, rows, local
        with ld.lock:
            if ld.cancelled:
                raise kv.TransferCancelledError("aborted before the pull started")
            ld.seqs = seqs
            if not end:
                ld.future = _DONE
            elif self.cfg.layerwise and len(seqs) == 1:
                ld.stream = self.mgr.start_streaming_retrieve(
                    start, end, blocks, seqs[0].page_indices, seqs[0].kv_transfer_info)
                ld.future = None if ld.stream is None else ld.stream.future
            elif len(seqs) == 1:
                ld.future = self.mgr.start_async_retrieve(
                    start, end, blocks, seqs[0].page_indices, seqs[0].kv_transfer_info)
            else:
                ld.future = self.mgr.start_async_retrieve_shards(start, end, blocks, seqs)
            if ld.future is None:  # nothing to move
                ld.future = _DONE

    def _issue_split(self, ld: _Load, seqs: list) -> None:
        """A load whose state comes from a prefill engine of another TP size
        (state_move.StateMover.start_load): one future for both parts."""
        r, rp = ld.req, ld.req.remote
        segs = rp.groups or segments(self.groups, rp.num_tokens)
        kinds: list = []
        remote, local = pair_pages(self.groups, segs, list(seqs[0].page_indices),
                                   r.block_ids, r.start, r.end, kinds)
        if any(list(s.page_indices) != list(seqs[0].page_indices) for s in seqs[1:]):
            raise RuntimeError("the producer's ranks published other pages for one request")
        ld.pages = local
        info = {p: s.kv_transfer_info for p, s in zip(self.ranks.sources(rp), seqs)}
        with ld.lock:
            if ld.cancelled:
                raise kv.TransferCancelledError("aborted before the pull started")
            ld.seqs = seqs
        # Not under ld.lock: it may wait for staging pages, and the engine's
        # thread takes that lock to cancel.
        f = self._state.start_load(
            self.mgr, rp.tp_size, info, self.ranks.attention(self.tp_rank, rp.tp_size),
            [(x, y, k == MAMBA) for x, y, k in zip(remote, local, kinds)])
        with ld.lock:
            ld.future = f
            if ld.cancelled:
                f.cancel()

    def _run(self, ld: _Load, retry: bool) -> None:
        """A load thread: asks the side channel for the sequences (or uses
        the params' when the peer is new), then starts the pull."""
        r, rp = ld.req, ld.req.remote
        token = self.cfg.engine_options.get("auth_token", "")
        try:
            self.ranks.check(rp)
            if rp.direct and not retry and not self.cfg.layerwise:
                seqs = self._direct_seqs(rp)
                ld.via = "params"
            else:
                stream = self.cfg.layerwise and len(self.ranks.sources(rp)) == 1 and \
                    not self.ranks.splits_state(rp.tp_size)
                seqs = []
                for p in self.ranks.sources(rp):
                    host, port = rp.rank_address(p)
                    data = fetch_sequence(host, port, rp.request_id, self.cfg.fetch_timeout_s,
                                          token, stream=stream)
                    seqs.append(kv.SequenceInfo.from_bytes(data))
                ld.via = "side_channel"
                with self._lock:
                    self.stats["loads_side_channel"] += 1
            self._issue(ld, seqs)
            self._on_issued(ld)
            ld.started = True
        except (kv.KVTransferError, SideChannelError, RuntimeError, ValueError,
                cf.CancelledError) as e:
            self._fail(ld, e)
        except Exception as e:  # never leave a request waiting
            log.exception("request %s: KV load failed", r.req_id)
            self._fail(ld, e)

    def _fail(self, ld: _Load, e: BaseException) -> None:
        r = ld.req
        # The next pull from these peers starts on a load thread again: a
        # reconnect to a peer that went away may wait for its timeout, which
        # the engine's thread must not.
        for src in ld.seqs:
            key = _peer_key(src.kv_transfer_info)
            self._peers.discard(key)
            self._keeper.recheck(key)  # back on the engine's thread once connected
        ld.ended = True
        ld.t1 = time.monotonic()
        ld.error = f"{type(e).__name__}: {e}"
        if self._kv_stats is not None:
            self._kv_stats.record_failure(e)
            if self._recomputes and not ld.cancelled:  # an aborted request is not recomputed
                self._kv_stats.record_recomputed(r.end - r.start)
        log.warning("request %s: KV load of tokens [%d, %d) failed (%s): %s",
                    r.req_id, r.start, r.end, self._after_failure, ld.error)
        with self._lock:
            self.stats["loads_failed"] += 1
            self._done.append(ld)

    def _reap(self, ld: _Load) -> bool:
        """The engine's thread: a load whose future resolved. False when it
        goes on (retried through the side channel)."""
        r = ld.req
        f = ld.future
        err = None if f is _DONE else (f.exception() if not f.cancelled() else
                                        cf.CancelledError())
        if isinstance(err, kv.StaleDescriptorError) and ld.via == "params" and \
                not ld.retried and not ld.cancelled:
            # The producer's pages do not carry the predicted epochs (it freed
            # a shared page a step before the scheduler saw it, or has not
            # published yet): ask it what it published.
            ld.direct = False
            ld.started = False
            ld.retried = True
            ld.future = None
            with self._lock:
                self.stats["loads_retried_stale"] += 1
            self._pool.submit(self._run, ld, True)
            return False
        if err is not None:
            self._fail(ld, err)
            return True
        ld.ended = True
        ld.t1 = time.monotonic()
        ld.nbytes = 0 if f is _DONE else int(f.result() or 0)
        if self._kv_stats is not None and f is not _DONE:
            self._kv_stats.record_pull(ld.nbytes, ld.t1 - ld.t0, self.cfg.engine)
        for s in ld.seqs:
            key = _peer_key(s.kv_transfer_info)
            if not self._keeper.lost(key):  # its producer went away since the pull
                self._peers.add(key)
        ld.ok = True
        with self._lock:
            self.stats["loads_ok"] += 1
            if ld.direct:
                self.stats["loads_direct"] += 1
            self.stats["tokens_loaded"] += r.end - r.start
            self.stats["bytes_loaded"] += ld.nbytes
            self._done.append(ld)
        return True

    def _notify_done(self, req_id: str, rp: RemotePrefill) -> None:
        token = self.cfg.engine_options.get("auth_token", "")
        for p in self.ranks.notified(rp, self.tp_rank):
            host, port = rp.rank_address(p)
            try:
                send_done(host, port, rp.request_id, self.reader, self.ranks.readers_of(rp, p), token)
            except SideChannelError as e:  # the lease frees it then
                log.info("request %s: done notice not delivered: %s", req_id, e)

    # Override points for a subclass that watches the loads (what runs on
    # the engine's thread delays vLLM's step).
    def _on_issued(self, ld: _Load) -> None:
        """``ld``'s pull was just issued (ld.future, or ld.stream of a
        layer-wise pull), on the thread that issued it: the engine's for a
        pull started from the params, a load thread otherwise. It is not
        reaped before this returns."""

    def _on_finished(self, ld: _Load) -> None:
        """The engine's thread: ``ld`` ended (ld.ok, or ld.error) and
        get_finished is about to report it; nothing has touched its blocks
        since the pull."""

    def finished_recving(self, wait_s: float = 0.0) -> set:
        """The engine's thread, every step: reaps the pulls that ended
        (their futures resolved), reports them, then sends their done
        notices from a load thread. With ``wait_s`` (a step that computes
        nothing) and none ended yet, first waits that long at most for the
        first pull in flight to end."""
        if wait_s > 0:
            self._wait_for_an_end(wait_s)
        with self._lock:
            live = [ld for ld in self._loads.values()
                    if ld.started and not ld.ended and ld.future is not None]
        for ld in live:
            if ld.future.done():
                self._reap(ld)
        with self._lock:
            done, self._done = self._done, []
            out = set()
            for ld in done:
                self._loads.pop(ld.req.req_id, None)
                out.add(ld.req.req_id)
                if not ld.ok and self.groups:
                    # vLLM takes no failed blocks of a model with several
                    # groups: the request failed (get_transfer_results).
                    self._failed_reqs.add(ld.req.req_id)
                elif not ld.ok:
                    r = ld.req
                    ps = self.block_size
                    self._bad_blocks.update(r.block_ids[r.start // ps:(r.end + ps - 1) // ps])
        for ld in done:
            self._on_finished(ld)
            self._pool.submit(self._notify_done, ld.req.req_id, ld.req.remote)
        return out

    def _wait_for_an_end(self, wait_s: float) -> None:
        """Until a load ended (its future resolved, or it failed), none is in
        flight, or ``wait_s`` passed. A load still on a load thread (the
        side channel) gets its future meanwhile: looked at every 0.5 ms."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if self._done:
                    return
                loads = [ld for ld in self._loads.values() if not ld.ended]
            if not loads:
                return
            started = [ld.future for ld in loads if ld.started and ld.future is not None]
            if any(f.done() for f in started):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            pending = [f for f in started if isinstance(f, cf.Future)]
            if pending:
                cf.wait(pending, timeout=min(left, 0.0005), return_when=cf.FIRST_COMPLETED)
            else:
                time.sleep(min(left, 0.0005))

    def failed_requests(self) -> set:
        """Several groups: the loads reported finished that failed (vLLM
        recomputes their requests)."""
        with self._lock:
            bad, self._failed_reqs = self._failed_reqs, set()
        return bad

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
        self._keeper.close()
        with self._lock:
            loads = list(self._loads.values())
        for ld in loads:
            with ld.lock:
                ld.cancelled = True
                if ld.future is not None:
                    ld.future.cancel()
        self._pool.shutdown(wait=True, cancel_futures=False)
