#!/usr/bin/env python3
"""The first pull from a new peer against a steady one, over KVTransferManager
alone (no vLLM): an owner process publishes one sequence; this process makes
a fresh reader manager (a new peer: nothing connected, nothing mapped), or
with --warm-reader one reader all along and a new owner process each round,
and times its first pull and the pulls after it, either as they come ("cold":
the first pull connects) or after KVTransferManager.connect ("connected":
the connect timed apart). Rounds alternate the two; medians.

    python bench/first_pull_probe.py --engine ucx --tokens 32 --rounds 20
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# Llama-3-8B's KV per token and layer (8 heads x 128, fp16), 2 layers, pages of 32.
LAYOUT = dict(num_layers=2, num_pages=64, page_size=32, num_kv_heads=8, head_dim=128,
              dtype="fp16")


def owner(engine: str, tokens: int) -> None:
    import mstar_kv as kv
    layout = kv.KVLayout(**LAYOUT)
    cache = kv.KVCache(layout, "shared" if engine == "shm" else "host")
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("owner", "", engine, {"timeout": 10}), cache)
    pool = kv.KVCachePool(cache, mgr.get_kv_transfer_info())
    pool.allocate(1, tokens)
    cache.fill_pattern(7, pool.pages(1), 0, tokens)
    seq = pool.publish(1)
    print("SEQ " + bytes(seq.to_bytes()).hex(), flush=True)
    sys.stdin.readline()  # until the reader is done
    mgr.cleanup()


def reader(kv, engine: str) -> tuple:
    cache = kv.KVCache(kv.KVLayout(**LAYOUT))
    # Touched, as vLLM's KV tensors are (torch zeroes them): the first pull
    # pays no page faults of a fresh allocation.
    cache.numpy().view("uint8")[:] = 0
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("reader", "", engine, {"timeout": 10}),
                               cache)
    return cache, mgr


def one_round(kv, engine: str, seq, connect: bool, steady: int, warm=None) -> dict:
    cache, mgr = warm if warm is not None else reader(kv, engine)
    local = list(range(len(seq.page_indices)))
    out = {}
    try:
        if connect:
            t0 = time.perf_counter()
            mgr.connect(seq.kv_transfer_info)
            out["connect"] = time.perf_counter() - t0
        times = []
        for _ in range(1 + steady):
            t0 = time.perf_counter()
            mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
            times.append(time.perf_counter() - t0)
        assert cache.verify_pattern(7, local, 0, seq.num_tokens)["ok"]
        out["first"], out["steady"] = times[0], statistics.median(times[1:])
    finally:
        if warm is None:
            mgr.cleanup()
    return out


class Owner:
    def __init__(self, args):
        import mstar_kv as kv
        self.p = subprocess.Popen([sys.executable, __file__, "--owner", "--engine", args.engine,
                                   "--tokens", str(args.tokens)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        line = self.p.stdout.readline()
        assert line.startswith("SEQ "), line
        self.seq = kv.SequenceInfo.from_bytes(bytes.fromhex(line[4:].strip()))

    def close(self):
        self.p.stdin.close()
        self.p.wait(30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="ucx", choices=["ucx", "shm"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steady", type=int, default=9, help="pulls after the first, per round")
    ap.add_argument("--warm-reader", action="store_true",
                    help="one reader for every round, a new owner process each round")
    ap.add_argument("--owner", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine == "ucx":
        os.environ.setdefault("UCX_TLS", "tcp")
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if args.owner:
        owner(args.engine, args.tokens)
        return 0
    import mstar_kv as kv
    rows = {"cold": [], "connected": []}
    if args.warm_reader:
        # One long-lived reader (a decode worker), a new owner each round (a
        # prefill engine it has not met): the reader's own first-use costs
        # are paid by a pull before the rounds.
        warm = reader(kv, args.engine)
        o = Owner(args)
        one_round(kv, args.engine, o.seq, False, 1, warm)
        o.close()
        for i in range(args.rounds):
            for mode in (("cold", "connected") if i % 2 == 0 else ("connected", "cold")):
                o = Owner(args)
                try:
                    rows[mode].append(one_round(kv, args.engine, o.seq, mode == "connected",
                                                args.steady, warm))
                finally:
                    o.close()
        warm[1].cleanup()
    else:
        o = Owner(args)
        try:
            for i in range(args.rounds):
                for mode in (("cold", "connected") if i % 2 == 0 else ("connected", "cold")):
                    rows[mode].append(one_round(kv, args.engine, o.seq, mode == "connected",
                                                args.steady))
        finally:
            o.close()
    kib = args.tokens * LAYOUT["num_layers"] * 2 * 8 * 128 * 2 // 1024
    for mode, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) * 1e3 for k in rs[0]}
        med["first/steady"] = med["first"] / med["steady"]
        print(json.dumps({"engine": args.engine, "tokens": args.tokens, "kib": kib,
                          "reader": "warm" if args.warm_reader else "fresh", "mode": mode,
                          "rounds": len(rs), **{k: round(v, 3) for k, v in med.items()}}),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
