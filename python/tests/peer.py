"""A prefill process for the tests: allocates a cache, fills two requests
with the library's pattern, publishes them and serves until told to stop.

    python peer.py ENGINE [--layers N --pages N ...]

ENGINE: shm | ucx | mooncake (the PyPI wheel's TransferEngine) | mooncake-c
(the C++ engine over Mooncake's C library, MSTAR_KV_MOONCAKE_LIB).
--memory: the cache: shared (a memfd; shm's default) or host (private: the
other engines' default; shm serves it by cross-memory attach), layers (one
numpy array per layer, KVCache.from_layer_tensors), torch (one torch tensor,
from_dlpack), torch-layers (one torch tensor per layer, vLLM's shape).
Prints one line "READY <hex of SequenceInfo 1> <hex of SequenceInfo 2>",
then reads commands on stdin, one per line:
    restart   shut the engine down and start a new one on the same cache
              (and, for mooncake, the same TransferEngine): a new generation;
              for shm, whose generation is the memory's, on a new cache
    quit      exit (also on end of input)
After each command it prints the new READY line, but for these:
    reuse [S] after S seconds (default 0), free sequence 1 (then the one the last reuse made) and give its
              pages to a new sequence 3, 4, ..., filled with its own pattern
              (SEED + id): prints "REUSED <hex of the new SequenceInfo>"
    expire    reap expired leases: prints "EXPIRED <count>"
    stream MS N  layer-wise streaming, a deliberately slow owner: allocates
              sequence 1000 (its pages hold the poison byte 0xEE: the whole
              cache is poisoned before sequences 1 and 2 are filled),
              publishes it with 0 layers ready ("STREAM <hex>"), then for each
              of its first N layers sleeps MS ms, writes the layer's pattern
              (SEED + 1000), marks it ready and prints "MARKED <layer>"
    rawready V  stamps V on the readiness words of the stream's pages behind
              the pool's back (a broken owner): prints "RAW"
    contains N  prints "CONTAINS 0|1"
Done notices that reach the engine (UCX) free sequences in the pool.
"""
import argparse
import ctypes
import sys
import threading
import time

import mstar_kv as kv

SEED = 1234


def make_engine(args, cache, te):
    if args.engine == "shm":
        return kv.ShmKVTransferEngine(cache)
    if args.engine == "ucx":
        options = {"auth_token": args.auth_token} if args.auth_token else None
        return kv.UcxKVTransferEngine(cache, entity_id="prefill", session_id=args.session,
                                      timeout=args.timeout, options=options)
    if args.engine == "mooncake":
        return kv.MooncakeKVTransferEngine(cache, "prefill", te, timeout=args.timeout,
                                           hostname=args.host)
    if args.engine == "mooncake-c":
        return kv.MooncakeKVTransferEngine(cache, "prefill", None, timeout=args.timeout)
    raise SystemExit(f"unknown engine {args.engine}")


def make_cache(layout, memory):
    """The owner's cache in `memory` (see --memory), and what keeps its
    tensors alive."""
    if memory in ("shared", "host"):
        return kv.KVCache(layout, memory), None
    shape = [layout.num_kv, layout.num_pages, layout.page_size, layout.num_kv_heads,
             layout.head_dim]
    if memory == "layers":
        import numpy as np
        arrays = [np.zeros(shape, dtype=np.uint16) for _ in range(layout.num_layers)]
        return kv.KVCache.from_layer_tensors(arrays, layout), arrays
    import torch
    if memory == "torch":
        t = torch.zeros([layout.num_layers, *shape], dtype=torch.bfloat16)
        return kv.KVCache.from_dlpack(t, layout), t
    if memory == "torch-layers":
        ts = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(layout.num_layers)]
        return kv.KVCache.from_layer_tensors(ts, layout), ts
    raise SystemExit(f"unknown memory {memory}")


def poison(cache, value):
    """Every byte of every region of a host cache set to `value`."""
    for addr, size in cache.regions:
        ctypes.memset(addr, value, size)


def add_geometry_args(p):
    """The cache geometry flags (conftest.LAYOUT_ARGS by default); readers of
    this peer's sequences take the same."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bf16")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("engine")
    add_geometry_args(p)
    p.add_argument("--cache-order", default="layer")
    p.add_argument("--page-order", default="nhd")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--session", default="", help="ucx: HOST:PORT to listen on")
    p.add_argument("--host", default="127.0.0.1",
                   help="mooncake: the address its TransferEngine serves at")
    p.add_argument("--lease", type=float, default=60.0, help="the pool's lease, seconds")
    p.add_argument("--auth-token", default="", help="ucx: the shared secret readers must prove")
    p.add_argument("--total-heads", type=int, default=0, help="the model's KV heads (shards)")
    p.add_argument("--first-head", type=int, default=0, help="this cache's first model head")
    p.add_argument("--memory", default="", help="shared | host | layers | torch | torch-layers")
    args = p.parse_args()
    memory = args.memory or ("shared" if args.engine == "shm" else "host")

    layout = kv.KVLayout(args.layers, args.pages, args.page_size, args.heads, args.head_dim,
                         dtype=args.dtype, cache_order=args.cache_order,
                         page_order=args.page_order, total_kv_heads=args.total_heads,
                         first_kv_head=args.first_head)
    cache, keep = make_cache(layout, memory)
    te = None
    if args.engine == "mooncake":
        from mooncake.engine import TransferEngine
        te = TransferEngine()
        if te.initialize(args.host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise SystemExit("mooncake initialize failed")
    engine = make_engine(args, cache, te)
    owner = kv.KVTransferManager(engine, cache)
    pool = kv.KVCachePool(cache, owner, scatter_seed=7, lease=args.lease)
    owner.serve_done_notices(pool)  # no notices arrive over shm or mooncake
    if cache.memory != "device":
        poison(cache, 0xEE)  # (see "stream")
    for seq_id in (1, 2):
        pool.allocate(seq_id, args.tokens)
        cache.fill_pattern(SEED + seq_id, pool.pages(seq_id), 0, args.tokens)

    def stream(ms, n):
        pages = pool.allocate(1000, args.tokens)
        print("STREAM", pool.publish(1000, layers_ready=0).to_bytes().hex(), flush=True)

        def mark():
            for layer in range(n):
                time.sleep(ms / 1000.0)
                cache.fill_pattern(SEED + 1000, pages, 0, args.tokens, layers=(layer, layer + 1))
                pool.mark_layers_ready(1000, layer + 1)
                print("MARKED", layer, flush=True)

        t = threading.Thread(target=mark, daemon=True)
        t.start()
        return t

    def ready():
        out = [pool.publish(s).to_bytes().hex() for s in (1, 2)]
        print("READY", *out, flush=True)

    ready()
    current = 1  # the sequence the next "reuse" frees
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "restart":
            owner.cleanup()  # shuts the engine down; nothing keeps the old cache then
            owner = None
            # A shared cache's generation is the memory's: reallocate (a
            # private one's is its engine's anchor: a new engine is enough).
            if args.engine == "shm" and memory == "shared":
                old_cache, cache = cache, kv.KVCache(layout, "shared")
                del old_cache
                for seq_id in (1, 2):
                    cache.fill_pattern(SEED + seq_id, pool.pages(seq_id), 0, args.tokens)
            engine = make_engine(args, cache, te)
            pool = _republish(pool, cache, engine, args)
            ready()
        elif cmd.split()[0:1] == ["reuse"]:
            if len(cmd.split()) > 1:  # "reuse SECONDS": wait that long first
                time.sleep(float(cmd.split()[1]))
            pages = pool.pages(current)
            pool.free(current)
            current = max(current, 2) + 1
            assert pool.allocate(current, args.tokens) == pages  # LIFO: the same pages
            cache.fill_pattern(SEED + current, pages, 0, args.tokens)
            print("REUSED", pool.publish(current).to_bytes().hex(), flush=True)
        elif cmd.startswith("stream "):
            stream(float(cmd.split()[1]), int(cmd.split()[2]))
        elif cmd.startswith("rawready "):
            for p in pool.pages(1000):
                ctypes.c_uint32.from_address(cache.ready_ptr + 4 * p).value = int(cmd.split()[1])
            print("RAW", flush=True)
        elif cmd == "expire":
            print("EXPIRED", pool.expire_leases(), flush=True)
        elif cmd.startswith("contains "):
            print("CONTAINS", int(int(cmd.split()[1]) in pool), flush=True)
        elif cmd == "quit":
            break
    engine.shutdown()


def _republish(old, cache, engine, args):
    pool = kv.KVCachePool(cache, engine.get_kv_transfer_info(), scatter_seed=7)
    for seq_id in (1, 2):
        pool.allocate(seq_id, args.tokens)  # same seed: the same pages as before
        assert pool.pages(seq_id) == old.pages(seq_id)
    return pool


if __name__ == "__main__":
    main()
