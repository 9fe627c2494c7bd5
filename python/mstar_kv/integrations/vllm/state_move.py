"""Decode side of a Mamba state between TP sizes (state_tp.py says which
bytes): each source rank's state pages are pulled whole, by mstar-kv's
planner, into a staging cache of this rank (its own small KVCache and
manager, of the source ranks' page geometry), then each part's slice is
copied into vLLM's state page at its offset there.

The staging cache has the attention layout's page geometry over the heads
the sources hold: sources that hold the same heads (KV heads replicated
over the prefill's ranks) get a staging page each; sources of disjoint
heads are merged into one page by heads, which in an HND page puts source
i's page at byte (its first head - the first) x a head's rows. The pulls
go through the engine as any pull does (bounds, epochs, timeouts)."""
from __future__ import annotations

import threading

import mstar_kv as kv

from . import state_tp
from .layout import LayoutError, heads_of_rank


class _Staging:
    """One staging cache: pages [0, slots) over heads [lo, hi)."""

    def __init__(self, mapped, info_factory, lo: int, hi: int, slots: int):
        import torch
        lay = mapped.layout
        self.layout = kv.KVLayout(num_layers=lay.num_layers, num_pages=slots,
                                  page_size=lay.page_size, num_kv_heads=hi - lo,
                                  head_dim=lay.head_dim, dtype=lay.dtype, has_v=lay.has_v,
                                  cache_order="layer", page_order=lay.page_order,
                                  total_kv_heads=lay.model_kv_heads, first_kv_head=lo)
        self.flat = torch.zeros(self.layout.total_bytes, dtype=torch.uint8,
                                device=mapped.byte_views[0].device)
        self.cache = kv.KVCache.from_dlpack(self.flat, self.layout)
        self.manager = kv.KVTransferManager(info_factory(f"state{lo}-{hi}"), self.cache,
                                            needs_remote_transfer=False)
        self.head_block = self.layout.block_bytes // (hi - lo)  # one head's rows of a page
        self.lo = lo
        self._free = list(range(slots))
        self._cv = threading.Condition()

    def take(self, n: int, timeout: float) -> list:
        """``n`` free pages; waits up to ``timeout`` s for loads in flight to
        give theirs back (a load thread's wait, never the engine's)."""
        if n > self.layout.num_pages:
            raise LayoutError(f"a state load needs {n} staging pages, more than the "
                              f"{self.layout.num_pages} of state_staging_pages")
        with self._cv:
            if not self._cv.wait_for(lambda: len(self._free) >= n, timeout):
                raise LayoutError(f"a state load needs {n} staging pages, {len(self._free)} of "
                                  f"{self.layout.num_pages} were free for {timeout} s (state "
                                  "loads in flight; state_staging_pages)")
            out, self._free = self._free[:n], self._free[n:]
            return out

    def give(self, slots) -> None:
        with self._cv:
            self._free.extend(slots)
            self._cv.notify_all()

    def at(self, layer: int, page: int) -> int:
        return (layer * self.layout.num_pages + page) * self.layout.block_bytes


class StateMover:
    """Builds and finishes the state part of a load between TP sizes."""

    def __init__(self, mapped, geom, tp_rank: int, tp_size: int, info_factory,
                 slots: int = 8, timeout: float = 30.0):
        self.mapped = mapped
        self.slots, self.timeout = slots, timeout
        self.geom = geom
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._info_factory = info_factory
        self._staging: dict = {}
        self._lock = threading.Lock()
        lay = mapped.layout
        need = geom.state_bytes(tp_size)
        if need > lay.block_bytes:
            raise LayoutError(f"this rank's Mamba state ({need} B a layer) exceeds its page of "
                              f"{lay.block_bytes} B")

    def _staging_for(self, lo: int, hi: int) -> _Staging:
        with self._lock:
            st = self._staging.get((lo, hi))
            if st is None:
                st = _Staging(self.mapped, self._info_factory, lo, hi, self.slots)
                self._staging[(lo, hi)] = st
            return st

    def start(self, prefill_tp: int, ranks: list, infos: list, remote: list, local: list):
        """Starts the pulls of the state pages ``remote`` (paired with this
        rank's ``local``) from prefill ranks ``ranks`` (their descriptors
        ``infos``); returns a _StatePull. Raises LayoutError before any
        byte moves when the geometry does not fit."""
        geom, lay = self.geom, self.mapped.layout
        total = lay.model_kv_heads
        heads = [heads_of_rank(total, prefill_tp, p) for p in ranks]
        runs = state_tp.copies(geom, prefill_tp, ranks, self.tp_size, self.tp_rank)
        k = len(remote)
        if all(h == heads[0] for h in heads):
            st = self._staging_for(heads[0].start, heads[0].stop)
            slots = st.take(k * len(ranks), self.timeout)
            where = [(slots[i * k:(i + 1) * k], 0) for i in range(len(ranks))]
            pulls = [(slots[i * k:(i + 1) * k], [(remote, infos[i])]) for i in range(len(ranks))]
        else:
            lo, hi = heads[0].start, heads[-1].stop
            if lay.page_order != "hnd" or any(a.stop != b.start for a, b in zip(heads, heads[1:])):
                raise LayoutError(f"prefill ranks {ranks} hold KV heads "
                                  f"{[(h.start, h.stop) for h in heads]} of a {lay.page_order} "
                                  "page: a state page is not their concatenation")
            st = self._staging_for(lo, hi)
            slots = st.take(k, self.timeout)
            where = [(slots, (h.start - lo) * st.head_block) for h in heads]
            pulls = [(slots, [(remote, info) for info in infos])]
        try:
            for p, h in zip(ranks, heads):  # a source page holds that rank's state
                have, need = len(h) * st.head_block, geom.state_bytes(prefill_tp)
                if need > have:
                    raise LayoutError(f"prefill rank {p}'s Mamba state ({need} B a layer) "
                                      f"exceeds its page of {have} B")
            rows = lay.page_size * k
            futures = []
            for pages, srcs in pulls:
                if len(srcs) == 1:
                    f = st.manager.start_async_retrieve(0, rows, pages, srcs[0][0], srcs[0][1])
                else:
                    f = st.manager.start_async_retrieve_shards(0, rows, pages, srcs)
                futures.append(f)
        except BaseException:
            st.give(slots)
            raise
        return _StatePull(self, st, slots, futures, where, runs, list(local))

    def start_load(self, mgr, prefill_tp: int, info: dict, attn_ranks: list, pairs: list):
        """Starts a load's pulls: the attention pages (``pairs`` of (remote,
        local, is state) without state) from ``attn_ranks`` by ``mgr`` as
        any pull (heads split or merged), the state pages through the
        staging cache; ``info``: each source rank's descriptor. Returns the
        future of both."""
        srcs = state_tp.sources(prefill_tp, self.tp_size, self.tp_rank)
        st = [(x, y) for x, y, s in pairs if s]
        a = [(x, y) for x, y, s in pairs if not s]
        pull = self.start(prefill_tp, srcs, [info[p] for p in srcs], [x for x, _ in st],
                          [y for _, y in st])
        if a:
            rows, pages = self.mapped.layout.page_size * len(a), [y for _, y in a]
            shards = [([x for x, _ in a], info[p]) for p in attn_ranks]
            try:
                if len(shards) == 1:
                    f = mgr.start_async_retrieve(0, rows, pages, *shards[0])
                else:
                    f = mgr.start_async_retrieve_shards(0, rows, pages, shards)
            except BaseException:
                pull.cancel()
                raise
            pull.join(f)
        return pull

    def place(self, st: _Staging, where: list, runs: list, local: list) -> None:
        """Copies each run from the staging pages into vLLM's state pages."""
        lay = self.mapped.layout
        views = self.mapped.byte_views
        for layer in range(lay.num_layers):
            for j, page in enumerate(local):
                if len(views) == 1:
                    dst, base = views[0], _block_offset(lay, layer, page)
                else:
                    dst, base = views[layer], page * lay.block_bytes
                for i, so, do, n in runs:
                    s = st.at(layer, where[i][0][j]) + where[i][1] + so
                    dst[base + do:base + do + n].copy_(st.flat[s:s + n])
        if views and views[0].is_cuda:
            import torch
            torch.cuda.current_stream(views[0].device).synchronize()


def _block_offset(lay, layer: int, page: int) -> int:
    if lay.cache_order == "page":
        return (page * lay.num_layers + layer) * lay.block_bytes
    return (layer * lay.num_pages + page) * lay.block_bytes  # layer, layer_page (no V)


class _StatePull:
    """The future of a load's state part (and of its attention part, when
    joined): done once every pull ended; the slices are placed then, once."""

    def __init__(self, mover: StateMover, st: _Staging, slots, futures, where, runs, local):
        self._mover, self._st, self._slots = mover, st, slots
        self._futures = [f for f in futures if f is not None]
        self._where, self._runs, self._local = where, runs, local
        self._placed = False
        self._error = None
        self._lock = threading.Lock()

    def join(self, future) -> None:
        if future is not None:
            self._futures.append(future)

    def done(self) -> bool:
        if not all(f.done() for f in self._futures):
            return False
        with self._lock:
            if not self._placed:
                self._placed = True
                try:
                    if not self.cancelled() and all(f.exception() is None
                                                    for f in self._futures):
                        self._mover.place(self._st, self._where, self._runs, self._local)
                except Exception as e:  # a copy that failed: the load failed
                    self._error = e
                finally:
                    self._st.give(self._slots)
        return True

    def cancelled(self) -> bool:
        return any(f.cancelled() for f in self._futures)

    def exception(self):
        for f in self._futures:
            if not f.cancelled() and f.exception() is not None:
                return f.exception()
        return self._error

    def result(self):
        e = self.exception()
        if e is not None:
            raise e
        return sum(int(f.result() or 0) for f in self._futures)

    def cancel(self) -> bool:
        return any([f.cancel() for f in self._futures])
