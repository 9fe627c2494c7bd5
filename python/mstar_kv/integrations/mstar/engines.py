"""Upstream mstar's KV transfer engines over mstar_kv.

Each engine (but local-only) is one mstar_kv.KVTransferManager over
upstream's cache wrapped without a copy (cache.py): request-scoped
descriptors with page epochs (mstar_kv.requests), planning and copies in
C++. Failures of a read arrive on its Future (upstream's contract: one bad
request must not fail the scheduler loop), never as an exception.
"""
from __future__ import annotations

import abc
import concurrent.futures
from typing import Any, Optional, Sequence

import mstar_kv as kv
from mstar_kv.requests import RequestKVTransferInfo, as_request_info

from .cache import wrap_kv_cache

KVReadInfo = kv.KVReadInfo


def failed_future(error: BaseException) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_exception(error)
    return future


class KVTransferEngine(abc.ABC):
    """Upstream's interface: request-scoped descriptors, reads on futures."""

    @abc.abstractmethod
    def read_batched_async(self, remote_kv_info: Any,
                           read_info: Sequence[Any]) -> Optional[concurrent.futures.Future]:
        """Starts the reads; a Future (failures on it), or None for no reads."""

    @abc.abstractmethod
    def get_kv_transfer_info(self, request_id: Optional[str] = None,
                             label: Optional[str] = None,
                             page_indices: Optional[Sequence[int]] = None,
                             seq_len: Optional[int] = None,
                             reset_generation: Optional[int] = None) -> Any:
        """The descriptor of one request's labelled pages, or None."""

    def remove_request(self, request_id: str) -> None:
        """Releases request-scoped transfer resources, if any."""
        del request_id

    def owns_transfer_info(self, transfer_info: Any, request_id: str, label: str) -> bool:
        del request_id, label
        return transfer_info == self.get_kv_transfer_info()

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Releases everything; idempotent."""


class ShmKVTransferInfo(RequestKVTransferInfo):
    """A request-scoped descriptor published by ShmKVTransferEngine."""
    __slots__ = ()


class CudaIpcKVTransferInfo(RequestKVTransferInfo):
    """A request-scoped descriptor published by CudaIpcKVTransferEngine."""
    __slots__ = ()


class MooncakeKVTransferInfo(RequestKVTransferInfo):
    """A request-scoped descriptor published by MooncakeKVTransferEngine."""
    __slots__ = ()


def _read(r: Any) -> "kv.KVReadInfo":
    if isinstance(r, kv.KVReadInfo):
        return r
    return kv.KVReadInfo(int(r.layer_idx), int(r.local_page_idx), int(r.remote_page_idx),
                         int(r.token_start), int(r.token_end))


def _descriptor(info: Any) -> RequestKVTransferInfo:
    if isinstance(info, RequestKVTransferInfo):
        return info
    if info is None:
        raise kv.InvalidArgumentError("no descriptor: the remote published nothing (a local-only "
                                      "resource, or a request not published)")
    raise kv.InvalidArgumentError(
        f"kv_transfer_info of type {type(info).__module__}.{type(info).__name__} is not a "
        "descriptor of mstar_kv.integrations.mstar (get_kv_transfer_info(request_id, label, "
        "page_indices, seq_len, ...) of an engine of this module publishes them)")


class _ManagedEngine(KVTransferEngine):
    """An engine of this module: one mstar_kv.KVTransferManager."""

    _info_type: type = RequestKVTransferInfo

    def _start(self, kv_cache: Any, engine_info: Any, resource_key: str,
               needs_remote_transfer: bool) -> None:
        self._kv_cache = kv_cache
        self.cache = wrap_kv_cache(kv_cache)
        self.manager = kv.KVTransferManager(engine_info, self.cache, resource_key=resource_key,
                                            needs_remote_transfer=needs_remote_transfer)

    def get_kv_transfer_info(self, request_id=None, label=None, page_indices=None,
                             seq_len=None, reset_generation=None):
        """The request's descriptor, or None when an argument is missing (as
        upstream) or nothing is published (needs_remote_transfer False)."""
        if request_id is None or label is None or page_indices is None or seq_len is None:
            return None
        info = self.manager.get_kv_transfer_info(request_id=request_id, label=label,
                                                 page_indices=page_indices, seq_len=seq_len,
                                                 reset_generation=reset_generation)
        return None if info is None else as_request_info(info, self._info_type)

    def owns_transfer_info(self, transfer_info, request_id, label) -> bool:
        return (isinstance(transfer_info, RequestKVTransferInfo) and
                self.manager.owns_transfer_info(transfer_info, request_id, label))

    def remove_request(self, request_id: str) -> None:
        self.manager.remove_request(request_id)

    def read_batched_async(self, remote_kv_info, read_info):
        """Reads planned by the caller (upstream's KVReadInfo or mstar_kv's):
        a Future of the bytes read (failures on it: a page the descriptor did
        not publish, tokens beyond its seq_len, a stale page, a dead owner),
        or None for no reads."""
        try:
            reads = [_read(r) for r in read_info]
            return self.manager.read_batched_async(_descriptor(remote_kv_info), reads)
        except Exception as error:  # noqa: BLE001 - upstream's contract: on the future
            return failed_future(error)

    def retrieve(self, start_len: int, end_len: int, local_page_indices: Sequence[int],
                 remote_page_indices: Sequence[int], kv_transfer_info: Any):
        """KVTransferManager.start_async_retrieve's pull (planned in C++)."""
        return self.manager.start_async_retrieve(start_len, end_len, local_page_indices,
                                                 remote_page_indices,
                                                 _descriptor(kv_transfer_info))

    def shutdown(self) -> None:
        """Releases every publication (their descriptors turn stale), then
        the engine; idempotent."""
        self.manager.cleanup()


class ShmKVTransferEngine(_ManagedEngine):
    """Same host, host memory. Upstream copied each publication into a
    /dev/shm file; this engine serves the cache itself: readers copy the
    published pages straight out of it (a shared cache by its memfd, the
    engine-allocated tensor by cross-memory attach, docs/engines/shm.md), so
    a publication copies nothing and leaves no file behind. ``shm_dir`` is
    accepted for upstream's signature and not used."""

    _info_type = ShmKVTransferInfo

    def __init__(self, kv_cache: Any, entity_id: str, shm_dir: Optional[str] = None,
                 resource_key: str = "kv", needs_remote_transfer: bool = True):
        del shm_dir
        self._start(kv_cache, kv.TransferEngineInfo(entity_id, "", "shm"), resource_key,
                    needs_remote_transfer)


class CudaIpcKVTransferEngine(_ManagedEngine):
    """Same host, GPU memory (mstar_kv's cuda_ipc engine, copies on
    ``max_workers`` streams)."""

    _info_type = CudaIpcKVTransferInfo

    def __init__(self, kv_cache: Any, max_workers: int = 3, resource_key: str = "kv",
                 needs_remote_transfer: bool = True):
        self._start(kv_cache, kv.TransferEngineInfo("", "", "cuda_ipc",
                                                    {"max_workers": int(max_workers)}),
                    resource_key, needs_remote_transfer)


def mooncake_wheel_engine(transfer_engine: Any) -> Any:
    """The Mooncake wheel's TransferEngine an upstream MooncakeTransferEngine
    wraps (its ``_engine``), or the wheel object itself."""
    inner = getattr(transfer_engine, "_engine", None)
    if inner is not None and type(inner).__module__.startswith("mooncake"):
        return inner
    if type(transfer_engine).__module__.startswith("mooncake"):
        return transfer_engine
    raise ValueError(f"transfer_engine of type {type(transfer_engine).__name__} wraps no "
                     "mooncake.engine.TransferEngine (upstream's MooncakeTransferEngine keeps "
                     "it as ._engine)")


class MooncakeKVTransferEngine(_ManagedEngine):
    """Across hosts through the Mooncake wheel's TransferEngine that
    upstream's MooncakeTransferEngine wraps (mstar_kv's wheel engine: one
    registration of the cache, reads planned and coalesced in C++)."""

    _info_type = MooncakeKVTransferInfo

    def __init__(self, kv_cache: Any, entity_id: str, transfer_engine: Any,
                 resource_key: str = "kv", needs_remote_transfer: bool = True):
        wheel = mooncake_wheel_engine(transfer_engine)
        session = transfer_engine.get_session_id() if hasattr(transfer_engine,
                                                               "get_session_id") else ""
        self._start(kv_cache, kv.TransferEngineInfo(entity_id, session, wheel), resource_key,
                    needs_remote_transfer)


class LocalOnlyKVTransferEngine(KVTransferEngine):
    """A KV cache that never leaves its worker: publishes nothing; a read is
    refused (on its future)."""

    def read_batched_async(self, remote_kv_info, read_info):
        del remote_kv_info
        if read_info:
            return failed_future(kv.NotSupportedError(
                "cross-worker KV migration was requested for a local-only resource"))
        return None

    def get_kv_transfer_info(self, request_id=None, label=None, page_indices=None,
                             seq_len=None, reset_generation=None) -> None:
        del request_id, label, page_indices, seq_len, reset_generation

    def retrieve(self, start_len, end_len, local_page_indices, remote_page_indices,
                 kv_transfer_info):
        return self.read_batched_async(kv_transfer_info, [None])

    def shutdown(self) -> None:
        pass
