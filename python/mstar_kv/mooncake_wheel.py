"""MooncakeWheelKVTransferEngine: the spec's Mooncake engine over the PyPI wheel.

``MooncakeKVTransferEngine(kv_cache, entity_id, transfer_engine)`` (the
spec's entry point, mstar_kv.mooncake_engines) makes one of these when
``transfer_engine`` is the application's ``mooncake.engine.TransferEngine``
(PyPI wheel ``mooncake-transfer-engine-non-cuda``, or Mooncake's own build),
already initialised, e.g. ``te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp",
"")``. The engine registers the cache and a 4 KiB identity page with it,
describes the cache as a MooncakeKVTransferInfo, plans every read with the
C++ planner and reads through that object. A cache of one region per layer
(``KVCache.from_layer_tensors``) is registered region by region and its
descriptor names each layer's address (``layer_regions``); readers of
either kind map every copy through them (a copy never crosses a layer). The identity page holds the same
bytes the C++ Mooncake engine registers, so owners and readers of either kind
interoperate. With ``transfer_engine=None`` the entry point makes a
MooncakeNativeKVTransferEngine instead (the C++ engine over Mooncake's C
library, options 'mooncake_lib' etc.).

Progress: ``read_batched_async`` validates the descriptor and the reads,
checks the descriptor against the owner's identity page (once per owner and
generation: a stale generation, a forged region or another layout is refused
before any page is read), and queues the read. One progress thread per
engine submits each read as Mooncake batches of at most 1024 requests (the
TCP transport's per-peer queue) of at most 1 MiB and waits for each batch in
``get_batch_transfer_status`` (which releases the GIL); the future resolves
from that thread. Timeout and cancel are checked between batches.

Bounce buffers (``bounce=True``, the default): each batch (at most
BOUNCE_BYTES) lands in one of two registered buffers of the engine, not in
the cache; only once Mooncake reports the batch complete are its bytes copied
into the cache's pages (while the next batch is in flight), and a read's last
batch only after the epoch check that ends it. So nothing lands in the cache
after a read failed, was cancelled or found stale, and a read of one batch
that fails leaves the cache as it was. Batches of 4 MiB keep the copy beside
the transfer: bench/python_bench.py --cases mooncake-bounce measured bounce /
direct at about 1.0 (medians 1.24 for 8 MiB reads and 0.99 for 128 MiB ones,
on a loaded 2-core machine; 32 MiB batches cost about 20%, the copy of a
whole read's last batch exposed). ``bounce=False`` reads straight into the
cache (see Faults).

Faults: a killed peer fails its requests at once (its sockets reset): the
read fails with PeerFailureError. A peer that hangs with its connections open
is bounded by Mooncake's own timeout in ``get_batch_transfer_status``
(MC_TRANSFER_TIMEOUT, 30 s by default, at least 5 s) rather than this
engine's; the wheel then gives up on the batch without a way to withdraw
requests still queued, so a hung peer that later resumes (a partition that
heals) can still write where the batch pointed. The engine marks such a peer
failed and refuses further reads from it. With bounce buffers that is the
bounce buffer: the engine takes it out of use and never frees it (the
module's _QUARANTINE keeps it, at most BOUNCE_BYTES per failed batch), so the
late bytes land in memory nobody reads. With ``bounce=False`` they land in
the read's destination pages of the cache. (The C++ engine destroys its own
Mooncake engine instead; the application's wheel object is not ours to
destroy.)

Page epochs (never the wrong KV): the owner also registers its cache's page
epoch table and names it in the descriptor (``epochs_ptr``). A read of a
SequenceInfo's descriptor (epoch != 0) fetches the epochs of its pages from
the owner before the first batch and again after the last one, and fails
with StaleDescriptorError if any page no longer carries the sequence's epoch
(freed, expired or reused), so a reader never reports another request's KV.

Layer-wise streaming (mstar_kv.streaming) by bounded polling: the owner also
registers its layer readiness words (``ready_ptr``); watch_layers returns a
watch that reads the epochs, the words and the epochs again of the read's
pages at most every READY_POLL_INTERVAL seconds (the seqlock of
readiness.hpp: a page that changed owner is StaleDescriptorError, a word beyond
the layer count or going backwards CorruptDescriptorError, an owner that no
longer answers PeerFailureError). KVTransferManager.start_streaming_retrieve
drives it with the library's one stream driver. The words are read and
checked as the C++ engine over Mooncake's C library does (mooncake_words.hpp,
bound as _core._MooncakeEpochWords and _MooncakeWatchWords): no numpy.

Thread safety: every method is safe from any thread. ``shutdown()`` fails
reads not yet started (ShutdownError), waits for the batch in flight,
joins the progress thread and unregisters the memory; idempotent. The
application keeps owning ``transfer_engine``.
"""
from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import threading
import time
from typing import Any, Optional

from . import _core
from .errors import (
    InvalidArgumentError,
    PeerFailureError,
    ShutdownError,
    TransferTimeoutError,
    UnavailableError,
)
from .mooncake_engines import MooncakeKVTransferEngine

MooncakeKVTransferInfo = _core.MooncakeKVTransferInfo
_IDENTITY_BYTES = 4096
_MAX_REQUEST_BYTES = 1 << 20
_WINDOW = 1024
# The bytes of one batch when reads land through bounce buffers (each of the
# engine's two is at most this big): small, so that copying one batch into
# the cache overlaps the next batch's transfer and the last one's is short.
BOUNCE_BYTES = 4 << 20

# Bounce buffers of batches Mooncake gave up on: the wheel cannot withdraw
# their requests, so its transport may still write into them. Kept for the
# life of the process, never reused.
_QUARANTINE: list = []


# How often a streaming reader's watch reads the owner's readiness words (the
# stream driver polls more often and gets the last answer in between): a
# remote poll is three small synchronous reads, about a round trip each.
READY_POLL_INTERVAL = 0.0005


class _LayerWatch:
    """The wheel engine's LayerWatch (readiness.hpp): bounded polls of the
    owner's epochs and readiness words of ``pages``, into one registered
    scratch buffer, checked as check_layer_readiness checks them."""

    def __init__(self, engine: "MooncakeWheelKVTransferEngine", remote, pages, epoch: int):
        self._engine = engine
        self._session = remote.session_id
        self._layers = remote.layout.num_layers
        # The C++ engine's reads and checks (mooncake_words.hpp): the words of
        # the pages in runs, each phase into its own part of the buffer.
        self._words = _core._MooncakeWatchWords(pages, epoch, self._layers)
        self._buf = ctypes.create_string_buffer(self._words.nbytes)
        engine._register(self._buf)
        base = ctypes.addressof(self._buf)
        self._phases = [_requests(base, table, self._words.reads(phase))
                        for phase, table in ((0, remote.epochs_ptr), (1, remote.ready_ptr),
                                             (2, remote.epochs_ptr))]
        self._floor = 0
        self._next = 0.0

    def poll(self) -> int:
        now = time.monotonic()
        if now < self._next:
            return self._floor
        self._next = now + READY_POLL_INTERVAL
        for local, remote, lengths in self._phases:  # one after the other: the seqlock's order
            if self._engine._te.batch_transfer_sync_read(self._session, local, remote,
                                                         lengths) < 0:
                raise PeerFailureError(
                    f"Mooncake read of the layer readiness of {self._session} failed with "
                    f"{self._floor} of {self._layers} layers seen ready: the owner is gone")
        self._floor = self._words.check(self._buf.raw, self._floor)
        return self._floor

    def close(self) -> None:
        buf, self._buf = getattr(self, "_buf", None), None
        if buf is not None:
            self._engine._release(buf)

    def __del__(self):
        # The stream driver closes its watch; a registered buffer must never
        # be freed while Mooncake still knows it.
        try:
            self.close()
        except Exception:
            pass


def _requests(base: int, table: int, spans):
    """Mooncake's request lists for word reads: (scratch offset, offset in
    the owner's table, length) spans into local and remote addresses."""
    return ([base + local for local, _, _ in spans], [table + remote for _, remote, _ in spans],
            [length for _, _, length in spans])


def _epoch_of(obj: Any) -> int:
    """The page epoch a descriptor carries (0: a cache's own, unchecked)."""
    if isinstance(obj, (bytes, bytearray)):
        obj = _core.KVTransferInfo.from_bytes(bytes(obj))
    return obj.epoch if isinstance(obj, _core.KVTransferInfo) else 0


def _as_transfer_info(obj: Any):
    if isinstance(obj, MooncakeKVTransferInfo):
        return obj
    if isinstance(obj, (bytes, bytearray)):
        obj = _core.KVTransferInfo.from_bytes(bytes(obj))
    if isinstance(obj, _core.KVTransferInfo):
        return MooncakeKVTransferInfo.decode(obj)
    raise InvalidArgumentError(
        f"remote_kv_info of type {type(obj).__name__} is not a Mooncake descriptor")


def _batches(lengths, max_bytes):
    """[(first, end, bytes)]: runs of at most _WINDOW requests and, past
    their first request, at most max_bytes (None: no bound)."""
    out, i, n = [], 0, len(lengths)
    while i < n:
        j, size = i, 0
        while j < n and j - i < _WINDOW and (
                max_bytes is None or j == i or size + lengths[j] <= max_bytes):
            size += lengths[j]
            j += 1
        out.append((i, j, size))
        i = j
    return out


class _Read:
    __slots__ = ("future", "session", "local", "remote", "lengths", "batches", "deadline",
                 "cancel", "nbytes", "epoch", "words", "epochs_ptr")

    def __init__(self, future, session, local, remote, lengths, deadline, max_batch_bytes):
        self.future = future
        self.session = session
        self.local, self.remote, self.lengths = local, remote, lengths
        self.batches = _batches(lengths, max_batch_bytes)
        self.deadline = deadline
        self.cancel = threading.Event()
        self.nbytes = sum(lengths)
        self.epoch = 0          # != 0: check `words` in the owner's table at epochs_ptr
        self.words = None       # _core._MooncakeEpochWords of the read's pages
        self.epochs_ptr = 0


class _MooncakeFuture(concurrent.futures.Future):
    """Pending until the progress thread resolves it; cancel() asks the
    progress thread to stop between batches and waits for the outcome."""

    def __init__(self):
        super().__init__()
        self._read: Optional[_Read] = None

    def cancel(self) -> bool:
        if self.done():
            return self.cancelled()
        if self._read is not None:
            self._read.cancel.set()
        try:
            self.exception()  # waits until the progress thread resolved it
        except concurrent.futures.CancelledError:
            pass
        return self.cancelled()


class MooncakeWheelKVTransferEngine(MooncakeKVTransferEngine):
    """See the module docstring."""

    def __init__(self, kv_cache, entity_id: str, transfer_engine: Any, *,
                 timeout: float = 30.0, session_id: Optional[str] = None,
                 hostname: str = "127.0.0.1", bounce: bool = True,
                 options: Optional[dict] = None):
        self.kv_cache = kv_cache
        self.entity_id = entity_id
        if transfer_engine is None:
            raise InvalidArgumentError(
                "MooncakeWheelKVTransferEngine needs the application's mooncake.engine."
                "TransferEngine; without one use MooncakeNativeKVTransferEngine (Mooncake's C "
                "library), which MooncakeKVTransferEngine(kv_cache, entity_id, None) picks")
        for name in ("register_memory", "batch_transfer_async_read",
                     "get_batch_transfer_status", "transfer_sync_read", "get_rpc_port"):
            if not hasattr(transfer_engine, name):
                raise InvalidArgumentError(
                    f"transfer_engine of type {type(transfer_engine).__name__} has no "
                    f"'{name}': pass a mooncake.engine.TransferEngine (initialised) or None")
        if kv_cache.memory == "device":
            raise InvalidArgumentError("the Mooncake engine reads host memory; this cache is "
                                       "device memory (use memory='host' or 'shared')")
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout {timeout} s out of range (0, ...)")
        self._te = transfer_engine
        self._timeout = float(timeout)
        self._bounce = bool(bounce)
        self._bounces = [None, None]  # the two bounce buffers (progress thread only)
        port = transfer_engine.get_rpc_port()
        self.session_id = session_id or f"{hostname}:{port}"
        self._identity = ctypes.create_string_buffer(_IDENTITY_BYTES)
        self._scratch = ctypes.create_string_buffer(_IDENTITY_BYTES)
        self._regions = []
        self._epoch_scratch = None   # registered buffer the owner's epochs land in
        # The cache's regions: one, or one per layer (KVCache.from_layer_tensors),
        # each registered; the descriptor names the layers' addresses.
        cache_regions = list(kv_cache.regions)
        self._local_base = cache_regions[0][0]
        self._local_regions = [a for a, _ in cache_regions] if len(cache_regions) > 1 else []
        try:
            for addr, size in (*cache_regions,
                               (ctypes.addressof(self._identity), _IDENTITY_BYTES),
                               (ctypes.addressof(self._scratch), _IDENTITY_BYTES),
                               (kv_cache.epochs_ptr, kv_cache.epochs_bytes),
                               (kv_cache.ready_ptr, kv_cache.ready_bytes)):
                if transfer_engine.register_memory(addr, size, "cpu:0") != 0:
                    raise UnavailableError(
                        f"Mooncake register_memory of {size} bytes at {addr:#x} failed "
                        "(is the TransferEngine initialised?)")
                self._regions.append(addr)
            self._info = MooncakeKVTransferInfo(
                entity_id, self.session_id, self._local_base, kv_cache.layout,
                kv_cache.size_bytes, _core._mooncake_new_generation(),
                ctypes.addressof(self._identity), kv_cache.epochs_ptr, kv_cache.ready_ptr,
                self._local_regions)
            page = _core._mooncake_identity_page(self._info)
            ctypes.memmove(self._identity, page, len(page))
        except BaseException:
            self._unregister()
            raise
        self._lock = threading.Condition()
        self._verify_lock = threading.Lock()
        self._queue: "collections.deque[_Read]" = collections.deque()
        self._verified = set()       # (session, generation) checked against the owner
        self._failed_peers = {}      # session -> why
        self._closed = False
        self._thread = threading.Thread(target=self._progress, name="mstar-kv-mooncake",
                                        daemon=True)
        self._thread.start()

    @property
    def timeout(self) -> float:
        """Seconds a read may take (also a stream's default ready timeout)."""
        return self._timeout

    # -- the spec's interface --------------------------------------------
    def get_kv_transfer_info(self):
        return self._info.encode()

    def remote_layout(self, remote_kv_info):
        return _as_transfer_info(remote_kv_info).layout

    def read_batched_async(self, remote_kv_info, read_info):
        if self._closed:
            raise ShutdownError("MooncakeWheelKVTransferEngine.read_batched_async after shutdown()")
        epoch = _epoch_of(remote_kv_info)
        remote = _as_transfer_info(remote_kv_info)
        local, remote_addrs, lengths = _core.plan_copy_addresses(
            self.kv_cache.layout, self._local_base, remote.layout, remote.data_ptr,
            list(read_info), _MAX_REQUEST_BYTES, self._local_regions, list(remote.layer_regions))
        why = self._failed_peers.get(remote.session_id)
        if why is not None:
            raise PeerFailureError(f"peer '{remote.entity_id}' at {remote.session_id} failed "
                                   f"earlier ({why}); reconnect with a new engine")
        self._verify(remote)
        if not lengths:
            return None
        future = _MooncakeFuture()
        read = _Read(future, remote.session_id, local, remote_addrs, lengths,
                     time.monotonic() + self._timeout, BOUNCE_BYTES if self._bounce else None)
        future._read = read
        if epoch:
            read.epoch = epoch
            read.words = _core._MooncakeEpochWords([r.remote_page_idx for r in read_info], epoch)
            read.epochs_ptr = remote.epochs_ptr
        with self._lock:
            if self._closed:
                raise ShutdownError("MooncakeWheelKVTransferEngine.read_batched_async after shutdown()")
            self._queue.append(read)
            self._lock.notify()
        return future

    def watch_layers(self, remote_kv_info, read_info):
        """Layer-wise streaming (mstar_kv.streaming), by bounded polling: a
        watch whose poll() reads the owner's registered page epochs and layer
        readiness words of the read's pages (epochs, words, epochs again: the
        seqlock of readiness.hpp) at most once per ``READY_POLL_INTERVAL``
        seconds and returns how many layers are ready on every page. Validates
        as read_batched_async does, and raises InvalidArgumentError for a
        descriptor without a page epoch."""
        if self._closed:
            raise ShutdownError("MooncakeWheelKVTransferEngine.watch_layers after shutdown()")
        read_info = list(read_info)
        if not read_info:
            raise InvalidArgumentError("mooncake layer watch of 0 reads: nothing to watch")
        epoch = _epoch_of(remote_kv_info)
        remote = _as_transfer_info(remote_kv_info)
        _core.plan_copy_addresses(self.kv_cache.layout, self._local_base, remote.layout,
                                  remote.data_ptr, read_info, _MAX_REQUEST_BYTES,
                                  self._local_regions, list(remote.layer_regions))
        if not epoch:
            raise InvalidArgumentError("layer-wise streaming needs a descriptor with a page epoch "
                                       "(published by a KVCachePool), got epoch 0")
        why = self._failed_peers.get(remote.session_id)
        if why is not None:
            raise PeerFailureError(f"peer '{remote.entity_id}' at {remote.session_id} failed "
                                   f"earlier ({why}); reconnect with a new engine")
        self._verify(remote)
        watch = _LayerWatch(self, remote, sorted({r.remote_page_idx for r in read_info}), epoch)
        try:
            watch.poll()  # the pages still carry the sequence's epoch, the owner answers
        except BaseException:
            watch.close()  # its scratch must leave Mooncake's registry before it is freed
            raise
        return watch

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._queue)
            self._queue.clear()
            self._lock.notify_all()
        for r in pending:
            r.future.set_exception(ShutdownError("the Mooncake engine shut down before the "
                                                 "read started"))
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._unregister()

    # -- internals ----------------------------------------------------------
    def _verify(self, remote) -> None:
        key = (remote.session_id, remote.generation)
        if key in self._verified:
            return
        with self._verify_lock:  # one identity read at a time (one scratch page)
            if key in self._verified:
                return
            rc = self._te.transfer_sync_read(remote.session_id, ctypes.addressof(self._scratch),
                                             remote.identity_ptr, _IDENTITY_BYTES)
            if rc < 0:
                raise PeerFailureError(
                    f"peer '{remote.entity_id}' at {remote.session_id} did not serve the "
                    f"descriptor's identity page {remote.identity_ptr:#x}: the owner is gone, "
                    "or the descriptor is stale or forged")
            _core._mooncake_verify_identity(self._scratch.raw, remote)
            self._verified.add(key)

    def _progress(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:
                    return
                read = self._queue.popleft()
            self._run(read)

    def _check_epochs(self, read: _Read, when: str) -> None:
        """Fetches the owner's epochs of the read's pages (in runs, as the C++
        engine does); raises StaleDescriptorError if one changed owner."""
        nbytes = read.words.nbytes
        scratch = self._epoch_scratch
        if scratch is None or len(scratch) < nbytes:
            if scratch is not None:
                self._te.unregister_memory(ctypes.addressof(scratch))
                self._regions.remove(ctypes.addressof(scratch))
                self._epoch_scratch = None
            scratch = ctypes.create_string_buffer(max(nbytes, 4096))
            if self._te.register_memory(ctypes.addressof(scratch), len(scratch), "cpu:0") != 0:
                raise UnavailableError("Mooncake register_memory of the epoch scratch failed")
            self._regions.append(ctypes.addressof(scratch))
            self._epoch_scratch = scratch
        local, remote, lengths = _requests(ctypes.addressof(scratch), read.epochs_ptr,
                                           read.words.reads)
        if self._te.batch_transfer_sync_read(read.session, local, remote, lengths) < 0:
            raise self._peer_failed(read, "reading the owner's page epochs failed")
        read.words.check(scratch.raw, when)

    def _run(self, read: _Read) -> None:
        n = len(read.lengths)
        try:
            if read.epoch:
                self._check_epochs(read, "before the copy")
            held = None  # (first, end, bounce slot): a batch read, not yet in the cache
            for k, (i, j, size) in enumerate(read.batches):
                if read.cancel.is_set():
                    concurrent.futures.Future.cancel(read.future)
                    read.future.set_running_or_notify_cancel()
                    return
                if time.monotonic() > read.deadline:
                    raise TransferTimeoutError(
                        f"read of {n} requests from {read.session} did not finish in "
                        f"{self._timeout:g} s")
                if self._closed:
                    raise ShutdownError("the Mooncake engine shut down with the read in flight")
                if self._bounce:
                    local = self._bounce_addresses(k % 2, read.lengths[i:j], size)
                else:
                    local = read.local[i:j]
                bid = self._te.batch_transfer_async_read(read.session, local, read.remote[i:j],
                                                         read.lengths[i:j])
                if bid <= 0:
                    raise self._peer_failed(read, "batch_transfer_async_read refused the batch")
                if held is not None:  # the batch before, copied while this one moves
                    self._land(read, *held)
                    held = None
                if self._te.get_batch_transfer_status([bid]) != 0:
                    if self._bounce:
                        self._quarantine(k % 2)
                    raise self._peer_failed(read, f"requests {i}..{j - 1} failed")
                if self._bounce:
                    held = (i, j, k % 2)
            if read.epoch:
                self._check_epochs(read, "during the copy")
            if held is not None:
                self._land(read, *held)
        except BaseException as e:  # resolve with what happened, never leave it pending
            read.future.set_exception(e)
            return
        read.future.set_result(read.nbytes)

    def _bounce_addresses(self, slot: int, lengths, size: int):
        """Where the batch's requests land in bounce buffer `slot` (made or
        grown to hold `size` bytes, and registered)."""
        buf = self._bounces[slot]
        if buf is None or len(buf) < size:
            if buf is not None:
                self._bounces[slot] = None
                self._release(buf)
            cap = 1 << 16
            while cap < size:
                cap <<= 1
            buf = ctypes.create_string_buffer(cap)
            self._register(buf)
            self._bounces[slot] = buf
        at, out = ctypes.addressof(buf), []
        for length in lengths:
            out.append(at)
            at += length
        return out

    def _land(self, read: _Read, first: int, end: int, slot: int) -> None:
        """Copies a completed batch from its bounce buffer into the cache."""
        at = ctypes.addressof(self._bounces[slot])
        for dst, length in zip(read.local[first:end], read.lengths[first:end]):
            ctypes.memmove(dst, at, length)
            at += length

    def _quarantine(self, slot: int) -> None:
        """A batch Mooncake gave up on may still write into its bounce
        buffer: out of use for good (shutdown unregisters it; never freed)."""
        buf, self._bounces[slot] = self._bounces[slot], None
        if buf is not None:
            _QUARANTINE.append(buf)

    def _peer_failed(self, read: _Read, what: str) -> PeerFailureError:
        self._failed_peers[read.session] = what
        return PeerFailureError(f"Mooncake read from {read.session} failed: {what}")

    def _unregister(self) -> None:
        lock = getattr(self, "_lock", None)  # none yet when __init__ fails
        if lock is not None:
            with lock:
                regions, self._regions = self._regions, []
        else:
            regions, self._regions = self._regions, []
        for addr in regions:
            try:
                self._te.unregister_memory(addr)
            except Exception:
                pass

    def _register(self, buf) -> None:
        if self._te.register_memory(ctypes.addressof(buf), len(buf), "cpu:0") != 0:
            raise UnavailableError(f"Mooncake register_memory of a {len(buf)}-byte scratch failed")
        with self._lock:
            self._regions.append(ctypes.addressof(buf))

    def _release(self, buf) -> None:
        addr = ctypes.addressof(buf)
        with self._lock:
            if addr not in self._regions:  # shutdown unregistered it already
                return
            self._regions.remove(addr)
        self._te.unregister_memory(addr)

    def __repr__(self) -> str:
        return f"MooncakeWheelKVTransferEngine({self.entity_id!r}, {self.kv_cache!r})"
