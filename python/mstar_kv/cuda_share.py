"""CudaIpcKVTransferInfo from torch's own CUDA IPC descriptor.

``torch.UntypedStorage._share_cuda_()`` returns 8 fields: (device, handle
bytes, storage size in bytes, storage offset in bytes, ref-counter handle,
ref-counter offset, event handle, event-sync flag). The handle is either the
bare 64-byte ``cudaIpcMemHandle_t`` or, in recent torch, versioned: a version
byte, a type byte (``c`` for a cudaIpcMemHandle_t, ``e`` for an
expandable-segment handle, which legacy CUDA IPC cannot open), then the
handle. ``size``/``stride``/``offset`` are in elements, as torch's
``rebuild_cuda_tensor`` takes them (offset relative to the storage).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Optional, Tuple

from . import _core
from .errors import InvalidArgumentError, UnavailableError

HANDLE_BYTES = 64


def parse_cuda_share(cuda_share: Any) -> Tuple[int, bytes, int, int]:
    """(device, 64-byte handle, storage bytes, storage offset bytes) from the
    tuple torch's _share_cuda_() returns. Raises InvalidArgumentError naming
    the field."""
    if not isinstance(cuda_share, (tuple, list)) or len(cuda_share) != 8:
        n = len(cuda_share) if isinstance(cuda_share, (tuple, list)) else type(cuda_share).__name__
        raise InvalidArgumentError(
            f"cuda_share must be the 8-field tuple of torch.UntypedStorage._share_cuda_() "
            f"(device, handle, storage size, storage offset, ref-counter handle, ref-counter "
            f"offset, event handle, event sync), got {n}")
    device, handle, size_bytes, offset_bytes = cuda_share[:4]
    if not isinstance(device, int) or device < 0:
        raise InvalidArgumentError(f"cuda_share device {device!r} is not a CUDA ordinal >= 0")
    if not isinstance(handle, (bytes, bytearray)):
        raise InvalidArgumentError(
            f"cuda_share handle is a {type(handle).__name__}, not bytes")
    handle = bytes(handle)
    if len(handle) == HANDLE_BYTES:
        raw = handle
    elif len(handle) >= 2 and handle[1:2] == b"e":
        raise InvalidArgumentError(
            "cuda_share handle is an expandable-segment handle (torch with "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); legacy CUDA IPC cannot open "
            "it: allocate the cache without expandable segments")
    elif len(handle) == HANDLE_BYTES + 2 and handle[1:2] == b"c":
        raw = handle[2:]
    else:
        kind = handle[1:2] if len(handle) >= 2 else b""
        raise InvalidArgumentError(
            f"cuda_share handle of {len(handle)} bytes (type byte {kind!r}) is neither a bare "
            f"{HANDLE_BYTES}-byte cudaIpcMemHandle_t nor the versioned form (version byte, "
            f"b'c', {HANDLE_BYTES} bytes)")
    for name, v in (("storage size", size_bytes), ("storage offset", offset_bytes)):
        if not isinstance(v, int) or v < 0:
            raise InvalidArgumentError(f"cuda_share {name} {v!r} is not a byte count >= 0")
    return device, raw, size_bytes, offset_bytes


def _torch_device_uuid(device: int) -> Optional[bytes]:
    try:
        import torch  # noqa: F401
        props = torch.cuda.get_device_properties(device)
        return bytes(props.uuid.bytes)
    except Exception:
        return None


class CudaIpcKVTransferInfo:
    """The spec's CudaIpcKVTransferInfo(cuda_share, size, stride, offset,
    dtype, requires_grad, layout).

    Made in the owner process: ``owner_pid`` defaults to this process,
    ``generation`` to a hash of the handle (one allocation), ``device_uuid``
    to torch's ``get_device_properties(device).uuid`` (pass it without
    torch). ``size``/``stride`` must be the layout's contiguous 6-D view and
    ``requires_grad`` False; anything else raises CorruptDescriptorError
    naming the field. ``encode()`` gives the KVTransferInfo that crosses
    processes; the object pickles through it.
    """

    def __init__(self, cuda_share, size, stride, offset, dtype, requires_grad, layout, *,
                 device_uuid: Optional[bytes] = None, generation: Optional[int] = None,
                 owner_pid: Optional[int] = None, _native=None):
        self.cuda_share = tuple(cuda_share)
        self.size = tuple(size)
        self.stride = tuple(stride)
        self.offset = int(offset)
        self.dtype = str(dtype)
        self.requires_grad = bool(requires_grad)
        self.layout = layout
        if _native is not None:
            self._native = _native
            return
        if not hasattr(_core, "_CudaIpcKVTransferInfo"):
            raise UnavailableError("CudaIpcKVTransferInfo needs the cuda_ipc engine, which is "
                                   "not built into this mstar_kv")
        device, handle, size_bytes, offset_bytes = parse_cuda_share(cuda_share)
        es = layout.element_size
        if offset_bytes % es:
            raise InvalidArgumentError(
                f"cuda_share storage offset {offset_bytes} bytes is not a multiple of the "
                f"element size {es}")
        if device_uuid is None:
            device_uuid = _torch_device_uuid(device) or bytes(16)
        if generation is None:
            generation = int.from_bytes(hashlib.blake2b(handle, digest_size=8).digest(),
                                        "little") | 1
        self._native = _core._CudaIpcKVTransferInfo(
            handle=handle, device=device, device_uuid=bytes(device_uuid),
            allocation_bytes=offset_bytes + size_bytes, size=list(self.size),
            stride=list(self.stride), offset=offset_bytes // es + self.offset,
            dtype=self.dtype, requires_grad=self.requires_grad, layout=layout,
            generation=generation, owner_pid=os.getpid() if owner_pid is None else owner_pid)

    @property
    def handle(self) -> bytes:
        return self._native.handle

    @property
    def generation(self) -> int:
        return self._native.generation

    @property
    def owner_pid(self) -> int:
        return self._native.owner_pid

    def encode(self):
        return self._native.encode()

    def to_bytes(self) -> bytes:
        return self._native.to_bytes()

    @classmethod
    def decode(cls, info) -> "CudaIpcKVTransferInfo":
        n = _core._CudaIpcKVTransferInfo.decode(info)
        share = (n.device, n.handle, n.allocation_bytes, 0, b"", 0, b"", False)
        return cls(share, n.size, n.stride, n.offset, n.dtype, n.requires_grad, n.layout,
                   _native=n)

    @classmethod
    def from_bytes(cls, data: bytes) -> "CudaIpcKVTransferInfo":
        return cls.decode(_core.KVTransferInfo.from_bytes(data))

    def __eq__(self, other) -> bool:
        return isinstance(other, CudaIpcKVTransferInfo) and self.to_bytes() == other.to_bytes()

    def __reduce__(self):
        return (CudaIpcKVTransferInfo.from_bytes, (self.to_bytes(),))

    def __repr__(self) -> str:
        return (f"CudaIpcKVTransferInfo(device={self._native.device}, size={self.size}, "
                f"offset={self.offset}, dtype='{self.dtype}', layout={self.layout!r})")
