"""Mooncake's C library streams from Python: MooncakeNativeKVTransferEngine
(the C++ engine over the library MSTAR_KV_MOONCAKE_LIB names) through the one
manager, start_streaming_retrieve, layer by layer, every byte checked, from
an owner over the same C library and from one over the PyPI wheel. The
library is built from Mooncake's source by ./scripts/mooncake-check (which
runs these); without it every test here skips with the reason."""
import os
import subprocess
import sys
import time

import pytest
from conftest import HERE, read_marks, start_stream

pytestmark = pytest.mark.skipif(
    not os.environ.get("MSTAR_KV_MOONCAKE_LIB"),
    reason="MSTAR_KV_MOONCAKE_LIB names no Mooncake C library (built from Mooncake's source "
           "by ./scripts/mooncake-check; docs/engines/mooncake-check.md)")


def _wheel_installed():
    try:
        import mooncake.engine  # noqa: F401
    except ImportError:
        return False
    return True


class NativeReader:
    """mooncake_native_reader.py: a C-library reader in its own process."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), HERE]))
        self.proc = subprocess.Popen([sys.executable,
                                      os.path.join(HERE, "mooncake_native_reader.py")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        line = self.proc.stdout.readline().strip()
        assert line == "READY", f"reader: {line!r}, exit {self.proc.poll()}"

    def stream(self, seq):
        self.proc.stdin.write(f"stream {seq.to_bytes().hex()}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self):
        try:
            self.proc.stdin.close()
            assert self.proc.wait(timeout=30) == 0
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


@pytest.mark.parametrize("owner", [
    "mooncake-c",
    pytest.param("mooncake", marks=pytest.mark.skipif(
        not _wheel_installed(),
        reason="the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")),
])
def test_mooncake_c_library_streams_from_python(peer_factory, owner):
    # The owner's cache has 1024 pages, so the sequence's pages are scattered
    # and mostly >= 512: words read from the wrong place cannot pass.
    peer = peer_factory(owner, "--pages", "1024")
    reader = NativeReader()  # before the stream: the owner marks a layer every 150 ms
    try:
        seq = start_stream(peer, 150, 4)
        assert max(seq.page_indices) >= 512, seq.page_indices
        t0 = time.monotonic()
        answer = reader.stream(seq)
        assert answer.startswith("STREAMED "), answer
        nbytes, *arrivals = answer.split()[1:]
        assert int(nbytes) > 0
        assert len(arrivals) == 4
        assert read_marks(peer, 4) == [0, 1, 2, 3]
        assert time.monotonic() - t0 < 30
    finally:
        reader.close()
