"""The spec's KVTransferEngine interface and the native engines behind it.

Every engine is safe to call from any thread. ``read_batched_async``
validates the descriptor and every read before any byte moves (raising a
KVTransferError), never waits for the transfer, and returns a
``concurrent.futures.Future`` of the bytes read, or None when there is
nothing to read. ``shutdown()`` resolves every read in flight (ShutdownError
unless it already finished) and releases every mapping, handle and
registration; later reads raise ShutdownError. Idempotent.
"""
from __future__ import annotations

import abc
import atexit
import weakref
from typing import Any, Mapping, Optional, Sequence

from . import _core
from .errors import UnavailableError
from .futures import TransferFuture, wrap_native

KVCache = _core.KVCache
KVReadInfo = _core.KVReadInfo

_live_engines: "weakref.WeakSet[NativeKVTransferEngine]" = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    # Nothing may call into Python once the interpreter exits: shut the
    # engines down (their futures resolve), then stop the callback thread.
    for engine in list(_live_engines):
        try:
            engine.shutdown()
        except Exception:  # pragma: no cover - best effort at exit
            pass
    _core._stop_callbacks()


class KVTransferEngine(abc.ABC):
    """Moves pages of a remote cache into this engine's local cache.

    Subclass it to plug a transfer of your own into KVTransferManager: the
    manager wraps it into its C++ engine interface once, plans the reads
    (KVReadInfo per layer and page, token-clipped) and calls
    ``read_batched_async(remote_kv_info, read_info)`` with the descriptor the
    caller passed, unchanged. Return a concurrent.futures.Future (or None when
    there is nothing to read) and keep the contract above. Optional methods
    the manager uses when present: ``remote_layout`` (below; needed for caches
    of different geometry and shards), ``watch_layers(remote_kv_info,
    read_info)`` (an object whose ``poll()`` returns the layers ready, for
    layer-wise streaming), ``notify_done(remote_kv_info, seq_id)`` (done
    notices), ``timeout`` (seconds; a stream's default ready timeout).
    """

    @abc.abstractmethod
    def get_kv_transfer_info(self) -> Any:
        """Descriptor another process needs to read this engine's cache."""

    @abc.abstractmethod
    def read_batched_async(self, remote_kv_info: Any,
                           read_info: Sequence[KVReadInfo]):
        """Starts the reads; returns a Future of the bytes read, or None.

        Validates the descriptor and every read first, raising before any
        byte moves. KVTransferManager also calls it with no reads for an
        empty range (start_len == end_len), so that the descriptor is
        validated; it should then return None."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Resolves reads in flight, releases everything; idempotent."""

    def remote_layout(self, remote_kv_info: Any):
        """The KVLayout of the cache ``remote_kv_info`` describes (raising as
        read_batched_async would for a bad descriptor), or None when this
        engine cannot tell. KVTransferManager checks the remote page table
        against it first, so that errors name the caller's table entries."""
        return None


def _extra(options: Optional[Mapping[str, Any]]) -> dict:
    return {str(k): str(v) for k, v in (options or {}).items()}


class NativeKVTransferEngine(KVTransferEngine):
    """An engine of the C++ library (planning, copies and futures in C++)."""

    _native: "_core._Engine"
    kv_cache: Optional[KVCache]

    def _adopt(self, native: "_core._Engine", kv_cache: Optional[KVCache],
               timeout: float = 30.0) -> None:
        self._native = native
        self.kv_cache = kv_cache
        self._timeout = float(timeout)
        self._info = None
        _live_engines.add(self)

    def get_kv_transfer_info(self):
        """This cache's descriptor as a KVTransferInfo (empty for local-only)."""
        if self._info is None:
            self._info = self._native.get_kv_transfer_info()
        return self._info

    def read_batched_async(self, remote_kv_info, read_info) -> Optional[TransferFuture]:
        return wrap_native(self._native.read_batched_async(remote_kv_info, list(read_info)))

    def remote_layout(self, remote_kv_info):
        return self._native.remote_layout(remote_kv_info)

    def watch_layers(self, remote_kv_info, read_info):
        """The owner's layer readiness for the remote pages of the reads: an
        object whose ``poll()`` returns the layers ready on every page."""
        return self._native.watch_layers(remote_kv_info, list(read_info))

    def notify_done(self, remote_kv_info, seq_id: int) -> None:
        """Tells the owner of the descriptor this reader is done with seq_id
        (UCX's channel; NotSupportedError for engines without one)."""
        self._native.notify_done(remote_kv_info, seq_id)

    @property
    def timeout(self) -> float:
        """Seconds a read may take (a stream's default ready timeout)."""
        return self._timeout

    def shutdown(self) -> None:
        self._native.shutdown()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kv_cache!r})"


class LocalOnlyKVTransferEngine(NativeKVTransferEngine):
    """KV cache that remains local to its worker: nothing leaves the process.
    Its descriptor is empty (the spec's None); reading from it fails."""

    def __init__(self):
        self._adopt(_core._Engine.local_only(), None)

    def get_kv_transfer_info(self):
        return None


class ShmKVTransferEngine(NativeKVTransferEngine):
    """Same host, CPU memory: maps another process's shared cache read-only
    and copies with a pool of ``max_workers`` threads. A ``memory='shared'``
    cache is readable by others (get_kv_transfer_info() describes it); a
    private one can still read others. Reads of at most 1 MiB are copied on
    the calling thread (GIL released) and return an already resolved future.
    """

    def __init__(self, kv_cache: KVCache, max_workers: int = 3, timeout: float = 30.0):
        self._adopt(_core._Engine.make("shm", kv_cache, max_workers=max_workers,
                                       timeout=timeout), kv_cache, timeout)


class UcxKVTransferEngine(NativeKVTransferEngine):
    """Cross-host over UCX (RDMA where present, TCP otherwise). The cache is
    registered once; a listener opens on ``session_id`` ("HOST:PORT"; empty:
    127.0.0.1 and a free port). One progress thread per engine. ``options``
    are the engine's extra settings (ucx_mode, ucx_am_proto, ucx_chunk_bytes, ucx_progress,
    ucx_staging, ucx_emulated_gets, ucx_peer_timeout_ms, auth_token; see
    include/mstar/kv/engines/ucx.hpp); UCX itself reads UCX_TLS, UCX_NET_DEVICES.
    With ``auth_token`` (a shared secret of >= 16 bytes) owner and reader
    prove it to each other when connecting (HMAC-SHA-256 challenge-response;
    the secret never crosses the wire); a peer without
    it, or with another, gets PermissionDeniedError before any byte moves.
    """

    def __init__(self, kv_cache: KVCache, entity_id: str = "", session_id: str = "",
                 timeout: float = 30.0, options: Optional[Mapping[str, Any]] = None):
        self._adopt(_core._Engine.make("ucx", kv_cache, entity_id=entity_id,
                                       session_id=session_id, timeout=timeout,
                                       extra=_extra(options)), kv_cache, timeout)

    @property
    def session_id(self) -> str:
        """The listener's "HOST:PORT" (what peers connect to)."""
        return _core.UcxKVTransferInfo.decode(self.get_kv_transfer_info()).session_id


class CudaIpcKVTransferEngine(NativeKVTransferEngine):
    """The spec's CudaIpcKVTransferEngine(kv_cache, max_workers=3): same host,
    GPU memory, through a legacy CUDA IPC handle; device-to-device copies on
    ``max_workers`` streams, futures completed from one completion thread.
    The cache must be device memory (KVCache(layout, 'device') or
    KVCache.from_dlpack of a CUDA tensor from torch's default allocator)."""

    def __init__(self, kv_cache: KVCache, max_workers: int = 3, timeout: float = 30.0,
                 options: Optional[Mapping[str, Any]] = None):
        if "cuda_ipc" not in _core.built_engines():
            raise UnavailableError("transfer engine 'cuda_ipc' is not built into this "
                                   f"mstar_kv (built: {', '.join(_core.built_engines())})")
        self._adopt(_core._Engine.make("cuda_ipc", kv_cache, max_workers=max_workers,
                                       timeout=timeout, extra=_extra(options)), kv_cache, timeout)


class FaultInjectingKVTransferEngine(NativeKVTransferEngine):
    """The library's fault injector (a real engine wrapper) around a native
    engine, which it shuts down with itself: every batch is delayed by
    ``delay`` seconds, or dropped (resolving with TransferTimeoutError after
    ``drop_timeout``). For tests of timeouts, cancellation and interrupts."""

    def __init__(self, inner: NativeKVTransferEngine, delay: float = 0.0, drop: bool = False,
                 drop_timeout: float = 1.0):
        native = _core._Engine.fault_injecting(inner._native, delay=delay, drop=drop,
                                               drop_timeout=drop_timeout)
        self._adopt(native, inner.kv_cache, inner.timeout)


def make_native_engine(name: str, kv_cache: KVCache, entity_id: str = "", session_id: str = "",
                       max_workers: int = 3, timeout: float = 30.0,
                       options: Optional[Mapping[str, Any]] = None) -> NativeKVTransferEngine:
    """The engine the C++ factory builds for TransferEngineInfo.transfer_engine
    == name ('local', 'shm', 'ucx', 'mooncake', 'cuda_ipc')."""
    if name in ("", "local"):
        return LocalOnlyKVTransferEngine()
    engine = NativeKVTransferEngine.__new__(_NamedNativeEngine)
    engine._adopt(_core._Engine.make(name, kv_cache, entity_id=entity_id, session_id=session_id,
                                     max_workers=max_workers, timeout=timeout,
                                     extra=_extra(options)), kv_cache, timeout)
    engine.name = name
    return engine


class _NamedNativeEngine(NativeKVTransferEngine):
    name = ""

    def __repr__(self) -> str:
        return f"NativeKVTransferEngine('{self.name}', {self.kv_cache!r})"
