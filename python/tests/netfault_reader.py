"""The decode side of the wheel's network fault tests (test_netfault_wheel.py),
run in its own network namespace: a reader over the Mooncake wheel's
TransferEngine that pulls one sequence of peer.py's again and again while
the test breaks the network under it, and reports what each pull did (the
Python twin of tests/reliability/net_reader.cpp).

    python netfault_reader.py HOST SEQ_HEX [geometry as peer.py] --timeout S --grace S
                              [--no-bounce]

HOST is this namespace's address (the TransferEngine serves there);
--no-bounce makes the engine read straight into the cache (bounce=False).
Prints "READY", then answers commands on stdin, one a line:
    pull     zeroes the cache, starts a pull of the whole sequence, prints
             "STARTED", then one of
               OK ms=M bytes=B
               CORRUPT ms=M ...
               FAIL ms=M code=ErrorClass landed=L% late=Z error=...
             (landed: the share of the sequence's pages holding bytes when
             the future failed; late: bytes of the cache that changed in the
             grace period after it failed; must be 0)
    renew    a new engine (and manager) over the same TransferEngine: the
             wheel engine refuses a peer that failed until then
    quit
"""
import argparse
import os
import sys
import time

os.environ.setdefault("GLOG_minloglevel", "2")

import mstar_kv as kv
import numpy as np
from peer import SEED, add_geometry_args


def main():
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("seq_hex")
    add_geometry_args(p)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--grace", type=float, default=2.0)
    p.add_argument("--no-bounce", action="store_true")
    args = p.parse_args()

    from mooncake.engine import TransferEngine
    seq = kv.SequenceInfo.from_bytes(bytes.fromhex(args.seq_hex))
    layout = kv.KVLayout(args.layers, args.pages, args.page_size, args.heads, args.head_dim,
                         dtype=args.dtype)
    cache = kv.KVCache(layout, "host")
    te = TransferEngine()
    if te.initialize(args.host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise SystemExit("mooncake initialize failed")
    local = list(range(len(seq.page_indices)))
    state = {}

    def renew():
        if "engine" in state:
            state["engine"].shutdown()
        state["engine"] = kv.MooncakeKVTransferEngine(cache, "decode", te, timeout=args.timeout,
                                                      hostname=args.host,
                                                      bounce=not args.no_bounce)
        state["manager"] = kv.KVTransferManager(state["engine"], cache)

    def say(line):
        print(line, flush=True)

    view = cache.numpy().view(np.uint8).reshape(-1)

    def pull():
        view[:] = 0
        t0 = time.monotonic()
        try:
            fut = state["manager"].start_async_retrieve(0, seq.num_tokens, local,
                                                        seq.page_indices, seq.kv_transfer_info)
        except kv.KVTransferError as e:
            say("STARTED")
            return failed(t0, e)
        say("STARTED")
        while not fut.done():
            time.sleep(0.002)
        ms = (time.monotonic() - t0) * 1e3
        try:
            nbytes = fut.result()
        except kv.KVTransferError as e:
            return failed(t0, e)
        v = cache.verify_pattern(SEED + seq.seq_id, local, 0, seq.num_tokens)
        if not v["ok"]:
            return say(f"CORRUPT ms={ms:.1f} mismatched={v['mismatched_blocks']} "
                       f"first={v['first_mismatch']}")
        say(f"OK ms={ms:.1f} bytes={nbytes}")

    def failed(t0, e):
        ms = (time.monotonic() - t0) * 1e3
        snapshot = view.copy()
        landed = np.count_nonzero(snapshot[::64]) * 100 * args.pages // \
            (len(local) * snapshot[::64].size)
        time.sleep(args.grace)
        late = int(np.count_nonzero(view != snapshot))
        msg = str(e).replace("\n", " ")
        say(f"FAIL ms={ms:.1f} code={type(e).__name__} landed={landed}% late={late} error={msg}")

    renew()
    say("READY")
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "pull":
            pull()
        elif cmd[0] == "renew":
            renew()
            say("RENEWED")
        elif cmd[0] == "quit":
            break
        else:
            say(f"ERR unknown command {cmd[0]!r}")
    state["engine"].shutdown()


if __name__ == "__main__":
    main()
