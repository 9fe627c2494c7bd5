"""Shared helpers: real peer processes (peer.py) and the test geometry."""
import os
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs through glog

import mstar_kv as kv

HERE = os.path.dirname(os.path.abspath(__file__))
SEED = 1234  # peer.py's

# The geometry peer.py uses by default.
LAYOUT_ARGS = dict(num_layers=4, num_pages=64, page_size=16, num_kv_heads=2, head_dim=64,
                   dtype="bf16")
TOKENS = 100


def local_layout(**kw):
    args = dict(LAYOUT_ARGS)
    args.update(kw)
    return kv.KVLayout(**args)


class LineProcess:
    """A child process driven one line at a time: a command on its stdin, a
    one-line answer on its stdout; `quit` ends it, SIGKILL if it does not."""

    proc: subprocess.Popen

    def command(self, cmd):
        """Sends one command and returns its one-line answer."""
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except Exception:
                self.kill()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except Exception:
                pass


class Peer(LineProcess):
    """A prefill process (peer.py) publishing sequences 1 and 2."""

    def __init__(self, engine, *args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [e.get("PYTHONPATH"), HERE]))
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "peer.py"), engine,
                                      *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=e)
        self.seqs = self._ready()

    def _ready(self, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peer exited with {self.proc.wait()} before READY")
            if line.startswith("READY"):
                return [kv.SequenceInfo.from_bytes(bytes.fromhex(h)) for h in line.split()[1:]]
        raise RuntimeError("peer not ready in time")

    def restart(self):
        self.proc.stdin.write("restart\n")
        self.proc.stdin.flush()
        self.seqs = self._ready()
        return self.seqs



@pytest.fixture
def peer_factory():
    peers = []

    def make(engine, *args, env=None):
        p = Peer(engine, *args, env=env)
        peers.append(p)
        return p

    yield make
    for p in peers:
        p.close()


def sentinel_fill(cache, value=0x5A):
    a = cache.numpy().view("uint8").reshape(-1)
    a[:] = value
    return a


def block_offset(layout, layer, kvi, page):
    """Byte offset of the block (layer, k|v, page) in each cache order
    (layout.hpp), computed here rather than asked of the library."""
    L, P, K = layout.num_layers, layout.num_pages, layout.num_kv
    index = {"layer": (layer * K + kvi) * P + page,
             "page": (page * L + layer) * K + kvi,
             "layer_page": (layer * P + page) * K + kvi}[layout.cache_order]
    return index * layout.block_bytes


def assert_only_pages_written(before, after, layout, written_pages):
    """Bytes outside the written local pages are unchanged."""
    import numpy as np
    b = before.reshape(-1)
    a = after.reshape(-1)
    mask = np.ones(b.size, dtype=bool)
    bb = layout.block_bytes
    for layer in range(layout.num_layers):
        for kvi in range(layout.num_kv):
            for page in written_pages:
                off = block_offset(layout, layer, kvi, page)
                mask[off:off + bb] = False
    assert np.array_equal(a[mask], b[mask]), "a page outside the read was written"


# Layer-wise streaming against peer.py's slow owner ("stream MS N"): the
# pattern its layers get, the sequence it publishes, and its marks.
STREAM_SEED = SEED + 1000


def start_stream(peer, ms, layers):
    answer = peer.command(f"stream {ms} {layers}")
    assert answer.startswith("STREAM "), answer
    return kv.SequenceInfo.from_bytes(bytes.fromhex(answer.split()[1]))


def read_marks(peer, n):
    seen = []
    while len(seen) < n:
        line = peer.proc.stdout.readline().strip()
        if line.startswith("MARKED "):
            seen.append(int(line.split()[1]))
    return seen


def check_layer_by_layer(stream, num_layers, nbytes, cache, local, num_tokens):
    """A stream from the slow owner: every layer arrives in order, the first
    well before the last (about `ms` apart, not all at the end), the read moves
    `nbytes`, and no poison was copied. Returns the arrival times."""
    assert stream.num_layers == num_layers
    t0 = time.monotonic()
    arrivals = []
    for layer in range(num_layers):
        assert stream.wait_for_layer(layer, timeout=10)
        arrivals.append(time.monotonic() - t0)
        assert stream.layers_done >= layer + 1
    assert stream.future.result(timeout=10) == nbytes
    assert arrivals[0] < arrivals[-1] - 0.3, arrivals
    assert cache.verify_pattern(STREAM_SEED, local, 0, num_tokens)["ok"], "poison was copied"
    return arrivals
