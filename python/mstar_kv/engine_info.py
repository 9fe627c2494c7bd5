"""TransferEngineInfo: who a process is to its peers and which transfer engine
moves its pages. The spec's three fields plus mstar_kv's ``options``, and
upstream mstar's ``shm_dir`` / ``shm_dir_factory`` / ``get_shm_dir()``, so
that one class takes both calling conventions (the spec's calls unchanged)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Mapping, Optional


@dataclasses.dataclass
class TransferEngineInfo:
    """Who this process is to its peers and which transfer engine moves its pages.

    ``transfer_engine``: a built engine's name ('local', 'shm', 'ucx',
    'mooncake' for Mooncake's C library, 'cuda_ipc'), a
    ``mooncake.engine.TransferEngine`` of the PyPI wheel initialised by the
    application, or a KVTransferEngine instance. ``options``: ``max_workers``,
    ``timeout`` (seconds) and engine-specific keys (docs/engines/*.md).

    ``shm_dir`` / ``shm_dir_factory`` are upstream mstar's (its shm engine
    wrote publications into that directory); mstar_kv's engines write no
    file, so they are kept for the caller (``get_shm_dir()``) and used by
    none. Upstream's positional order ``(id, session, engine, shm_dir,
    shm_dir_factory)`` is accepted too: a fourth argument that is a path
    (or None) is ``shm_dir``, not ``options``.
    """

    my_entity_id: str
    my_session_id: str
    transfer_engine: Any
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    shm_dir: Optional[str] = None
    shm_dir_factory: Optional[Callable[[], str]] = None

    def __post_init__(self) -> None:
        if self.options is None or isinstance(self.options, (str, bytes, os.PathLike)):
            if self.shm_dir_factory is not None:
                raise TypeError("TransferEngineInfo: options is a path and shm_dir_factory is "
                                "given too; pass options, shm_dir, shm_dir_factory by keyword")
            # upstream's (..., shm_dir, shm_dir_factory) given by position
            self.options, self.shm_dir, self.shm_dir_factory = {}, self.options, self.shm_dir
        if not isinstance(self.options, Mapping):
            raise TypeError(f"TransferEngineInfo: options of type {type(self.options).__name__}"
                            " is not a mapping (engine options) nor a path (upstream's shm_dir)")
        if self.shm_dir is not None and not isinstance(self.shm_dir, (str, os.PathLike)):
            raise TypeError(f"TransferEngineInfo: shm_dir of type {type(self.shm_dir).__name__} "
                            "is not a path")
        if self.shm_dir_factory is not None and not callable(self.shm_dir_factory):
            raise TypeError("TransferEngineInfo: shm_dir_factory of type "
                            f"{type(self.shm_dir_factory).__name__} is not callable")

    def get_shm_dir(self) -> Optional[str]:
        """shm_dir, else what shm_dir_factory returns (called once, when first
        asked, and kept), else None."""
        if self.shm_dir is None and self.shm_dir_factory is not None:
            self.shm_dir = self.shm_dir_factory()
        return None if self.shm_dir is None else os.fspath(self.shm_dir)
