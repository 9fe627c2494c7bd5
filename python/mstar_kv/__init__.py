"""mstar_kv: move one request's paged KV cache between LLM inference engines.

The spec's API (mstar.engine.resources.kv.transfer) over the C++ library
mstar::kv: one implementation of planning and engines, exposed to Python.

Pull one request (decode side)::

    import mstar_kv as kv
    layout = kv.KVLayout(num_layers=32, num_pages=1024, page_size=16,
                         num_kv_heads=8, head_dim=128, dtype="bf16")
    cache = kv.KVCache(layout)                       # or KVCache.from_dlpack(tensor, layout)
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("decode-0", "", "shm"), cache)
    seq = kv.SequenceInfo.from_bytes(published_bytes)  # from the prefill side
    pages = list(range(len(seq.page_indices)))
    fut = mgr.start_async_retrieve(0, seq.num_tokens, pages, seq.page_indices,
                                   seq.kv_transfer_info)
    fut.result()                                     # bytes read, or a KVTransferError
"""
from __future__ import annotations

from . import _core
from .cuda_share import CudaIpcKVTransferInfo, parse_cuda_share
from .engines import (
                     CudaIpcKVTransferEngine,
                     FaultInjectingKVTransferEngine,
                     KVTransferEngine,
                     LocalOnlyKVTransferEngine,
                     NativeKVTransferEngine,
                     ShmKVTransferEngine,
                     UcxKVTransferEngine,
                     make_native_engine,
)
from .errors import (
                     CorruptDescriptorError,
                     IncompatibleLayoutError,
                     InternalError,
                     InvalidArgumentError,
                     KVTransferError,
                     NotFoundError,
                     NotSupportedError,
                     PeerFailureError,
                     PermissionDeniedError,
                     RetryLaterError,
                     ShutdownError,
                     StaleDescriptorError,
                     StatusCode,
                     TransferCancelledError,
                     TransferTimeoutError,
                     UnavailableError,
)
from .futures import TransferFuture
from .manager import KVTransferManager, TransferEngineInfo
from .mooncake_engines import MooncakeKVTransferEngine, MooncakeNativeKVTransferEngine
from .mooncake_wheel import MooncakeWheelKVTransferEngine
from .requests import RequestKVTransferInfo
from .streaming import LayerStream

KVLayout = _core.KVLayout
KVCache = _core.KVCache
KVCachePool = _core.KVCachePool
KVReadInfo = _core.KVReadInfo
KVTransferInfo = _core.KVTransferInfo
SequenceInfo = _core.SequenceInfo
ShmKVTransferInfo = _core.ShmKVTransferInfo
MooncakeKVTransferInfo = _core.MooncakeKVTransferInfo
UcxKVTransferInfo = getattr(_core, "UcxKVTransferInfo", None)
plan_reads = _core.plan_reads
plan_copy_addresses = _core.plan_copy_addresses
built_engines = _core.built_engines
cuda_unavailable_reason = _core.cuda_unavailable_reason

__version__ = "0.1.0"

__all__ = [
    "CorruptDescriptorError", "CudaIpcKVTransferEngine", "CudaIpcKVTransferInfo",
    "FaultInjectingKVTransferEngine", "IncompatibleLayoutError", "InternalError",
    "InvalidArgumentError", "KVCache", "KVCachePool", "KVLayout", "KVReadInfo",
    "KVTransferEngine", "KVTransferError", "KVTransferInfo", "KVTransferManager", "LayerStream",
    "LocalOnlyKVTransferEngine", "MooncakeKVTransferEngine", "MooncakeKVTransferInfo",
    "MooncakeNativeKVTransferEngine", "MooncakeWheelKVTransferEngine",
    "NativeKVTransferEngine", "NotFoundError", "NotSupportedError", "PeerFailureError", "PermissionDeniedError",
    "RequestKVTransferInfo", "RetryLaterError", "SequenceInfo", "ShmKVTransferEngine", "ShmKVTransferInfo",
    "ShutdownError", "StaleDescriptorError", "StatusCode", "TransferCancelledError",
    "TransferEngineInfo", "TransferFuture", "TransferTimeoutError", "UcxKVTransferEngine",
    "UcxKVTransferInfo", "UnavailableError", "built_engines", "cuda_unavailable_reason", "make_native_engine",
    "parse_cuda_share", "plan_copy_addresses", "plan_reads",
]
