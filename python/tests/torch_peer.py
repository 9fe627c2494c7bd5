"""A prefill process for the torch tests (test_torch.py): its caches are
written with torch, through torch tensors, and served.

    python torch_peer.py ENGINE     (shm | ucx | mooncake)

For every dtype of DTYPES and two kinds of cache memory it publishes one
sequence of SEQ_PAGES full pages:
    tensor    KVCache.from_dlpack(torch.zeros(...)): the application's tensor
    library   KVCache(layout, 'shared' for shm else 'host'), written through
              torch.from_dlpack(cache)
The sequence's pages are written with torch (expected(dtype), indexed by
the pool's pages) after the pool allocated them. Prints one line per cache,
"SEQ <dtype> <memory> <hex SequenceInfo>" ("SEQ ... -" when the engine
publishes no descriptor for that memory), then "READY", and serves until
stdin closes or says "quit". Exits 1 with "ERR ..." when a tensor and its
cache do not share their memory.
"""
import os
import sys

os.environ.setdefault("GLOG_minloglevel", "2")

import mstar_kv as kv
import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16,
          "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GEOMETRY = dict(num_layers=2, num_pages=16, page_size=16, num_kv_heads=2, head_dim=64)
SEQ_PAGES = 5
SEED = 4321


def layout_of(dtype):
    return kv.KVLayout(**GEOMETRY, dtype=dtype)


def expected(dtype):
    """The sequence's K/V as the model would have written it:
    [layers, 2, SEQ_PAGES, page_size, heads, head_dim] of `dtype`, the same
    in every process (a seeded CPU generator)."""
    g = torch.Generator().manual_seed(SEED + list(DTYPES).index(dtype))
    shape = (GEOMETRY["num_layers"], 2, SEQ_PAGES, GEOMETRY["page_size"],
             GEOMETRY["num_kv_heads"], GEOMETRY["head_dim"])
    return (torch.randn(shape, generator=g) * 2).to(DTYPES[dtype])


def make_engine(name, cache, te):
    if name == "shm":
        return kv.ShmKVTransferEngine(cache)
    if name == "ucx":
        return kv.UcxKVTransferEngine(cache, entity_id="torch-prefill")
    return kv.MooncakeKVTransferEngine(cache, "torch-prefill", te)


def main():
    name = sys.argv[1]
    te = None
    if name == "mooncake":
        from mooncake.engine import TransferEngine
        te = TransferEngine()
        if te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("mooncake initialize failed")
    keep = []
    for dtype in DTYPES:
        layout = layout_of(dtype)
        for memory in ("tensor", "library"):
            if memory == "tensor":
                tensor = torch.zeros(layout_view(layout), dtype=DTYPES[dtype])
                cache = kv.KVCache.from_dlpack(tensor, layout)
            else:
                cache = kv.KVCache(layout, "shared" if name == "shm" else "host")
                tensor = torch.from_dlpack(cache)
            if tensor.data_ptr() != cache.data_ptr or tensor.dtype != DTYPES[dtype]:
                print(f"ERR {dtype} {memory}: the tensor at {tensor.data_ptr():#x} "
                      f"({tensor.dtype}) is not the cache at {cache.data_ptr:#x}", flush=True)
                return 1
            engine = make_engine(name, cache, te)
            info = engine.get_kv_transfer_info()
            pool = kv.KVCachePool(cache, info, scatter_seed=3)
            pages = pool.allocate(1, SEQ_PAGES * GEOMETRY["page_size"])
            tensor[:, :, pages] = expected(dtype)  # the prefill writes through torch
            seq = pool.publish(1)
            # "-": the engine published no descriptor (the test fails on it).
            desc = seq.to_bytes().hex() if getattr(info, "engine", name) else "-"
            print(f"SEQ {dtype} {memory} {desc}", flush=True)
            keep.append((tensor, cache, engine, pool))
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    for _, _, engine, _ in keep:
        engine.shutdown()
    return 0


def layout_view(layout):
    """The layout's 6-D tensor shape (KVCache.view_shape's, layer-major NHD)."""
    return (layout.num_layers, 2, layout.num_pages, layout.page_size, layout.num_kv_heads,
            layout.head_dim)


if __name__ == "__main__":
    sys.exit(main())
