"""Errors: one base class, one subclass per status code.

Every error the C++ library raises (a bad argument, before any byte moves)
and every failed transfer (through its future) arrives as a KVTransferError
subclass whose ``code`` mirrors ``mstar::kv::StatusCode`` and whose message is
the C++ message unchanged: it names the offending value and the limit, e.g.
``read 0: remote page 8 out of range [0, 8) in remote cache``.
"""
from __future__ import annotations

from . import _core

StatusCode = _core.StatusCode


class KVTransferError(Exception):
    """Base class of every mstar_kv error. ``code`` is a StatusCode."""

    code: StatusCode = StatusCode.INTERNAL

    def __init__(self, message: str, code: StatusCode | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = StatusCode(code)

    def __reduce__(self):  # picklable across processes
        return (_from_code, (int(self.code), self.message))


class RetryLaterError(KVTransferError):
    """Transient: resources busy (e.g. the pool is exhausted); retry later."""
    code = StatusCode.RETRY_LATER


class InvalidArgumentError(KVTransferError, ValueError):
    """A value outside its limit; raised before any byte moves."""
    code = StatusCode.INVALID_ARGUMENT


class IncompatibleLayoutError(KVTransferError, ValueError):
    """The two caches cannot exchange pages (the message names the field)."""
    code = StatusCode.INCOMPATIBLE_LAYOUT


class CorruptDescriptorError(KVTransferError, ValueError):
    """Untrusted descriptor bytes failed to decode (the message names the field)."""
    code = StatusCode.CORRUPT_DESCRIPTOR


class StaleDescriptorError(KVTransferError):
    """A descriptor of a dead or restarted owner, or of a freed cache."""
    code = StatusCode.STALE_DESCRIPTOR


class PermissionDeniedError(KVTransferError, PermissionError):
    """Memory of another user, or outside a registered region."""
    code = StatusCode.PERMISSION_DENIED


class NotFoundError(KVTransferError, LookupError):
    """The remote cache or sequence does not exist."""
    code = StatusCode.NOT_FOUND


class UnavailableError(KVTransferError, RuntimeError):
    """The engine is not built, or cannot run here (its runtime library or
    device is missing)."""
    code = StatusCode.UNAVAILABLE


class NotSupportedError(KVTransferError, NotImplementedError):
    """The engine has no such channel: no readiness channel for layer-wise
    streaming (local-only, a Python engine without watch_layers), no channel
    back to the owner for done notices (shm, cuda_ipc, mooncake)."""
    code = StatusCode.NOT_SUPPORTED


class PeerFailureError(KVTransferError, ConnectionError):
    """The peer died or became unreachable."""
    code = StatusCode.PEER_FAILURE


class TransferTimeoutError(KVTransferError, TimeoutError):
    """The transfer did not finish within the engine's timeout."""
    code = StatusCode.TIMEOUT


class TransferCancelledError(KVTransferError):
    """Cancelled by the caller (a cancelled future raises
    concurrent.futures.CancelledError instead; this class names the code)."""
    code = StatusCode.CANCELLED


class ShutdownError(KVTransferError):
    """The engine or manager shut down (or was used after cleanup())."""
    code = StatusCode.SHUTDOWN


class InternalError(KVTransferError):
    """A bug or an unexpected system error."""
    code = StatusCode.INTERNAL


_BY_CODE = {
    cls.code: cls
    for cls in (RetryLaterError, InvalidArgumentError, IncompatibleLayoutError,
                CorruptDescriptorError, StaleDescriptorError, PermissionDeniedError,
                NotFoundError, UnavailableError, PeerFailureError, TransferTimeoutError,
                TransferCancelledError, ShutdownError, InternalError, NotSupportedError)
}


def _from_code(code: int, message: str) -> KVTransferError:
    code = StatusCode(code)
    cls = _BY_CODE.get(code, KVTransferError)
    return cls(message, code)


error_from_code = _from_code
_core._set_error_factory(_from_code)
