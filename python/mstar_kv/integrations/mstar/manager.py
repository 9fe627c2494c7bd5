"""Upstream mstar's TransferEngineInfo, KVTransferManager and
make_deployment_kv_shm_dir over mstar_kv.

The transfer engine upstream passes is dispatched as upstream does, without
importing mstar: by its class when mstar.communication.tensors is already
loaded (it is, wherever upstream made the object), else by its class name.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
from typing import Any, Optional, Sequence

import mstar_kv as kv

from .cache import is_cuda
from .engines import (
    CudaIpcKVTransferEngine,
    KVTransferEngine,
    LocalOnlyKVTransferEngine,
    MooncakeKVTransferEngine,
    ShmKVTransferEngine,
    failed_future,
)

_TENSORS = "mstar.communication.tensors"


def _is(obj: Any, class_name: str) -> bool:
    module = sys.modules.get(_TENSORS)
    cls = getattr(module, class_name, None) if module is not None else None
    if isinstance(cls, type) and isinstance(obj, cls):
        return True
    return any(c.__name__ == class_name for c in type(obj).__mro__)


def _engine_kind(transfer_engine: Any) -> str:
    if _is(transfer_engine, "MooncakeTransferEngine"):
        return "mooncake"
    if _is(transfer_engine, "LocalTransferEngine"):
        return "local"
    if type(transfer_engine).__module__.startswith("mooncake"):
        return "mooncake"  # the wheel's TransferEngine itself
    raise ValueError(f"Unsupported transfer engine type: {type(transfer_engine)}")


# Upstream's TransferEngineInfo(my_entity_id, my_session_id, transfer_engine,
# shm_dir=None, shm_dir_factory=None) is mstar_kv's own (a superset).
TransferEngineInfo = kv.TransferEngineInfo


def make_deployment_kv_shm_dir(socket_path_prefix: str, dist_init_method: str,
                               owner_pid: Optional[int] = None) -> str:
    """A private (0700) directory for one local deployment, under
    $MSTAR_KV_SHM_DIR, else /dev/shm, else /tmp: named by this uid, the
    conductor's pid (owner_pid, default the parent's) and a digest of the two
    endpoints, so that concurrent servers never share one. Directories of this
    uid whose conductor is gone are removed first. mstar_kv's own engines
    write nothing into it."""
    base = os.environ.get("MSTAR_KV_SHM_DIR")
    if base is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    os.makedirs(base, exist_ok=True)
    uid = os.getuid() if hasattr(os, "getuid") else 0
    pid = os.getppid() if owner_pid is None else int(owner_pid)
    digest = hashlib.sha256(f"{socket_path_prefix}\0{dist_init_method}".encode()).hexdigest()[:16]
    prefix = f"mstar_kv_{uid}_"
    path = os.path.join(base, f"{prefix}{pid}_{digest}")
    for entry in os.scandir(base):
        if (not entry.name.startswith(prefix) or entry.path == path
                or not entry.is_dir(follow_symlinks=False)):
            continue
        pid_text, sep, _ = entry.name[len(prefix):].partition("_")
        if not sep or not pid_text.isdigit():
            continue
        try:
            os.kill(int(pid_text), 0)
        except ProcessLookupError:
            shutil.rmtree(entry.path, ignore_errors=True)
        except PermissionError:
            pass
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


class KVTransferManager:
    """Upstream's KVTransferManager(transfer_engine_info, kv_cache,
    resource_key="kv", needs_remote_transfer=True) over mstar_kv: the engine
    as upstream picks it (Mooncake -> MooncakeKVTransferEngine; Local with a
    CUDA cache -> CudaIpcKVTransferEngine; Local with a host cache and remote
    consumers -> ShmKVTransferEngine; else LocalOnlyKVTransferEngine), pulls
    planned in C++. Every failure of a pull arrives on its Future."""

    def __init__(self, transfer_engine_info: TransferEngineInfo, kv_cache: Any,
                 resource_key: str = "kv", needs_remote_transfer: bool = True):
        te = transfer_engine_info.transfer_engine
        kind = _engine_kind(te)
        entity = transfer_engine_info.my_entity_id
        self.resource_key = resource_key
        self._kv_transfer_engine: KVTransferEngine
        if kind == "mooncake":
            self._kv_transfer_engine = MooncakeKVTransferEngine(
                kv_cache, entity, te, resource_key=resource_key,
                needs_remote_transfer=needs_remote_transfer)
        elif is_cuda(kv_cache):
            self._kv_transfer_engine = CudaIpcKVTransferEngine(
                kv_cache, resource_key=resource_key, needs_remote_transfer=needs_remote_transfer)
        elif needs_remote_transfer:
            self._kv_transfer_engine = ShmKVTransferEngine(kv_cache, entity,
                                                           resource_key=resource_key)
        else:
            self._kv_transfer_engine = LocalOnlyKVTransferEngine()

    def start_async_retrieve(self, start_len: int, end_len: int,
                             local_page_indices: Sequence[int],
                             remote_page_indices: Sequence[int], kv_transfer_info: Any):
        """None when start_len >= end_len (before looking at anything else);
        else a Future of the bytes read. Every error (a bad table, a
        descriptor of another resource or engine, a corrupt one, a stale
        page, a dead owner) is on that Future."""
        if start_len >= end_len:
            return None
        try:
            return self._kv_transfer_engine.retrieve(start_len, end_len, local_page_indices,
                                                     remote_page_indices, kv_transfer_info)
        except Exception as error:  # noqa: BLE001 - upstream's contract: on the future
            return failed_future(error)

    def sync_retrieve(self, *args, **kwargs) -> None:
        future = self.start_async_retrieve(*args, **kwargs)
        if future is not None:
            future.result()

    def get_kv_transfer_info(self, request_id: Optional[str] = None,
                             label: Optional[str] = None,
                             page_indices: Optional[Sequence[int]] = None,
                             seq_len: Optional[int] = None,
                             reset_generation: Optional[int] = None):
        """The descriptor of one request's labelled pages (equal for equal
        arguments, picklable), or None where nothing is published."""
        return self._kv_transfer_engine.get_kv_transfer_info(
            request_id=request_id, label=label, page_indices=page_indices, seq_len=seq_len,
            reset_generation=reset_generation)

    def remove_request(self, request_id: str) -> None:
        self._kv_transfer_engine.remove_request(request_id)

    def owns_transfer_info(self, transfer_info: Any, request_id: str, label: str) -> bool:
        return self._kv_transfer_engine.owns_transfer_info(
            transfer_info=transfer_info, request_id=request_id, label=label)

    def cleanup(self) -> None:
        self._kv_transfer_engine.shutdown()
