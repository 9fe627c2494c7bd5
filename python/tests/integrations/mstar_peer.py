"""A producer worker as upstream mstar runs one, over
mstar_kv.integrations.mstar: its own KVCache (torch, CPU) filled with
mstar_upstream.content(cache, seed), a KVTransferManager over a
LocalTransferEngine (shm) or a MooncakeTransferEngine (the wheel).

    python mstar_peer.py ORDER ENGINE [--resource-key K] [--seed S] [--pages N] [--layers N]

Prints "READY <pid>", then answers one line per command on stdin:
    publish RID LABEL P,P,.. SEQ_LEN GEN|-   "INFO <hex of the pickled descriptor>" (or "NONE")
    rewrite SEED P,P,..   the pages get content(cache, SEED)'s bytes: "OK"
    remove RID            remove_request: "OK"
    cleanup               "OK"
    quit                  exit
"""
import argparse
import pickle
import sys

import mstar_upstream as up
from mstar_kv.integrations.mstar import KVTransferManager, TransferEngineInfo


def main():
    p = argparse.ArgumentParser()
    p.add_argument("order", choices=up.ORDERS)
    p.add_argument("engine", choices=("local", "mooncake"))
    p.add_argument("--resource-key", default="kv")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--pages", type=int, default=8)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args()

    cache = up.KVCache(args.order, layers=args.layers, pages=args.pages)
    cache.tensor.copy_(up.content(cache, args.seed))
    te = (up.LocalTransferEngine("producer") if args.engine == "local"
          else up.MooncakeTransferEngine("127.0.0.1"))
    manager = KVTransferManager(TransferEngineInfo("producer", "session", te), cache,
                                resource_key=args.resource_key)
    print("READY", __import__("os").getpid(), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "publish":
            rid, label, pages, seq_len, gen = cmd[1:6]
            info = manager.get_kv_transfer_info(
                request_id=rid, label=label, page_indices=[int(x) for x in pages.split(",")],
                seq_len=int(seq_len), reset_generation=None if gen == "-" else int(gen))
            print("NONE" if info is None else "INFO " + pickle.dumps(info).hex(), flush=True)
        elif cmd[0] == "rewrite":
            fresh = up.content(cache, int(cmd[1]))
            for page in (int(x) for x in cmd[2].split(",")):
                cache.page(page).copy_(cache.page(page, fresh))
            print("OK", flush=True)
        elif cmd[0] == "remove":
            manager.remove_request(cmd[1])
            print("OK", flush=True)
        elif cmd[0] == "cleanup":
            manager.cleanup()
            print("OK", flush=True)
        elif cmd[0] == "quit":
            break
    manager.cleanup()


if __name__ == "__main__":
    main()
