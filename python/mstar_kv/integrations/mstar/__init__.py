"""Upstream mstar's KV transfer module (mstar.engine.resources.kv.transfer)
over mstar_kv: ``from mstar_kv.integrations.mstar import *`` in place of it.

Upstream's objects are taken as they are, duck-typed (mstar is never
imported): its KVCache (``.tensor`` [L, P, 2, T, H, D] or [L, 2, P, T, H, D],
any device) wrapped without a copy, and its transfer engines
(``LocalTransferEngine``, ``MooncakeTransferEngine`` around the Mooncake
wheel). Descriptors are request-scoped (resource_key, request_id, label,
reset_generation) and carry page epochs: a read of a removed request, a
replaced generation or a cleaned-up manager fails with StaleDescriptorError
on its Future. docs/integrations/mstar.md says what maps to what.
"""
from .engines import (
                      CudaIpcKVTransferEngine,
                      CudaIpcKVTransferInfo,
                      KVReadInfo,
                      KVTransferEngine,
                      LocalOnlyKVTransferEngine,
                      MooncakeKVTransferEngine,
                      MooncakeKVTransferInfo,
                      ShmKVTransferEngine,
                      ShmKVTransferInfo,
)
from .manager import KVTransferManager, TransferEngineInfo, make_deployment_kv_shm_dir

__all__ = [
    "CudaIpcKVTransferEngine", "CudaIpcKVTransferInfo", "KVReadInfo", "KVTransferEngine",
    "KVTransferManager", "LocalOnlyKVTransferEngine", "MooncakeKVTransferEngine",
    "MooncakeKVTransferInfo", "ShmKVTransferEngine", "ShmKVTransferInfo", "TransferEngineInfo",
    "make_deployment_kv_shm_dir",
]
