#!/usr/bin/env python3
"""The main job in Python: a prefill process writes a request's K/V into the
pages of its cache and publishes it; a decode process pulls the pages it lacks
and checks every one.

    python3 python/examples/disaggregated.py [--engine shm|ucx|mooncake]
                                             [--tokens 4096] [--cached 1024]

Prefill and decode are two processes (multiprocessing, spawn). Only the
SequenceInfo crosses between them (pickled through a Pipe here; any RPC or
HTTP works: it pickles through its byte encoding). The decode side has the
first --cached tokens already (a prefix hit) and pulls only the rest.
"""
import argparse
import multiprocessing as mp
import time

import mstar_kv as kv
import numpy as np

# Llama-3-8B: 32 layers, 8 KV heads, head dim 128, bf16, 16-token pages.
LAYERS, HEADS, DIM, PAGE = 32, 8, 128, 16


def layout(num_pages):
    return kv.KVLayout(LAYERS, num_pages, PAGE, HEADS, DIM, dtype="bf16")


def expected(layer, kv_idx, tokens):
    """What the 'model' writes for (layer, k|v, token, head, dim), as bf16 bits."""
    t = np.asarray(tokens, dtype=np.uint32)[:, None, None]
    h = np.arange(HEADS, dtype=np.uint32)[None, :, None]
    d = np.arange(DIM, dtype=np.uint32)[None, None, :]
    return ((layer * 7919 + kv_idx * 104729 + t * 31 + h * 131 + d) & 0x7F7F).astype(np.uint16)


def engine_info(name, who):
    if name == "mooncake":
        from mooncake.engine import TransferEngine
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        return kv.TransferEngineInfo(who, "", te), te
    return kv.TransferEngineInfo(who, "", name), None


def prefill(conn, engine, tokens):
    cache = kv.KVCache(layout(1024), "shared" if engine == "shm" else "host")
    info, te = engine_info(engine, "prefill-0")
    manager = kv.KVTransferManager(info, cache)
    pool = kv.KVCachePool(cache, manager, scatter_seed=7)  # scattered pages
    pages = pool.allocate(seq_id=1, num_tokens=tokens)
    view = cache.numpy()  # [layer, k|v, page, token, head, dim], no copy
    for layer in range(LAYERS):  # the forward pass writes K/V layer by layer
        for i, page in enumerate(pages):
            toks = range(i * PAGE, min((i + 1) * PAGE, tokens))
            for kv_idx in (0, 1):
                view[layer, kv_idx, page, :len(toks)] = expected(layer, kv_idx, toks)
    conn.send(pool.publish(1))  # a SequenceInfo
    conn.recv()  # decode is done
    pool.free(1)
    manager.cleanup()


def decode(seq, engine, cached):
    cache = kv.KVCache(layout(512))
    info, te = engine_info(engine, "decode-0")
    manager = kv.KVTransferManager(info, cache)
    local = list(range(100, 100 + len(seq.page_indices)))  # our own page table
    t0 = time.perf_counter()
    future = manager.start_async_retrieve(cached, seq.num_tokens, local, seq.page_indices,
                                          seq.kv_transfer_info)
    nbytes = future.result()  # or: await asyncio.wrap_future(future)
    seconds = time.perf_counter() - t0
    view = cache.numpy()
    for layer in range(LAYERS):
        for i, page in enumerate(local):
            lo, hi = max(i * PAGE, cached), min((i + 1) * PAGE, seq.num_tokens)
            if lo >= hi:
                continue
            for kv_idx in (0, 1):
                got = view[layer, kv_idx, page, lo - i * PAGE:hi - i * PAGE]
                if not np.array_equal(got, expected(layer, kv_idx, range(lo, hi))):
                    raise SystemExit(f"layer {layer} page {page}: wrong K/V")
    manager.cleanup()
    return nbytes, seconds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="shm", choices=["shm", "ucx", "mooncake"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--cached", type=int, default=1024)
    args = p.parse_args()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=prefill, args=(child, args.engine, args.tokens))
    proc.start()
    try:
        seq = parent.recv()
        nbytes, seconds = decode(seq, args.engine, args.cached)
        parent.send("done")
    finally:
        proc.join(timeout=60)
    print(f"{args.engine}: pulled tokens [{args.cached}, {seq.num_tokens}) of request "
          f"{seq.seq_id}: {nbytes / 2**20:.1f} MiB in {seconds * 1e3:.1f} ms "
          f"({nbytes / seconds / 1e9:.2f} GB/s), every page checked")


if __name__ == "__main__":
    main()
