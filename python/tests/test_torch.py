"""torch CPU tensors as KV caches, without a copy, for every engine that
takes host memory: shm, ucx (tcp) and the Mooncake wheel's
engine between two real processes, and local-only in one; bf16, fp16 and
both fp8 formats.

The owner (torch_peer.py) writes each sequence's K/V with torch, into
either its own tensor wrapped by KVCache.from_dlpack ("tensor") or a
library cache seen through torch.from_dlpack ("library"); this process
pulls into a torch tensor wrapped by KVCache.from_dlpack and compares,
through that tensor, the bytes that arrived with what the owner's torch
wrote. Zero copy is checked by data pointers on both sides. A private
tensor is served over shm too (cross-memory attach, docs/engines/shm.md)."""
import os

import mstar_kv as kv
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (./scripts/test installs it)")

import subprocess  # noqa: E402
import sys  # noqa: E402

from conftest import HERE  # noqa: E402
from torch_peer import DTYPES, GEOMETRY, SEQ_PAGES, expected, layout_of  # noqa: E402

os.environ.setdefault("UCX_TLS", "tcp")  # in this process and the peers it starts
os.environ.setdefault("UCX_NET_DEVICES", "lo")

try:
    import mooncake.engine as mooncake_engine
except ImportError:
    mooncake_engine = None

ENGINES = ["shm", "ucx", "mooncake"]


class TorchPeer:
    """torch_peer.py: {(dtype, memory): SequenceInfo or None (not served)}."""

    def __init__(self, engine):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), HERE]))
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "torch_peer.py"), engine],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.seqs = {}
        for line in self.proc.stdout:
            words = line.split()
            if words[:1] == ["READY"]:
                return
            assert words[:1] == ["SEQ"], line
            self.seqs[(words[1], words[2])] = (
                None if words[3] == "-" else kv.SequenceInfo.from_bytes(bytes.fromhex(words[3])))
        raise RuntimeError(f"torch_peer.py exited with {self.proc.wait()} before READY")

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module", params=ENGINES)
def owner(request):
    if request.param == "mooncake" and mooncake_engine is None:
        pytest.skip("the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")
    peer = TorchPeer(request.param)
    yield request.param, peer
    peer.close()


_wheel_engines = []  # this process's one TransferEngine, made on first use


def reader(engine, cache):
    if engine == "mooncake":
        if not _wheel_engines:
            te = mooncake_engine.TransferEngine()
            assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
            _wheel_engines.append(te)
        return kv.KVTransferManager(
            kv.TransferEngineInfo("decode", "", _wheel_engines[0], {"timeout": 10.0}), cache)
    return kv.KVTransferManager(kv.TransferEngineInfo("decode", "", engine, {"timeout": 10.0}),
                                cache)


def torch_cache(dtype):
    """A torch tensor wrapped as a cache: the same memory, checked."""
    layout = layout_of(dtype)
    t = torch.zeros(tuple(kv.KVCache(layout).view_shape), dtype=DTYPES[dtype])
    cache = kv.KVCache.from_dlpack(t, layout)
    assert cache.data_ptr == t.data_ptr() and cache.size_bytes == t.numel() * t.element_size()
    assert torch.from_dlpack(cache).data_ptr() == t.data_ptr()
    return t, cache


@pytest.mark.parametrize("memory", ["library", "tensor"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_torch_tensor_reads_what_the_owners_torch_wrote(owner, dtype, memory):
    engine, peer = owner
    seq = peer.seqs[(dtype, memory)]
    # Every engine serves both: a private tensor over shm through cross-memory
    # attach (docs/engines/shm.md), so the owner published a descriptor for it.
    assert seq is not None, f"{engine} published no descriptor for the {memory} cache"
    if engine == "shm":
        access = "cma" if memory == "tensor" else "memfd"
        assert kv.ShmKVTransferInfo.decode(seq.kv_transfer_info).access == access
    t, cache = torch_cache(dtype)
    t.view(torch.uint8).fill_(0x5A)  # a sentinel in every byte
    mgr = reader(engine, cache)
    local = [11, 2, 7, 0, 14]  # another page table than the owner's
    assert len(local) == SEQ_PAGES
    n = mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
    assert n == t[:, :, local].numel() * t.element_size()
    # Through the reader's own tensor: exactly the bytes the owner's torch wrote...
    got = t[:, :, local]
    assert torch.equal(got.view(torch.uint8), expected(dtype).view(torch.uint8))
    # ...and nothing else touched.
    rest = [p for p in range(GEOMETRY["num_pages"]) if p not in local]
    assert bool((t[:, :, rest].view(torch.uint8) == 0x5A).all())
    mgr.cleanup()


def test_bytes_written_through_a_tensor_after_wrapping_are_read():
    """The owner writes through its tensor after the cache wraps it, the
    reader (another tensor) sees them: the cache holds no copy of either."""
    layout = layout_of("bf16")
    shared = kv.KVCache(layout, "shared")
    st = torch.from_dlpack(shared)
    assert st.data_ptr() == shared.data_ptr
    engine = kv.ShmKVTransferEngine(shared)
    pool = kv.KVCachePool(shared, engine.get_kv_transfer_info(), scatter_seed=5)
    pages = pool.allocate(7, 3 * layout.page_size)
    seq = pool.publish(7)  # published before the bytes are written
    st[:, :, pages] = torch.full(st[:, :, pages].shape, 1.5, dtype=torch.bfloat16)
    st[1, 0, pages[2], 3] = -2.25  # layer 1, K, third page, token 3
    dst, dst_cache = torch_cache("bf16")
    mgr = reader("shm", dst_cache)
    mgr.sync_retrieve(0, seq.num_tokens, [4, 5, 6], seq.page_indices, seq.kv_transfer_info)
    assert torch.equal(dst[:, :, [4, 5, 6]], st[:, :, pages])
    assert bool((dst[1, 0, 6, 3] == -2.25).all()) and bool((dst[0, 1, 4] == 1.5).all())
    mgr.cleanup()
    engine.shutdown()


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_local_only_over_a_torch_tensor(dtype):
    """local-only takes any host memory: a torch cache with its pool works,
    the library's writes are the tensor's bytes, and a pull (nothing leaves
    the process) is refused before any byte moves."""
    t, cache = torch_cache(dtype)
    mgr = kv.KVTransferManager(None, cache)
    assert isinstance(mgr.engine, kv.LocalOnlyKVTransferEngine)
    pool = kv.KVCachePool(cache, mgr.get_kv_transfer_info(), scatter_seed=2)
    pages = pool.allocate(1, 2 * GEOMETRY["page_size"])
    cache.fill_pattern(99, pages, 0, 2 * GEOMETRY["page_size"])  # the library writes...
    assert bool((t[:, :, pages].view(torch.uint8) != 0).any())  # ...into the tensor
    t[0, 0, pages[0], 0] = 0  # torch writes: the library's check sees them
    assert not cache.verify_pattern(99, pages, 0, 2 * GEOMETRY["page_size"])["ok"]
    before = t.clone()
    seq = pool.publish(1)
    with pytest.raises(kv.InvalidArgumentError, match="local-only"):
        mgr.start_async_retrieve(0, seq.num_tokens, [0, 1], seq.page_indices,
                                 seq.kv_transfer_info)
    assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))
