"""The Python CUDA IPC path on a real GPU (run by scripts/gpu-check): an owner
process shares a torch CUDA tensor with torch's own _share_cuda_() tuple, a
reader pulls pages into its own torch CUDA tensor and compares on the GPU.
Skips without torch or a device; MSTAR_KV_REQUIRE_GPU=1 makes that a failure."""
import os
import subprocess
import sys

import mstar_kv as kv
import pytest

REQUIRE = os.environ.get("MSTAR_KV_REQUIRE_GPU") == "1"


def _why_not():
    if "cuda_ipc" not in kv.built_engines():
        return "the cuda_ipc engine is not built"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return kv.cuda_unavailable_reason()


WHY = _why_not()
if WHY and REQUIRE:
    raise RuntimeError(f"MSTAR_KV_REQUIRE_GPU=1 but {WHY}")
pytestmark = pytest.mark.skipif(bool(WHY), reason=WHY or "")

OWNER = r'''
import sys, torch, mstar_kv as kv
layout = kv.KVLayout(4, 64, 16, 8, 128)
shape = [4, 2, 64, 16, 8, 128]
t = (torch.arange(layout.total_bytes // 2, device="cuda", dtype=torch.int64) % 30011) \
        .to(torch.int16).view(torch.bfloat16).reshape(shape)
torch.cuda.synchronize()
share = t.untyped_storage()._share_cuda_()
info = kv.CudaIpcKVTransferInfo(share, tuple(t.size()), tuple(t.stride()),
                                t.storage_offset(), str(t.dtype), False, layout)
sys.stdout.write(info.to_bytes().hex() + "\n"); sys.stdout.flush()
sys.stdin.readline()
'''


def test_two_processes_torch_share_cuda():
    import torch
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        info = kv.CudaIpcKVTransferInfo.from_bytes(bytes.fromhex(owner.stdout.readline()))
        layout = info.layout
        shape = [4, 2, 64, 16, 8, 128]
        dst = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        cache = kv.KVCache.from_dlpack(dst, layout)
        mgr = kv.KVTransferManager(kv.CudaIpcKVTransferEngine(cache, max_workers=3), cache)
        remote = [5, 9, 33, 2]
        local = [0, 1, 2, 3]
        n = mgr.sync_retrieve(0, 60, local, remote, info)  # 3 full pages + 12 tokens
        assert n == 4 * 2 * 60 * layout.token_bytes
        expect = (torch.arange(layout.total_bytes // 2, device="cuda", dtype=torch.int64)
                  % 30011).to(torch.int16).view(torch.bfloat16).reshape(shape)
        for i, (lp, rp) in enumerate(zip(local, remote)):
            toks = 16 if i < 3 else 12
            assert torch.equal(dst[:, :, lp, :toks], expect[:, :, rp, :toks])
            assert torch.count_nonzero(dst[:, :, lp, toks:].view(torch.int16)) == 0
        assert torch.count_nonzero(dst[:, :, 4:].view(torch.int16)) == 0
        mgr.cleanup()
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)


STREAM_OWNER = r'''
import sys, time, torch, mstar_kv as kv
layout = kv.KVLayout(4, 64, 16, 8, 128)
shape = [4, 2, 64, 16, 8, 128]
expect = (torch.arange(layout.total_bytes // 2, device="cuda", dtype=torch.int64) % 30011) \
        .to(torch.int16).view(torch.bfloat16).reshape(shape)
t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
t.view(torch.int16).fill_(-4370)  # poison (0xEEEE) in every layer not yet written
torch.cuda.synchronize()
cache = kv.KVCache.from_dlpack(t, layout)
mgr = kv.KVTransferManager(kv.CudaIpcKVTransferEngine(cache, max_workers=3), cache)
pool = kv.KVCachePool(cache, mgr)
pages = pool.allocate(1, 60)
seq = pool.publish(1, layers_ready=0)
sys.stdout.write(seq.to_bytes().hex() + "\n"); sys.stdout.flush()
stream = torch.cuda.Stream()
for layer in range(4):
    time.sleep(0.15)  # compute
    with torch.cuda.stream(stream):
        # A large write the mark must wait for: the layer's bytes, then the
        # mark enqueued behind them (the forward pass does not wait).
        for _ in range(20):
            t[layer, :, pages] = expect[layer, :, pages] * 2
        t[layer, :, pages] = expect[layer, :, pages]
    pool.mark_layers_ready_after(1, layer + 1, stream)
stream.synchronize()
sys.stdout.write("DONE\n"); sys.stdout.flush()
sys.stdin.readline()
'''


def test_streaming_from_a_torch_owner_marking_on_its_stream():
    """The owner writes each layer on a torch stream and marks it with
    mark_layers_ready_after; the reader streams layer by layer. Not-ready
    layers hold poison: a layer copied before its mark fails the compare."""
    import time

    import torch
    owner = subprocess.Popen([sys.executable, "-c", STREAM_OWNER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        seq = kv.SequenceInfo.from_bytes(bytes.fromhex(owner.stdout.readline()))
        layout = kv.KVLayout(4, 64, 16, 8, 128)
        shape = [4, 2, 64, 16, 8, 128]
        dst = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
        cache = kv.KVCache.from_dlpack(dst, layout)
        mgr = kv.KVTransferManager(kv.CudaIpcKVTransferEngine(cache, max_workers=3), cache)
        local = [10 + i for i in range(len(seq.page_indices))]
        s = mgr.start_streaming_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                         seq.kv_transfer_info, ready_timeout=10.0)
        t0 = time.monotonic()
        arrivals = []
        for layer in range(4):
            assert s.wait_for_layer(layer, timeout=10)
            arrivals.append(time.monotonic() - t0)
        assert s.future.result(timeout=10) == 4 * 2 * 60 * layout.token_bytes
        assert arrivals[0] < arrivals[3] - 0.3, arrivals  # layer by layer, not at the end
        expect = (torch.arange(layout.total_bytes // 2, device="cuda", dtype=torch.int64)
                  % 30011).to(torch.int16).view(torch.bfloat16).reshape(shape)
        for i, (lp, rp) in enumerate(zip(local, seq.page_indices)):
            toks = 16 if i < 3 else 12
            assert torch.equal(dst[:, :, lp, :toks], expect[:, :, rp, :toks]), f"page {i}"
            assert torch.count_nonzero(dst[:, :, lp, toks:].view(torch.int16)) == 0
        assert torch.count_nonzero(dst[:, :, :10].view(torch.int16)) == 0
        mgr.cleanup()
        assert owner.stdout.readline().strip() == "DONE"
    finally:
        owner.stdin.close()
        owner.wait(timeout=60)
