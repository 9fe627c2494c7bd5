"""Futures: completed by the engine, cancel reaches the engine, asyncio,
the GIL released during long reads, KeyboardInterrupt, and a Python
subclass of KVTransferEngine driven by the manager."""
import asyncio
import concurrent.futures
import subprocess
import sys
import threading
import time

import mstar_kv as kv
import numpy as np
import pytest
from conftest import local_layout


def shm_pair(layout, max_workers=1):
    """A shared source cache with the pattern and a private destination."""
    src = kv.KVCache(layout, "shared")
    pages = list(range(layout.num_pages))
    src.fill_pattern(99, pages, 0, layout.num_pages * layout.page_size)
    src_engine = kv.ShmKVTransferEngine(src)
    dst = kv.KVCache(layout)
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("d", "", "shm",
                                                     {"max_workers": max_workers}), dst)
    return src, src_engine, dst, mgr, pages


def test_future_is_a_concurrent_future_resolved_by_the_engine():
    layout = local_layout(num_pages=256)  # 8 MiB: copied by the engine's worker
    src, src_engine, dst, mgr, pages = shm_pair(layout)
    threads = threading.active_count()
    f = mgr.start_async_retrieve(0, 256 * 16, pages, pages, src_engine.get_kv_transfer_info())
    assert isinstance(f, concurrent.futures.Future)
    assert threading.active_count() == threads  # no Python thread per read
    seen = []
    f.add_done_callback(lambda fut: seen.append(fut.result()))
    done, _ = concurrent.futures.wait([f], timeout=30)
    assert f in done and f.result() == layout.total_bytes
    assert seen == [layout.total_bytes]
    assert dst.verify_pattern(99, pages, 0, 256 * 16)["ok"]


def test_asyncio_wrap_future():
    layout = local_layout(num_pages=64)
    src, src_engine, dst, mgr, pages = shm_pair(layout)
    info = src_engine.get_kv_transfer_info()

    async def pull_all():
        futs = [asyncio.wrap_future(mgr.start_async_retrieve(0, 16 * 16, pages[i:i + 16],
                                                             pages[i:i + 16], info))
                for i in range(0, 64, 16)]
        return await asyncio.gather(*futs)

    assert asyncio.run(pull_all()) == [layout.total_bytes // 4] * 4
    assert dst.verify_pattern(99, pages, 0, 64 * 16)["ok"]


def test_failed_read_raises_the_code_subclass():
    layout = local_layout(num_pages=64)
    src, src_engine, dst, mgr, pages = shm_pair(layout)
    info = src_engine.get_kv_transfer_info()
    dropped = kv.FaultInjectingKVTransferEngine(mgr.engine, drop=True, drop_timeout=0.2)
    m2 = kv.KVTransferManager(dropped, dst)
    f = m2.start_async_retrieve(0, 64, pages[:4], pages[:4], info)
    with pytest.raises(kv.TransferTimeoutError):
        f.result(timeout=30)
    assert isinstance(f.exception(), TimeoutError)


def test_cancel_reaches_the_engine_and_no_byte_lands_after():
    layout = local_layout(num_pages=64)
    src, src_engine, dst, mgr, pages = shm_pair(layout)
    slow = kv.FaultInjectingKVTransferEngine(mgr.engine, delay=5.0)
    m2 = kv.KVTransferManager(slow, dst)
    raw = dst.numpy().view(np.uint8).reshape(-1)
    raw[:] = 0x33
    f = m2.start_async_retrieve(0, 64 * 16, pages, pages, src_engine.get_kv_transfer_info())
    t0 = time.monotonic()
    assert f.cancel() is True
    assert time.monotonic() - t0 < 3  # did not wait out the 5 s delay
    assert f.cancelled() and f.done()
    with pytest.raises(concurrent.futures.CancelledError):
        f.result()
    time.sleep(0.3)
    assert np.all(raw == 0x33)  # nothing landed after the future resolved
    assert f.cancel() is True  # idempotent


def test_gil_released_during_a_long_read():
    """Another Python thread keeps running while one thread pulls 256 MiB."""
    layout = local_layout(num_pages=8192, num_kv_heads=2, head_dim=128)  # 256 MiB
    src, src_engine, dst, mgr, pages = shm_pair(layout, max_workers=1)
    info = src_engine.get_kv_transfer_info()
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=spin)
    t.start()
    try:
        time.sleep(0.2)
        c0, t0 = count[0], time.monotonic()
        time.sleep(0.3)
        free_rate = (count[0] - c0) / (time.monotonic() - t0)
        # The pull runs on this thread (wait in result()) and the engine's worker.
        c0, t0 = count[0], time.monotonic()
        n = mgr.sync_retrieve(0, 8192 * 16, pages, pages, info)
        elapsed = time.monotonic() - t0
        rate = (count[0] - c0) / elapsed
        # A native call on this thread (checksumming 256 MiB) releases the GIL too.
        c0, t0 = count[0], time.monotonic()
        assert dst.verify_pattern(99, pages, 0, 8192 * 16)["ok"]
        verify_elapsed = time.monotonic() - t0
        verify_rate = (count[0] - c0) / verify_elapsed
    finally:
        stop.set()
        t.join()
    print(f"spinner during a {verify_elapsed * 1000:.0f} ms verify: {verify_rate:.0f}/s")
    assert verify_rate > 0.2 * free_rate, (verify_rate, free_rate)
    assert n == layout.total_bytes
    print(f"spinner: {free_rate:.0f}/s alone, {rate:.0f}/s during a {elapsed * 1000:.0f} ms "
          f"pull ({rate / free_rate:.2f})")
    assert rate > 0.2 * free_rate, (rate, free_rate)


def test_future_outlives_its_manager():
    layout = local_layout(num_pages=64)
    src, src_engine, dst, mgr, pages = shm_pair(layout)
    slow = kv.FaultInjectingKVTransferEngine(mgr.engine, delay=2.0)
    m2 = kv.KVTransferManager(kv.TransferEngineInfo("d", "", slow), dst)
    f = m2.start_async_retrieve(0, 64, pages[:4], pages[:4], src_engine.get_kv_transfer_info())
    m2.cleanup()
    del m2, slow
    with pytest.raises(kv.ShutdownError):
        f.result(timeout=30)


def test_keyboard_interrupt_cancels_the_read():
    code = r'''
import os, signal, threading, time, sys
# A background job of a non-interactive shell inherits SIGINT ignored, and
# Python then installs no KeyboardInterrupt handler: install it, as a
# terminal's Python has it.
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy as np
import mstar_kv as kv
layout = kv.KVLayout(4, 64, 16, 2, 64)
src = kv.KVCache(layout, "shared"); src.fill_pattern(1, list(range(64)), 0, 1024)
info = kv.ShmKVTransferEngine(src).get_kv_transfer_info()
dst = kv.KVCache(layout); raw = dst.numpy().view(np.uint8).reshape(-1); raw[:] = 0x44
inner = kv.ShmKVTransferEngine(dst)
mgr = kv.KVTransferManager(kv.FaultInjectingKVTransferEngine(inner, delay=10.0), dst)
threads = threading.active_count()
threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
t0 = time.monotonic()
try:
    mgr.sync_retrieve(0, 1024, list(range(64)), list(range(64)), info)
    print("NO INTERRUPT"); sys.exit(1)
except KeyboardInterrupt:
    pass
elapsed = time.monotonic() - t0
time.sleep(0.3)
assert np.all(raw == 0x44), "bytes landed after the interrupt"
assert threading.active_count() <= threads, threading.enumerate()
mgr.cleanup()
print(f"INTERRUPTED {elapsed:.2f}")
'''
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    line = [l for l in r.stdout.splitlines() if l.startswith("INTERRUPTED")][0]
    assert float(line.split()[1]) < 3.0


class CopyEngine(kv.KVTransferEngine):
    """A Python engine: copies from a source cache in the same process with
    numpy, on a Python thread pool, to show the manager drives subclasses."""

    def __init__(self, kv_cache, registry):
        self.kv_cache = kv_cache
        self.registry = registry
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.calls = []

    def get_kv_transfer_info(self):
        return {"name": "copy", "key": id(self.kv_cache)}

    def read_batched_async(self, remote_kv_info, read_info):
        self.calls.append((remote_kv_info, list(read_info)))
        remote = self.registry[remote_kv_info["key"]]
        local_addrs, remote_addrs, lengths = kv.plan_copy_addresses(
            self.kv_cache.layout, 0, remote.layout, 0, read_info)

        def run():
            dst = self.kv_cache.numpy().view(np.uint8).reshape(-1)
            src = remote.numpy().view(np.uint8).reshape(-1)
            for l, r, n in zip(local_addrs, remote_addrs, lengths):
                dst[l:l + n] = src[r:r + n]
            return sum(lengths)

        return self.pool.submit(run)

    def shutdown(self):
        self.pool.shutdown(wait=True)


def test_python_subclass_driven_by_the_manager():
    layout = local_layout(num_pages=16)
    src = kv.KVCache(layout)
    src.fill_pattern(5, [3, 1, 4], 0, 40)
    dst = kv.KVCache(layout)
    registry = {}
    src_engine = CopyEngine(src, registry)
    registry[id(src)] = src
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("d", "", CopyEngine(dst, registry)), dst)
    f = mgr.start_async_retrieve(0, 40, [7, 8, 9], [3, 1, 4], src_engine.get_kv_transfer_info())
    assert f.result(timeout=30) == layout.num_layers * 2 * 40 * layout.token_bytes
    assert dst.verify_pattern(5, [7, 8, 9], 0, 40)["ok"]
    info, reads = mgr.engine.calls[0]
    assert info == {"name": "copy", "key": id(src)}  # passed through unchanged
    assert reads[0] == kv.KVReadInfo(0, 7, 3, 0, 16)
    assert reads[-1] == kv.KVReadInfo(layout.num_layers - 1, 9, 4, 0, 8)  # clipped last page
    assert mgr.start_async_retrieve(40, 40, [7, 8, 9], [3, 1, 4], info) is None
    _pool = kv.KVCachePool(dst, kv.KVTransferInfo("copy", b""))
    mgr.cleanup()
