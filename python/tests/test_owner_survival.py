"""The owner survives any reader, for the Mooncake wheel's owner
(peer.py over the PyPI wheel's TransferEngine), with real processes: readers
that start eight pulls of a 64 MiB sequence and then are SIGKILLed mid-read,
are SIGSTOPped and never take their replies, call cleanup() or drop their
manager and engine with the reads in flight, or _exit right after starting.
After each the owner must still run and a fresh reader must pull every byte.
(The C++ engines: tests/reliability/owner_survival_test.cpp.)"""
import os
import signal
import subprocess
import sys
import time

import mstar_kv as kv
import pytest
from conftest import HERE, SEED, local_layout

pytest.importorskip("mooncake.engine", reason="the Mooncake wheel (mooncake-transfer-engine-"
                                              "non-cuda) is not installed")

# The owner holds two such sequences (peer.py); each reader pulls one: 64 MiB.
BIG = dict(num_pages=256, num_kv_heads=8, head_dim=128)  # 4 layers, 256 KiB pages
BIG_ARGS = ["--pages", "512", "--heads", "8", "--head-dim", "128", "--layers", "4",
            "--tokens", str(16 * 256)]

READER = r"""
import os, sys, time
import mstar_kv as kv
from mooncake.engine import TransferEngine
what, hexseq = sys.argv[1], sys.argv[2]
seq = kv.SequenceInfo.from_bytes(bytes.fromhex(hexseq))
layout = kv.KVLayout(4, 256, 16, 8, 128, dtype="bf16")
cache = kv.KVCache(layout)
raw = cache.numpy().view("uint8").reshape(-1)
raw[:] = 0xA5
te = TransferEngine()
assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
engine = kv.MooncakeKVTransferEngine(cache, "doomed", te, timeout=20.0)
mgr = kv.KVTransferManager(engine, cache)
local = list(range(len(seq.page_indices)))
kept = []
for i in range(8):
    f = mgr.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                 seq.kv_transfer_info)
    if i % 2 == 0:
        kept.append(f)
if what == "vanish":
    os._exit(0)
end = time.monotonic() + 5
while time.monotonic() < end and (raw[::4096] == 0xA5).all():
    time.sleep(0.0002)
print("STARTED", flush=True)
if what in ("kill", "stall"):
    while True:
        time.sleep(1)
if what == "cleanup":
    mgr.cleanup()
elif what == "destroy":
    del mgr, kept
    engine.shutdown()
    del engine, te
print("DONE", flush=True)
"""


def fresh_pull(seq, after):
    cache = kv.KVCache(local_layout(**BIG))
    te = pytest.importorskip("mooncake.engine").TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    engine = kv.MooncakeKVTransferEngine(cache, "fresh", te, timeout=20.0)
    mgr = kv.KVTransferManager(engine, cache)
    local = list(range(len(seq.page_indices)))
    t0 = time.monotonic()
    assert mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices,
                             seq.kv_transfer_info) == cache.size_bytes, after
    assert time.monotonic() - t0 < 20, after
    assert cache.verify_pattern(SEED + 1, local, 0, seq.num_tokens)["ok"], after
    mgr.cleanup()


def wait_line(proc, want, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            return False
        if line.strip() == want:
            return True
    return False


def test_wheel_owner_serves_a_fresh_reader_after_every_reader_that_goes_away_badly(
        peer_factory):
    owner = peer_factory("mooncake", *BIG_ARGS)
    seq = owner.seqs[0]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), HERE]))
    for what in ("kill", "stall", "cleanup", "destroy", "vanish"):
        after = f"a reader that did {what!r}"
        reader = subprocess.Popen([sys.executable, "-c", READER, what, seq.to_bytes().hex()],
                                  stdout=subprocess.PIPE, text=True, env=env)
        try:
            if what != "vanish":
                assert wait_line(reader, "STARTED"), after
            if what == "kill":
                reader.send_signal(signal.SIGKILL)
            elif what == "stall":
                reader.send_signal(signal.SIGSTOP)
            elif what in ("cleanup", "destroy"):
                assert wait_line(reader, "DONE"), after
            if what != "stall":
                rc = reader.wait(timeout=60)
                assert rc == (-signal.SIGKILL if what == "kill" else 0), (after, rc)
            assert owner.proc.poll() is None, f"the owner died after {after}"
            fresh_pull(seq, after)  # a stalled reader is still stopped meanwhile
            assert owner.proc.poll() is None, f"the owner died after {after}"
        finally:
            if reader.poll() is None:
                reader.send_signal(signal.SIGKILL)
                reader.wait()
            reader.stdout.close()
    owner.proc.stdin.write("quit\n")
    owner.proc.stdin.flush()
    assert owner.proc.wait(timeout=30) == 0, "the owner did not quit cleanly"
