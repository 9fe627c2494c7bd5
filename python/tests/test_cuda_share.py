"""CudaIpcKVTransferInfo from torch's _share_cuda_() tuple, decoded without a
GPU from tuples built by hand; the GPU path runs in scripts/gpu-check."""
import os
import pickle

import mstar_kv as kv
import pytest
from conftest import local_layout

needs_cuda_build = pytest.mark.skipif(
    "cuda_ipc" not in kv.built_engines(), reason="the cuda_ipc engine is not built here")

HANDLE = bytes(range(64))
UUID = bytes(range(100, 116))


def share(handle=HANDLE, device=0, size=None, offset=0):
    layout = local_layout()
    size = layout.total_bytes if size is None else size
    # (device, handle, storage bytes, storage offset bytes, ref-counter handle,
    #  ref-counter offset, event handle, event sync required)
    return (device, handle, size, offset, b"/torch_123_ref", 16, b"\x00" * 64, True)


def view(layout):
    return kv._core._CudaIpcKVTransferInfo.view_size(layout), \
        kv._core._CudaIpcKVTransferInfo.view_stride(layout)


def test_parse_bare_and_versioned_handles():
    assert kv.parse_cuda_share(share())[:2] == (0, HANDLE)
    assert kv.parse_cuda_share(share(handle=b"\x01c" + HANDLE))[1] == HANDLE
    assert kv.parse_cuda_share(share(handle=b"\x02c" + HANDLE, device=3))[:2] == (3, HANDLE)


@pytest.mark.parametrize("bad,match", [
    (share(handle=b"\x01e" + b"\x00" * 80), "expandable-segment"),
    (share(handle=b"\x01x" + HANDLE), r"66 bytes \(type byte b'x'\)"),
    (share(handle=HANDLE[:10]), "10 bytes"),
    (share()[:7], "8-field tuple"),
    (share(device=-1), "device -1"),
    ((0, "not bytes", 1, 0, b"", 0, b"", False), "handle is a str"),
])
def test_parse_rejects_with_the_reason(bad, match):
    with pytest.raises(kv.InvalidArgumentError, match=match):
        kv.parse_cuda_share(bad)


@needs_cuda_build
def test_info_from_torch_tuple_round_trips():
    layout = local_layout()
    size, stride = view(layout)
    es = layout.element_size
    info = kv.CudaIpcKVTransferInfo(share(handle=b"\x01c" + HANDLE, offset=4096,
                                          size=layout.total_bytes),
                                    size, stride, 0, "torch.bfloat16", False, layout,
                                    device_uuid=UUID)
    assert info.handle == HANDLE
    assert info.owner_pid == os.getpid() and info.generation != 0
    n = info._native
    assert n.offset == 4096 // es  # storage offset folded into the element offset
    assert n.allocation_bytes == 4096 + layout.total_bytes
    assert n.device_uuid == UUID
    back = kv.CudaIpcKVTransferInfo.decode(info.encode())
    assert back == info and back.handle == HANDLE
    assert pickle.loads(pickle.dumps(info)) == info
    # Same handle, same generation: a reader sees one allocation.
    again = kv.CudaIpcKVTransferInfo(share(offset=4096), size, stride, 0, "bf16", False, layout,
                                     device_uuid=UUID)
    assert again.generation == info.generation


@needs_cuda_build
def test_info_rejects_what_torch_would_not_produce():
    layout = local_layout()
    size, stride = view(layout)
    with pytest.raises(kv.CorruptDescriptorError, match="requires_grad"):
        kv.CudaIpcKVTransferInfo(share(), size, stride, 0, "bf16", True, layout,
                                 device_uuid=UUID)
    with pytest.raises(kv.CorruptDescriptorError, match="dtype"):
        kv.CudaIpcKVTransferInfo(share(), size, stride, 0, "torch.float16", False, layout,
                                 device_uuid=UUID)
    with pytest.raises(kv.CorruptDescriptorError, match="size"):
        kv.CudaIpcKVTransferInfo(share(), list(size[:-1]) + [1], stride, 0, "bf16", False,
                                 layout, device_uuid=UUID)
    with pytest.raises(kv.CorruptDescriptorError):  # view past the allocation
        kv.CudaIpcKVTransferInfo(share(size=1024), size, stride, 0, "bf16", False, layout,
                                 device_uuid=UUID)
    with pytest.raises(kv.InvalidArgumentError, match="multiple of the element size"):
        kv.CudaIpcKVTransferInfo(share(offset=3), size, stride, 0, "bf16", False, layout,
                                 device_uuid=UUID)


@needs_cuda_build
def test_cuda_engine_without_device_says_why():
    reason = kv.cuda_unavailable_reason()
    if not reason:
        pytest.skip("a CUDA device is visible")
    with pytest.raises(kv.UnavailableError, match="cuda"):
        kv.KVCache(local_layout(), "device")
