"""KVTransferManager over the one C++ manager (_core._Manager; TransferEngineInfo
is in engine_info.py):
only the Pythonic surface (engine from the spec's arguments, futures, streams)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from . import _core
from .engine_info import TransferEngineInfo
from .engines import (
    KVTransferEngine,
    LocalOnlyKVTransferEngine,
    NativeKVTransferEngine,
    make_native_engine,
)
from .errors import InvalidArgumentError
from .futures import wrap_native
from .requests import RequestScopedMethods, native_descriptor
from .streaming import LayerStream

KVCache = _core.KVCache
SequenceInfo = _core.SequenceInfo


def _is_mooncake_wheel_engine(obj: Any) -> bool:
    t = type(obj)
    return t.__name__ == "TransferEngine" and t.__module__.startswith("mooncake")


def _make_engine(info: Any, kv_cache: KVCache) -> "tuple[KVTransferEngine, bool]":
    """The engine for the spec's transfer_engine_info, and whether the
    manager made it (then it is the manager's to drop)."""
    if info is None:
        return LocalOnlyKVTransferEngine(), True
    if isinstance(info, KVTransferEngine):
        return info, False
    if not isinstance(info, TransferEngineInfo):
        raise InvalidArgumentError(
            f"transfer_engine_info of type {type(info).__name__} is not a "
            "TransferEngineInfo, a KVTransferEngine or None")
    te = info.transfer_engine
    if isinstance(te, KVTransferEngine):
        return te, False
    opts = dict(info.options)
    max_workers = int(opts.pop("max_workers", 3))
    timeout = float(opts.pop("timeout", 30.0))
    if _is_mooncake_wheel_engine(te):
        from .mooncake_wheel import MooncakeWheelKVTransferEngine
        return MooncakeWheelKVTransferEngine(kv_cache, info.my_entity_id, te, timeout=timeout,
                                             session_id=info.my_session_id or None), True
    if isinstance(te, str):
        return make_native_engine(te, kv_cache, info.my_entity_id, info.my_session_id,
                                  max_workers=max_workers, timeout=timeout, options=opts), True
    raise InvalidArgumentError(
        f"TransferEngineInfo.transfer_engine of type {type(te).__name__} is neither an "
        f"engine name ({', '.join(_core.built_engines())}), a mooncake.engine."
        "TransferEngine nor a KVTransferEngine")


class KVTransferManager(RequestScopedMethods):
    """Plans each pull and runs it on its engine (the spec's manager).

    ``KVTransferManager(transfer_engine_info, kv_cache, resource_key="kv",
    needs_remote_transfer=True)``: a TransferEngineInfo, a KVTransferEngine,
    or None (local-only); the resource key names this cache among a worker's
    (request-scoped descriptors of another key are refused), and without
    remote transfer nothing is published (mstar_kv.requests). Native engines and Python ones
    (subclasses of KVTransferEngine, the Mooncake wheel engine) go through the
    same C++ manager: planning between geometries, statistics, layer-wise
    streams, shards and done notices. Every method is safe from any thread;
    concurrent retrieves into disjoint local pages are supported. Calls after
    ``cleanup()`` raise ShutdownError. Futures and streams outlive the manager
    (they resolve, with ShutdownError at the latest after cleanup()). A
    manager's own engine is shut down when it is garbage-collected; one the
    caller passed in stays the caller's until cleanup().
    """

    def __init__(self, transfer_engine_info: Any, kv_cache: KVCache, resource_key: str = "kv",
                 needs_remote_transfer: bool = True):
        if not isinstance(kv_cache, KVCache):
            raise InvalidArgumentError(
                f"kv_cache of type {type(kv_cache).__name__} is not an mstar_kv.KVCache "
                "(wrap a tensor with KVCache.from_dlpack(tensor, layout))")
        self.kv_cache = kv_cache
        self.engine, owns = _make_engine(transfer_engine_info, kv_cache)
        own = getattr(self.engine, "kv_cache", None)
        if own is not None and own.regions != kv_cache.regions:
            raise InvalidArgumentError(
                f"the engine reads into another cache ({own!r}) than this manager's "
                f"({kv_cache!r})")
        native = self.engine._native if isinstance(self.engine, NativeKVTransferEngine) \
            else self.engine
        self._m = _core._Manager(native, kv_cache, float(getattr(self.engine, "timeout", 30.0)),
                                 owns, str(resource_key), bool(needs_remote_transfer))

    def start_async_retrieve(self, start_len: int, end_len: int,
                             local_page_indices: Sequence[int],
                             remote_page_indices: Sequence[int], kv_transfer_info: Any):
        """Pulls tokens [start_len, end_len) of a remote sequence (raise
        start_len to skip a cached prefix) into the local pages.

        Validates everything first (page tables, descriptor, layouts), raising
        a KVTransferError before any byte moves; returns a Future of the bytes
        read, or None when start_len == end_len (validated all the same).
        ``kv_transfer_info``: a KVTransferInfo, an engine's typed info, its
        bytes, a Python engine's own descriptor, or a RequestKVTransferInfo
        (checked against its resource key, tokens and pages); decoded once. The
        remote cache may differ in geometry (docs/geometry.md)."""
        return wrap_native(self._m.start_async_retrieve(
            start_len, end_len, local_page_indices, remote_page_indices,
            native_descriptor(kv_transfer_info)))

    def start_async_retrieve_shards(self, start_len: int, end_len: int,
                                    local_page_indices: Sequence[int], shards: Sequence[Any]):
        """A tensor-parallel merge: every local head from the first shard that
        holds it; ``shards`` are SequenceInfo objects or (remote_page_indices,
        kv_transfer_info) pairs. One Future for the whole; cancel() cancels
        every part. IncompatibleLayoutError names the heads no shard holds."""
        return wrap_native(self._m.start_async_retrieve_shards(
            start_len, end_len, local_page_indices, list(shards)))

    def start_streaming_retrieve(self, start_len: int, end_len: int,
                                 local_page_indices: Sequence[int],
                                 remote_page_indices: Sequence[int], kv_transfer_info: Any,
                                 ready_timeout: Optional[float] = None,
                                 poll_interval: float = 20e-6,
                                 max_reads_in_flight: int = 4) -> Optional[LayerStream]:
        """Layer-wise form of start_async_retrieve (mstar_kv.streaming): issues
        each layer's reads as soon as the owner marked it ready
        (KVCachePool.mark_layers_ready), in order. Returns a LayerStream, or
        None when start_len == end_len. Raises before any byte moves;
        NotSupportedError naming the engine when it has no readiness channel
        (local-only, a Python engine without ``watch_layers``).
        ``ready_timeout``: seconds a layer may stay unmarked after the previous
        one before the stream fails with TransferTimeoutError (None: the
        engine's timeout)."""
        native = self._m.start_streaming_retrieve(
            start_len, end_len, local_page_indices, remote_page_indices, kv_transfer_info,
            0.0 if ready_timeout is None else float(ready_timeout), float(poll_interval),
            int(max_reads_in_flight))
        return None if native is None else LayerStream(native)

    def sync_retrieve(self, *args, **kwargs) -> int:
        """start_async_retrieve, then waits: the bytes read (0 when there was
        nothing to read), or raises. A KeyboardInterrupt while waiting cancels
        the read, waits until no byte of it can land, and re-raises."""
        future = self.start_async_retrieve(*args, **kwargs)
        if future is None:
            return 0
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            raise

    def connect(self, kv_transfer_info: Any) -> None:
        """Opens what pulls from the owner of ``kv_transfer_info`` (any
        descriptor of its cache) need before the first one: the ucx or
        mooncake connection and its handshake, the shm mapping or
        cross-memory attach; kept as a pull keeps it. So the first pull from
        a new peer costs what a later one does. Blocks for at most the
        engine's timeout and raises what that first pull would have raised
        there (PeerFailureError, TransferTimeoutError, StaleDescriptorError
        for an owner that no longer serves it). Moves no byte; a no-op for
        engines with nothing to open (cuda_ipc, Python engines)."""
        self._m.connect(kv_transfer_info)

    def notify_done(self, seq: SequenceInfo) -> None:
        """Tells the owner of ``seq`` this reader is done with it, over the
        engine's channel (UCX), not acknowledged. Engines without one (shm,
        cuda_ipc, mooncake) raise NotSupportedError: use the side channel that
        carried the SequenceInfo (the owner calls KVCachePool.done)."""
        self._m.notify_done(seq)

    def serve_done_notices(self, pool: "_core.KVCachePool | None") -> None:
        """Owner side: done notices arriving at this manager's engine free the
        named sequence in ``pool`` if it still holds the notice's epoch. None
        stops. Engines without a channel never deliver any."""
        self._m.serve_done_notices(pool)

    def stats(self) -> dict:
        """Statistics (docs/observability.md): ``{"engine", "total", "peers", "served"}``:
        reads started, succeeded, failed by code, bytes, copies, phase latencies;
        "served" is the owner side (what the engine and serve_done_notices served)."""
        return self._m.stats()

    def prometheus_text(self) -> str:
        """The same statistics in Prometheus text format (mstar_kv_* families)."""
        return self._m.prometheus()

    def cleanup(self) -> None:
        """Stops the streams and shuts the engine down; idempotent."""
        self._m.cleanup()

    def __enter__(self) -> "KVTransferManager":
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
