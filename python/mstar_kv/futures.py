"""TransferFuture: a concurrent.futures.Future completed by the engine.

The engine's own completion (a worker, progress or completion thread of the
C++ engine) resolves the future: no Python thread is parked per read.
``result()`` / ``exception()`` wait on the engine's future itself with the GIL
released (in 50 ms slices, so KeyboardInterrupt still arrives) and settle it
on the waiting thread; for everyone else (done callbacks,
``concurrent.futures.wait``) the library's one callback thread (never an
engine thread, which must not wait for the GIL) delivers the outcome as soon
as the read resolves. The future is a real ``concurrent.futures.Future``
(nothing of its private state is replaced), so ``result()``,
``add_done_callback``, ``concurrent.futures.wait`` / ``as_completed`` and
``asyncio.wrap_future`` work as usual; ``result()`` is the number of bytes
read. A failed read raises the KVTransferError subclass of its status code.

Resolution is a promise: once ``done()`` is true, no byte of that read lands
in a local page any more (a failed or cancelled read may have written some of
its destination pages, which then hold undefined data; no other page is
touched).
"""
from __future__ import annotations

import concurrent.futures
import threading
import time

from . import _core
from .errors import StatusCode, error_from_code

_OK = int(StatusCode.OK)
_CANCELLED = int(StatusCode.CANCELLED)
_SLICE = 0.05  # seconds per native wait while result() blocks


class TransferFuture(concurrent.futures.Future):
    """The outcome of one read: bytes read, or an exception.

    While the read is in flight the future is pending (``running()`` is
    False: there is no Python worker running it). ``cancel()`` asks the engine
    to stop and waits, with the GIL released, until the engine resolved the
    read (the engine's timeout bounds the wait); it returns True when the read
    ended cancelled, False when it had already finished (bytes or error).
    Safe from any thread. Dropping the future lets the read finish unobserved.
    """

    def __init__(self, native: "_core._Future"):
        super().__init__()
        self._native = native
        self._settle_lock = threading.Lock()
        self._settled = False
        if native.ready():
            self._settle_from_native()
        else:
            # Whoever is not waiting in result() (wait(), as_completed, done
            # callbacks, asyncio.wrap_future) learns the outcome from the
            # callback thread; result() settles first on its own thread.
            native.on_resolved(self._on_resolved)

    def _settle_from_native(self) -> None:
        code, message = self._native.status()
        self._on_resolved(code, message, self._native.bytes)

    def done(self) -> bool:
        if not self._settled and self._native.ready():
            self._settle_from_native()
        return super().done()

    # Runs on the engine's thread with the GIL taken (or right away).
    def _on_resolved(self, code: int, message: str, nbytes: int) -> None:
        with self._settle_lock:
            if self._settled:
                return
            self._settled = True
        if code == _OK:
            self.set_result(nbytes)
        elif code == _CANCELLED:
            concurrent.futures.Future.cancel(self)
            self.set_running_or_notify_cancel()
        else:
            self.set_exception(error_from_code(code, message))

    def _wait_native(self, timeout) -> None:
        # Waiting on the native future (GIL released) and settling here saves
        # the hand-off to the engine thread's callback, which must take the GIL
        # first (tens of microseconds per read). Sliced, so that signals
        # (KeyboardInterrupt) are still seen by the main thread.
        if self.done():
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = _SLICE if deadline is None else min(_SLICE, deadline - time.monotonic())
            if step <= 0:
                return
            if self._native.wait(step):
                self._settle_from_native()
                return

    def result(self, timeout=None):
        self._wait_native(timeout)
        return super().result(timeout=timeout)

    def exception(self, timeout=None):
        self._wait_native(timeout)
        return super().exception(timeout=timeout)

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        self._native.cancel()
        self._native.wait()
        self._settle_from_native()
        return self.cancelled()

    @property
    def bytes_read(self) -> int:
        """Bytes read once resolved successfully, else 0."""
        return self._native.bytes


def wrap_native(native):
    """A TransferFuture for a native future, None for None."""
    return None if native is None else TransferFuture(native)
