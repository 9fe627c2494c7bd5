"""TransferEngineInfo, KVTransferManager and KVCachePool: the spec's API."""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Mapping, Optional, Sequence

from . import _core
from .engines import (KVTransferEngine, LocalOnlyKVTransferEngine, NativeKVTransferEngine,
                      make_native_engine)
from .errors import InvalidArgumentError, ShutdownError, UnavailableError

KVCache = _core.KVCache
SequenceInfo = _core.SequenceInfo
KVTransferInfo = _core.KVTransferInfo


@dataclasses.dataclass
class TransferEngineInfo:
    """Who this process is to its peers and which transfer engine moves its pages.

    ``transfer_engine`` is one of:
      * a built engine's name: 'local', 'shm', 'ucx', 'mooncake' (Mooncake's C
        library, see include/mstar/kv/mooncake.hpp), 'cuda_ipc';
      * a ``mooncake.engine.TransferEngine`` of the PyPI wheel, initialised by
        the application (MooncakeKVTransferEngine reads through it);
      * a KVTransferEngine instance (a Python subclass, or one built already).
    ``options`` holds the engine's settings: ``max_workers`` (int),
    ``timeout`` (seconds) and engine-specific keys (e.g. 'ucx_mode',
    'mooncake_lib'), as documented in each engine's C++ header.
    """

    my_entity_id: str
    my_session_id: str
    transfer_engine: Any
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _is_mooncake_wheel_engine(obj: Any) -> bool:
    t = type(obj)
    return t.__name__ == "TransferEngine" and t.__module__.startswith("mooncake")


class KVTransferManager:
    """Picks the engine, plans each pull and runs it (the spec's manager).

    ``KVTransferManager(transfer_engine_info, kv_cache)``:
    ``transfer_engine_info`` is a TransferEngineInfo, a KVTransferEngine, or
    None (local-only). Every method is safe from any thread; concurrent
    retrieves into disjoint local pages are supported. ``cleanup()`` shuts the
    engine down (reads in flight resolve with ShutdownError), is idempotent,
    and runs when the manager is garbage-collected; a manager used after it
    raises ShutdownError. A future outliving its manager still resolves. A
    manager drops an engine it built when it is garbage-collected; one the
    caller passed in stays the caller's until cleanup().
    """

    def __init__(self, transfer_engine_info: Any, kv_cache: KVCache):
        if not isinstance(kv_cache, KVCache):
            raise InvalidArgumentError(
                f"kv_cache of type {type(kv_cache).__name__} is not an mstar_kv.KVCache "
                "(wrap a tensor with KVCache.from_dlpack(tensor, layout))")
        self.kv_cache = kv_cache
        self._lock = threading.Lock()
        self._closed = False
        self._py_streamer = None  # the stream driver over a Python engine
        self.engine = self._make_engine(transfer_engine_info, kv_cache)
        # An engine the caller built is the caller's: garbage collection of the
        # manager leaves it running (cleanup() still shuts it down).
        self._owns_engine = not (isinstance(transfer_engine_info, KVTransferEngine) or (
            isinstance(transfer_engine_info, TransferEngineInfo)
            and isinstance(transfer_engine_info.transfer_engine, KVTransferEngine)))
        own = getattr(self.engine, "kv_cache", None)
        if own is not None and own.data_ptr != kv_cache.data_ptr:
            raise InvalidArgumentError(
                f"the engine reads into another cache ({own!r}) than this manager's "
                f"({kv_cache!r})")

    @staticmethod
    def _make_engine(info: Any, kv_cache: KVCache) -> KVTransferEngine:
        if info is None:
            return LocalOnlyKVTransferEngine()
        if isinstance(info, KVTransferEngine):
            return info
        if not isinstance(info, TransferEngineInfo):
            raise InvalidArgumentError(
                f"transfer_engine_info of type {type(info).__name__} is not a "
                "TransferEngineInfo, a KVTransferEngine or None")
        te = info.transfer_engine
        if isinstance(te, KVTransferEngine):
            return te
        opts = dict(info.options)
        max_workers = int(opts.pop("max_workers", 3))
        timeout = float(opts.pop("timeout", 30.0))
        if _is_mooncake_wheel_engine(te):
            from .mooncake_wheel import MooncakeKVTransferEngine
            return MooncakeKVTransferEngine(kv_cache, info.my_entity_id, te, timeout=timeout,
                                            session_id=info.my_session_id or None)
        if isinstance(te, str):
            return make_native_engine(te, kv_cache, info.my_entity_id, info.my_session_id,
                                      max_workers=max_workers, timeout=timeout, options=opts)
        raise InvalidArgumentError(
            f"TransferEngineInfo.transfer_engine of type {type(te).__name__} is neither an "
            f"engine name ({', '.join(_core.built_engines())}), a mooncake.engine."
            "TransferEngine nor a KVTransferEngine")

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ShutdownError(f"KVTransferManager.{what}() after cleanup()")

    def get_kv_transfer_info(self):
        """Descriptor another process needs to read this cache remotely;
        KVCachePool.publish stamps it onto every SequenceInfo."""
        self._check_open("get_kv_transfer_info")
        return self.engine.get_kv_transfer_info()

    def start_async_retrieve(self, start_len: int, end_len: int,
                             local_page_indices: Sequence[int],
                             remote_page_indices: Sequence[int], kv_transfer_info: Any):
        """Pulls tokens [start_len, end_len) of a remote sequence (raise
        start_len to skip a cached prefix) into the local pages.

        Validates everything first (page tables, descriptor, layouts) and
        raises a KVTransferError before any byte moves; returns a
        concurrent.futures.Future of the bytes read, or None when start_len ==
        end_len (validated all the same). ``kv_transfer_info`` is the remote's
        descriptor (a KVTransferInfo, an engine's typed info, or its bytes).
        The remote cache may differ in geometry (KVLayout: page size, with
        remote_page_indices in its own page size; head shard, holding every
        local head; in-page and cache order); for heads spread over several
        peers use start_async_retrieve_shards.
        """
        self._check_open("start_async_retrieve")
        if isinstance(self.engine, NativeKVTransferEngine) and self.engine.kv_cache is not None:
            return self.engine._retrieve(start_len, end_len, local_page_indices,
                                         remote_page_indices, kv_transfer_info)
        if isinstance(self.engine, LocalOnlyKVTransferEngine):
            if start_len == end_len:
                # Validated as a non-empty pull is: the page tables, then the
                # descriptor (only the empty one suits a local-only engine).
                _core.plan_reads(self.kv_cache.layout, start_len, end_len,
                                 local_page_indices, remote_page_indices)
                if kv_transfer_info is None:
                    return None
                return self.engine.read_batched_async(kv_transfer_info, [])
            raise InvalidArgumentError(
                "a local-only manager cannot pull from another cache "
                f"(tokens [{start_len}, {end_len}) requested)")
        remote_layout = getattr(self.engine, "remote_layout", None)
        remote_layout = remote_layout(kv_transfer_info) if remote_layout else None
        if remote_layout is not None:
            _core.check_remote_pages(self.kv_cache.layout, remote_layout, start_len, end_len,
                                     remote_page_indices)
        # With the remote layout, caches of different geometry meet (page
        # sizes: each table in its own; head shards; orders).
        reads = _core.plan_reads(self.kv_cache.layout, start_len, end_len,
                                 local_page_indices, remote_page_indices,
                                 remote_layout=remote_layout)
        # No reads still goes to the engine, which validates the descriptor
        # (engines.py); the manager then returns None whatever it returned.
        future = self.engine.read_batched_async(kv_transfer_info, reads)
        return future if reads else None

    def start_streaming_retrieve(self, start_len: int, end_len: int,
                                 local_page_indices: Sequence[int],
                                 remote_page_indices: Sequence[int], kv_transfer_info: Any,
                                 ready_timeout: Optional[float] = None,
                                 poll_interval: float = 20e-6,
                                 max_reads_in_flight: int = 4):
        """Layer-wise streaming form of start_async_retrieve (mstar_kv.streaming):
        issues each layer's reads as soon as the owner marked it ready
        (KVCachePool.mark_layers_ready), in order. Returns a LayerStream, or
        None when start_len == end_len. Validates everything first and raises
        before any byte moves; UnavailableError naming the engine when it has no
        readiness channel (local-only, Python engines without ``watch_layers``;
        shm, ucx, cuda_ipc and mooncake stream).
        ``ready_timeout``: seconds a layer may stay unmarked after the previous
        one before the stream fails with TransferTimeoutError (None: the
        engine's timeout)."""
        self._check_open("start_streaming_retrieve")
        if len(local_page_indices) != len(remote_page_indices):
            raise InvalidArgumentError(
                f"local_page_indices has {len(local_page_indices)} entries, "
                f"remote_page_indices {len(remote_page_indices)}: both page tables must "
                "cover the same tokens")
        from .streaming import LayerStream
        args = dict(ready_timeout=0.0 if ready_timeout is None else float(ready_timeout),
                    poll_interval=float(poll_interval),
                    max_reads_in_flight=int(max_reads_in_flight))
        if isinstance(self.engine, NativeKVTransferEngine) and self.engine.kv_cache is not None:
            native = self.engine._native.stream_retrieve(
                start_len, end_len, local_page_indices, remote_page_indices, kv_transfer_info,
                **args)
            return None if native is None else LayerStream(native)
        if getattr(self.engine, "watch_layers", None) is None:
            if start_len == end_len:
                return None
            raise UnavailableError(
                f"layer-wise streaming over {type(self.engine).__name__}: it has no readiness "
                "channel (watch_layers); shm, ucx, cuda_ipc and the Mooncake wheel engine stream")
        with self._lock:
            self._check_open("start_streaming_retrieve")
            if self._py_streamer is None:
                # The C++ stream driver over this Python engine (the Mooncake
                # wheel engine's bounded polls); stopped by cleanup().
                self._py_streamer = _core._PyEngineStreamer(
                    self.engine, self.kv_cache, float(getattr(self.engine, "timeout", 30.0)))
            streamer = self._py_streamer
        native = streamer.start(start_len, end_len, local_page_indices, remote_page_indices,
                                kv_transfer_info, **args)
        return None if native is None else LayerStream(native)

    def notify_done(self, seq: SequenceInfo) -> None:
        """Tells the owner of ``seq`` that this reader is done with it, over the
        engine's own channel (UCX: an active message), so that the owner frees
        it before its lease expires. Asynchronous, not acknowledged. Engines
        without a channel back to the owner (shm, cuda_ipc, mooncake) raise
        UnavailableError: send "done" over the side channel that carried the
        SequenceInfo (the owner calls KVCachePool.done)."""
        self._check_open("notify_done")
        native = getattr(self.engine, "_native", None)
        if native is None:
            raise UnavailableError(
                f"the {type(self.engine).__name__} engine has no channel back to the owner for "
                f"the done notice of sequence {seq.seq_id}: send it over the side channel "
                "(the owner calls KVCachePool.done)")
        native.notify_done(seq)

    def serve_done_notices(self, pool: "KVCachePool | None") -> None:
        """Owner side: done notices that arrive at this manager's engine free the
        named sequence in ``pool`` if it still holds the notice's epoch. None
        stops. Engines without a channel never deliver any."""
        self._check_open("serve_done_notices")
        native = getattr(self.engine, "_native", None)
        if native is not None:
            native.serve_done_notices(None if pool is None else pool._pool)

    def stats(self) -> dict:
        """Statistics of every read this manager started, per peer and in total:
        ``{"engine", "total": {...}, "peers": {peer: {...}}}``, each with
        ``reads_started``, ``reads_succeeded``, ``reads_failed`` (by status code
        name), ``bytes``, ``copies`` (byte ranges after coalescing) and
        ``latency`` per phase ("plan": validate and plan, "post": until the
        last byte range was handed over, "transfer": until resolution) as
        ``{"count", "sum_seconds", "buckets": [(upper bound s, cumulative)]}``.
        Kept by the C++ library for its engines; a Python engine's manager
        returns ``{"engine": <class name>, "total": None, "peers": {}}``."""
        native = getattr(self.engine, "_native", None)
        if native is not None and hasattr(native, "stats"):
            return native.stats()
        return {"engine": type(self.engine).__name__, "total": None, "peers": {}}

    def prometheus_text(self) -> str:
        """The same statistics in Prometheus text format (mstar_kv_* families)."""
        native = getattr(self.engine, "_native", None)
        return native.prometheus() if native is not None and hasattr(native, "prometheus") else ""

    def start_async_retrieve_shards(self, start_len: int, end_len: int,
                                    local_page_indices: Sequence[int], shards: Sequence[Any]):
        """A tensor-parallel merge: pulls tokens [start_len, end_len) of every
        local head from the peers that hold them, each head from the first
        shard (in the order given) that holds it; ``shards`` are SequenceInfo
        objects or (remote_page_indices, kv_transfer_info) pairs, each page
        table in its peer's page size. One concurrent.futures.Future for the
        whole (the sum of the bytes, or the first error once every part
        resolved); cancel() cancels every part. Raises
        IncompatibleLayoutError naming the heads no shard holds, before any
        byte moves. Native engines only."""
        self._check_open("start_async_retrieve_shards")
        if not (isinstance(self.engine, NativeKVTransferEngine) and
                self.engine.kv_cache is not None):
            raise UnavailableError("start_async_retrieve_shards needs a native engine")
        pairs = []
        for s in shards:
            if hasattr(s, "page_indices") and hasattr(s, "kv_transfer_info"):
                pairs.append((list(s.page_indices), s.kv_transfer_info))
            else:
                pages, info = s
                pairs.append((list(pages), info))
        return self.engine._retrieve_shards(start_len, end_len, local_page_indices, pairs)

    def sync_retrieve(self, *args, **kwargs) -> int:
        """start_async_retrieve, then waits: returns the bytes read (0 when
        there was nothing to read) or raises. A KeyboardInterrupt while waiting
        cancels the read, waits until no byte of it can land, and re-raises."""
        future = self.start_async_retrieve(*args, **kwargs)
        if future is None:
            return 0
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def cleanup(self) -> None:
        """Shuts the engine down; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            streamer, self._py_streamer = self._py_streamer, None
        if streamer is not None:
            streamer.stop()  # unfinished streams resolve with ShutdownError
        self.engine.shutdown()

    def __enter__(self) -> "KVTransferManager":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def __del__(self):
        try:
            if getattr(self, "_owns_engine", False):
                self.cleanup()
        except Exception:
            pass


class KVCachePool:
    """Page allocation per sequence over one KVCache, and publish().

    ``KVCachePool(kv_cache, kv_transfer_info=None, scatter_seed=0, lease=60.0)``:
    ``kv_transfer_info`` (a KVTransferManager, whose descriptor is taken, a
    KVTransferInfo or an engine's typed info) is stamped onto every published
    SequenceInfo. scatter_seed != 0 shuffles the free list deterministically.
    Safe from any thread. Exhaustion raises RetryLaterError; unknown
    sequences, double allocation and double frees raise InvalidArgumentError.

    Epochs and leases: every allocation stamps its pages with a fresh epoch
    that the published SequenceInfo carries, so a reader whose pages were
    freed or reused gets StaleDescriptorError, never another request's KV. A
    published sequence is freed ``lease`` seconds (default 60; 0 = never)
    after its first publish unless ``done()``/``free()`` freed it first;
    expired leases are reaped by ``expire_leases()`` and by allocate/publish.
    """

    def __init__(self, kv_cache: KVCache, kv_transfer_info: Any = None, scatter_seed: int = 0,
                 lease: float = 60.0):
        if isinstance(kv_transfer_info, KVTransferManager):
            kv_transfer_info = kv_transfer_info.get_kv_transfer_info()
        if kv_transfer_info is None:
            descriptor = KVTransferInfo()
        elif isinstance(kv_transfer_info, KVTransferInfo):
            descriptor = kv_transfer_info
        elif isinstance(kv_transfer_info, (bytes, bytearray)):
            descriptor = KVTransferInfo.from_bytes(bytes(kv_transfer_info))
        elif hasattr(kv_transfer_info, "encode"):
            descriptor = kv_transfer_info.encode()
        else:
            raise InvalidArgumentError(
                f"kv_transfer_info of type {type(kv_transfer_info).__name__} is not a "
                "descriptor (a KVTransferManager, a KVTransferInfo or an engine's info)")
        self.kv_cache = kv_cache
        self._pool = _core._Pool(kv_cache, descriptor, scatter_seed, lease)

    def allocate(self, seq_id: int, num_tokens: int) -> list:
        """Pages for a new sequence: ceil(num_tokens / page_size) of them."""
        return self._pool.allocate(seq_id, num_tokens)

    def free(self, seq_id: int) -> None:
        """Frees every page of the sequence."""
        self._pool.free(seq_id)

    def done(self, seq_id: int, epoch: int = 0) -> bool:
        """A reader's done notice: frees the sequence if it is still the one
        published with ``epoch`` (0: whichever holds seq_id). False when it was
        freed already or seq_id names a newer request."""
        return self._pool.done(seq_id, epoch)

    def expire_leases(self) -> int:
        """Frees every published sequence whose lease expired; returns how many."""
        return self._pool.expire_leases()

    @property
    def lease(self) -> float:
        """Seconds a published sequence stays readable without a done notice."""
        return self._pool.lease

    def pages(self, seq_id: int) -> list:
        return self._pool.pages(seq_id)

    def __contains__(self, seq_id: int) -> bool:
        return self._pool.contains(seq_id)

    def free_page_count(self) -> int:
        return self._pool.free_page_count()

    def publish(self, seq_id: int, layers_ready: Optional[int] = None) -> SequenceInfo:
        """The SequenceInfo another process needs to pull this sequence.

        Without ``layers_ready`` the sequence is declared written (every layer
        ready). With it (usually 0) the sequence is published before its layers
        are written, for readers that stream (start_streaming_retrieve); mark
        each layer with mark_layers_ready as the forward pass writes it."""
        return self._pool.publish(seq_id, layers_ready)

    def mark_layers_ready(self, seq_id: int, layers_done: int) -> None:
        """Layers [0, layers_done) of the sequence hold their final bytes
        (vLLM's save_kv_layer). Cheap: a lock and one store per page, no
        syscall. Monotonic: the same value again is a no-op; a smaller one or
        one beyond the layout's layers raises InvalidArgumentError naming both;
        an unknown sequence NotFoundError."""
        self._pool.mark_layers_ready(seq_id, layers_done)

    def mark_layers_ready_after(self, seq_id: int, layers_done: int, stream=None) -> None:
        """mark_layers_ready, enqueued on a CUDA stream (a device cache over
        the cuda_ipc engine): the mark lands once the kernels enqueued on
        ``stream`` before it have completed, so readers never copy a layer
        still being written, and the forward pass never waits. ``stream`` is a
        ``torch.cuda.Stream`` (anything with ``cuda_stream``), a raw
        cudaStream_t as an int, or None for the legacy default stream. Returns
        at once; a mark the pool refuses by then (sequence freed, going
        backwards) is logged and dropped. Keep this pool alive until the
        stream got there. Raises UnavailableError without the cuda_ipc engine."""
        mark = getattr(_core, "_mark_layers_ready_after", None)
        if mark is None:
            raise UnavailableError("mark_layers_ready_after needs the cuda_ipc engine, which "
                                   "is not built into this mstar_kv")
        handle = 0 if stream is None else int(getattr(stream, "cuda_stream", stream))
        mark(self._pool, seq_id, layers_done, handle)

    def layers_ready(self, seq_id: int) -> int:
        """What mark_layers_ready (or publish) last stamped."""
        return self._pool.layers_ready(seq_id)
