"""The spec's MooncakeKVTransferEngine(kv_cache, entity_id, transfer_engine):
the entry point that picks one of mstar-kv's two Mooncake engines.

* ``transfer_engine`` is the application's ``mooncake.engine.TransferEngine``
  (the PyPI wheel, initialised): MooncakeWheelKVTransferEngine
  (mstar_kv.mooncake_wheel) reads through that object.
* ``transfer_engine`` is None: MooncakeNativeKVTransferEngine, the C++ engine
  over Mooncake's C library loaded at run time (options 'mooncake_lib',
  'mooncake_protocol', ...; docs/engines/mooncake.md).

Both are instances of MooncakeKVTransferEngine; their descriptors
(MooncakeKVTransferInfo) and identity pages are the same, so owners and
readers of either kind interoperate.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from . import _core
from .engines import KVTransferEngine, NativeKVTransferEngine, _extra


class MooncakeKVTransferEngine(KVTransferEngine):
    """``MooncakeKVTransferEngine(kv_cache, entity_id, transfer_engine, **options)``
    makes a MooncakeWheelKVTransferEngine for a wheel ``TransferEngine`` and a
    MooncakeNativeKVTransferEngine for None (see the module docstring)."""

    def __new__(cls, kv_cache, entity_id: str, transfer_engine: Any = None, **options):
        if cls is MooncakeKVTransferEngine:
            if transfer_engine is None:
                cls = MooncakeNativeKVTransferEngine
            else:
                from .mooncake_wheel import MooncakeWheelKVTransferEngine
                cls = MooncakeWheelKVTransferEngine
        return super().__new__(cls)


class MooncakeNativeKVTransferEngine(MooncakeKVTransferEngine, NativeKVTransferEngine):
    """The C++ engine over Mooncake's C library (include/mstar/kv/engines/mooncake.hpp),
    loaded at run time: ``options`` are its extra settings ('mooncake_lib',
    ...), ``session_id`` Mooncake's "HOST:PORT" (P2P handshake: empty picks a
    port)."""

    def __init__(self, kv_cache, entity_id: str, transfer_engine: Any = None, *,
                 timeout: float = 30.0, session_id: Optional[str] = None,
                 options: Optional[Mapping[str, Any]] = None, **_ignored):
        self._adopt(_core._Engine.make("mooncake", kv_cache, entity_id=entity_id,
                                       session_id=session_id or "", timeout=timeout,
                                       extra=_extra(options)), kv_cache, timeout)
        self.entity_id = entity_id

    def __repr__(self) -> str:
        return f"MooncakeNativeKVTransferEngine({self.entity_id!r}, {self.kv_cache!r})"
