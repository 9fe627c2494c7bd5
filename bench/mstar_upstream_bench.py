#!/usr/bin/env python3
"""Upstream mstar's own same-host KV transfer against mstar_kv.integrations.mstar
on one request, in two processes: publish time, pull time, what a kill -9 of
the producer leaves in /dev/shm.

    python3 bench/mstar_upstream_bench.py --upstream DIR [--tokens 4096]
        [--runs 5] [--private-shm] [--json FILE]

--upstream is a work tree of mstar-project/mstar, never part of this repo:
  git --git-dir=/work/.mirror/mstar-project+mstar/repo archive 67f53ba8 \
      | tar -x -C /work/upstream-src/pr221
(67f53ba8, refs/pull/221/head, is the only revision of the fetched snapshot
whose transfer module has the shm engine). Only upstream's transfer module is
imported: mstar.engine.kv_store (ShmKVTransferEngine, KVReadInfo) and what
that file imports, which needs pyzmq and msgpack (PyPI) beside torch.
Nothing of it is stubbed.

The request: Llama-3-8B geometry (32 layers, 8 KV heads, head_dim 128, bf16,
16-token pages) in upstream's [L, P, 2, T, H, D] cache, 4096 tokens = 256
pages (512 MiB) scattered over a 320-page CPU tensor that the producer's
torch allocated (private memory, as upstream's engine has it). The
consumer's pages are another scattered set. Both implementations get the
same calls, as upstream's manager makes them:

  producer  eng = ShmKVTransferEngine(kv_cache=tensor, entity_id="producer")
            info = eng.get_kv_transfer_info(request_id=rid, label="main",
                                            page_indices=pages, seq_len=4096)
  consumer  eng = ShmKVTransferEngine(kv_cache=tensor, entity_id="consumer")
            fut = eng.read_batched_async(info, read_info)  # 256 pages x 32
            fut.result() if fut is not None                # layers, planned
                                                           # as its manager does
Rows beside those: mstar_kv's manager pull (start_async_retrieve, planned in
C++); "memfd", the same request served from a cache mstar_kv allocated in
shared memory (what cross-memory attach costs against a mapping); and one
plain copy of the request's bytes in the consumer (the reference: a pull
cannot do less). Each run publishes a new request, the consumer pulls it
(timed: the call and its wait), checks every byte of its pages and that no
other page changed (untimed), and the producer removes the request. The
implementations run side by side, one run of each per round, so that load
on the host weighs on all alike; medians of --runs, first runs included.
Then each producer publishes once more, its consumer pulls, the producer
gets kill -9; the bench lists what is new in /dev/shm, tries one more read
of the dead producer's descriptor, and removes what upstream left (after
counting). --private-shm runs it all in a private mount namespace with a
fresh tmpfs on /dev/shm (root), so that no other process's files count.
"""
import argparse
import datetime
import json
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import statistics
import sys
import time

LAYERS, HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
CACHE_PAGES = 320
SHM = "/dev/shm"
IMPLS = ("upstream", "mstar_kv", "mstar_kv_memfd")


def shape():
    return (LAYERS, CACHE_PAGES, 2, PAGE, HEADS, HEAD_DIM)  # upstream's [L, P, 2, T, H, D]


def content(seed: int):
    """A cache's bytes, a pure function of the seed (random 16-bit words)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-32768, 32768, shape(), dtype=torch.int16, generator=g)
    return words.view(torch.bfloat16)


def page_sets(tokens: int):
    """(producer pages, consumer pages) of the request: scattered, distinct."""
    import random
    n = -(-tokens // PAGE)
    rng = random.Random(1234)
    return rng.sample(range(CACHE_PAGES), n), rng.sample(range(CACHE_PAGES), n)


def import_impl(impl: str, upstream: str):
    if impl == "upstream":
        sys.path.insert(0, upstream)
        from mstar.engine import kv_store as mod  # upstream's transfer module
        return mod.ShmKVTransferEngine, mod.KVReadInfo
    from mstar_kv.integrations import mstar as mod  # what upstream swaps in (both mstar_kv*)
    return mod.ShmKVTransferEngine, mod.KVReadInfo


def shm_used() -> int:
    st = os.statvfs(SHM)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def shm_entries() -> dict:
    """Every file under /dev/shm (path -> bytes)."""
    out = {}
    for root, dirs, files in os.walk(SHM):
        for name in files + [d for d in dirs if not os.listdir(os.path.join(root, d))]:
            path = os.path.join(root, name)
            try:
                out[path] = os.lstat(path).st_size
            except OSError:
                pass
    return out


class SharedCacheProducer:
    """mstar_kv_memfd: the same request served from a cache mstar_kv allocated
    (an anonymous memfd, mapped by readers), through mstar_kv's request-scoped
    manager: what cross-memory attach costs against it."""

    def __init__(self):
        import mstar_kv as kv
        import torch
        layout = kv.KVLayout(num_layers=LAYERS, num_pages=CACHE_PAGES, page_size=PAGE,
                             num_kv_heads=HEADS, head_dim=HEAD_DIM, dtype="bf16",
                             cache_order="layer_page")
        self.cache = kv.KVCache(layout, memory="shared")
        tensor = torch.from_dlpack(self.cache)
        assert tuple(tensor.shape) == shape() and tensor.data_ptr() == self.cache.data_ptr
        tensor.copy_(content(seed=7))
        self.manager = kv.KVTransferManager(kv.TransferEngineInfo("producer", "", "shm"),
                                            self.cache)
        self.get_kv_transfer_info = self.manager.get_kv_transfer_info
        self.remove_request = self.manager.remove_request
        self.shutdown = self.manager.cleanup


def producer(conn, impl: str, upstream: str, tokens: int) -> None:
    if impl == "mstar_kv_memfd":
        eng = SharedCacheProducer()
    else:
        engine_cls, _ = import_impl(impl, upstream)
        tensor = content(seed=7)  # private memory this process allocated
        eng = engine_cls(kv_cache=tensor, entity_id="producer")
    pages, _ = page_sets(tokens)
    conn.send(("ready", os.getpid()))
    while True:
        cmd, rid = conn.recv()
        if cmd == "publish":
            used = shm_used()
            t0 = time.perf_counter()
            info = eng.get_kv_transfer_info(request_id=rid, label="main", page_indices=pages,
                                            seq_len=tokens)
            dt = time.perf_counter() - t0
            conn.send((pickle.dumps(info), dt, shm_used() - used))
        elif cmd == "remove":
            eng.remove_request(rid)
            conn.send("ok")
        elif cmd == "stop":
            eng.shutdown()
            conn.send("ok")
            return


def consumer(conn, impl: str, upstream: str, tokens: int) -> None:
    import torch
    engine_cls, read_info_cls = import_impl(impl, upstream)
    expected = content(seed=7).view(torch.int16)
    tensor = torch.zeros(shape(), dtype=torch.bfloat16)
    eng = engine_cls(kv_cache=tensor, entity_id="consumer")
    remote, local = page_sets(tokens)
    # As upstream's PagedAllocationManager.start_async_retrieve plans a pull from 0.
    read_info = []
    for pos, (lp, rp) in enumerate(zip(local, remote)):
        end = PAGE if pos != len(local) - 1 else (tokens % PAGE or PAGE)
        read_info += [read_info_cls(layer_idx=layer, local_page_idx=lp, remote_page_idx=rp,
                                    token_start=0, token_end=end) for layer in range(LAYERS)]
    others = sorted(set(range(CACHE_PAGES)) - set(local))
    conn.send(("ready", os.getpid()))
    while True:
        cmd, arg, how = conn.recv()
        if cmd == "stop":
            eng.shutdown()
            conn.send("ok")
            return
        if cmd == "memcpy":  # the reference: one copy of the request's bytes
            n = arg // 2
            t0 = time.perf_counter()
            tensor.view(-1).view(torch.int16)[:n].copy_(expected.view(-1)[:n])
            conn.send((time.perf_counter() - t0, "ok"))
            continue
        info = pickle.loads(arg)
        tensor.zero_()
        t0 = time.perf_counter()
        try:
            if how == "retrieve":  # mstar_kv's manager: planned in C++
                fut = eng.retrieve(0, tokens, local, remote, info)
            else:
                fut = eng.read_batched_async(info, read_info)
            if fut is not None:
                fut.result()
        except Exception as error:  # noqa: BLE001 - reported, not hidden
            conn.send((None, f"{type(error).__name__}: {error}"[:300]))
            continue
        dt = time.perf_counter() - t0
        got = tensor.view(torch.int16)
        ok = all(torch.equal(got[:, lp, :, :PAGE], expected[:, rp, :, :PAGE])
                 for lp, rp in zip(local[:-1], remote[:-1]))
        end = tokens % PAGE or PAGE
        ok = ok and torch.equal(got[:, local[-1], :, :end], expected[:, remote[-1], :, :end])
        ok = ok and not bool(got[:, local[-1], :, end:].any()) and not bool(got[:, others].any())
        conn.send((dt, "ok" if ok else "WRONG BYTES"))


def start(ctx, target, *args):
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=True)
    proc.start()
    child.close()  # so that a child that dies before "ready" is an EOFError here
    tag, _ = parent.recv()
    assert tag == "ready"
    return proc, parent


def hows_of(impl: str) -> list:
    return ["read_batched_async"] + (["retrieve"] if impl.startswith("mstar_kv") else [])


def one_run(impl: str, pc, cc, rid: str, how: str, res: dict) -> None:
    pc.send(("publish", rid))
    blob, dt, grew = pc.recv()
    if how == "read_batched_async":
        res["publish_s"].append(dt)
        res["publish_shm_bytes"].append(grew)
    cc.send(("pull", blob, how))
    dt, status = cc.recv()
    if status != "ok":
        raise SystemExit(f"{impl} pull ({how}) {rid}: {status}")
    res[f"pull_{how}_s"].append(dt)
    pc.send(("remove", rid))
    pc.recv()


def kill_test(impl: str, prod, pc, cons, cc, res: dict) -> None:
    """kill -9 of the producer with one request published and pulled: what
    is new in /dev/shm since just before that publication (a window of
    seconds, so that other processes of the host hardly ever add to it; the
    paths are kept with the numbers)."""
    before = shm_entries()
    pc.send(("publish", "req-killed"))
    blob, _, _ = pc.recv()
    cc.send(("pull", blob, "read_batched_async"))
    cc.recv()
    os.kill(prod.pid, signal.SIGKILL)
    prod.join()
    time.sleep(0.2)
    left = {p: n for p, n in shm_entries().items() if p not in before}
    res["left_in_dev_shm"] = {"entries": len(left), "bytes": sum(left.values()),
                              "paths": sorted(left)[:8]}
    cc.send(("pull", blob, "read_batched_async"))
    _, status = cc.recv()
    res["read_after_kill"] = status
    cc.send(("stop", None, None))
    cc.recv()
    cons.join()
    for path in left:  # upstream's files of a dead producer: nobody else removes them
        if os.path.isfile(path):
            os.unlink(path)


def run_all(args) -> dict:
    """Every implementation's pair up at once, their runs interleaved (a
    round = one run of each), so that load on the host weighs on all alike."""
    ctx = mp.get_context("spawn")
    pairs, out = {}, {}
    for impl in IMPLS:
        pairs[impl] = (*start(ctx, producer, impl, args.upstream, args.tokens),
                       *start(ctx, consumer, impl, args.upstream, args.tokens))
        out[impl] = {"publish_s": [], "publish_shm_bytes": [],
                     **{f"pull_{h}_s": [] for h in hows_of(impl)}}
    out["memcpy_s"] = []
    for how in ("read_batched_async", "retrieve"):
        for run in range(args.runs):
            if how == "read_batched_async":
                cc = pairs[IMPLS[0]][3]
                cc.send(("memcpy", LAYERS * 2 * args.tokens * HEADS * HEAD_DIM * 2, None))
                out["memcpy_s"].append(cc.recv()[0])
            for impl in IMPLS:
                if how in hows_of(impl):
                    _, pc, _, cc = pairs[impl]
                    one_run(impl, pc, cc, f"req-{how}-{run}", how, out[impl])
    for impl in IMPLS:
        kill_test(impl, *pairs[impl], out[impl])
    return out


def med(xs):
    return statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--upstream", required=True, help="work tree of mstar-project/mstar")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", help="write the raw numbers here")
    ap.add_argument("--private-shm", action="store_true",
                    help="run in a private mount namespace with a fresh tmpfs on /dev/shm "
                         "(root; unshare -m), so that only this bench's files are counted")
    args = ap.parse_args()
    if args.private_shm and os.environ.get("MSTAR_UPSTREAM_BENCH_NS") != "1":
        script = 'mount -t tmpfs -o size=8g,mode=1777 tmpfs /dev/shm && exec "$@"'
        os.environ["MSTAR_UPSTREAM_BENCH_NS"] = "1"
        os.execvp("unshare", ["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                              "sh", sys.executable, *sys.argv])
    if not os.path.isfile(os.path.join(args.upstream, "mstar", "engine", "kv_store.py")):
        raise SystemExit(f"--upstream {args.upstream}: no mstar/engine/kv_store.py there")
    if not 0 < args.tokens <= CACHE_PAGES * PAGE:
        raise SystemExit(f"--tokens {args.tokens}: must be in 1..{CACHE_PAGES * PAGE}")
    os.environ["MSTAR_KV_SHM_DIR"] = os.path.join(SHM, f"mstar_upstream_bench_{os.getpid()}")
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
           "tokens": args.tokens, "runs": args.runs,
           "request_bytes": LAYERS * 2 * args.tokens * HEADS * HEAD_DIM * 2}
    out["loadavg_before"] = os.getloadavg()
    try:
        out.update(run_all(args))
        out["loadavg_after"] = os.getloadavg()
    finally:
        shutil.rmtree(os.environ["MSTAR_KV_SHM_DIR"], ignore_errors=True)
    up, mk = out["upstream"], out["mstar_kv"]
    mib = out["request_bytes"] / 2**20
    print(f"{args.tokens} tokens ({mib:.0f} MiB), medians of {args.runs} [min, max]; load "
          f"average {out['loadavg_before'][0]:.1f} before, {out['loadavg_after'][0]:.1f} after:")
    rows = [("upstream", "publish", up["publish_s"]),
            ("mstar_kv", "publish", mk["publish_s"]),
            ("upstream", "pull (read_batched_async)", up["pull_read_batched_async_s"]),
            ("mstar_kv", "pull (read_batched_async)", mk["pull_read_batched_async_s"]),
            ("mstar_kv", "pull (start_async_retrieve)", mk["pull_retrieve_s"]),
            ("memfd", "publish", out["mstar_kv_memfd"]["publish_s"]),
            ("memfd", "pull (read_batched_async)",
             out["mstar_kv_memfd"]["pull_read_batched_async_s"]),
            ("memfd", "pull (start_async_retrieve)", out["mstar_kv_memfd"]["pull_retrieve_s"]),
            ("reference", "memcpy of the request's bytes", out["memcpy_s"])]
    for impl, what, xs in rows:
        print(f"  {impl:9} {what:31} {med(xs) * 1e3:9.2f} ms [{min(xs) * 1e3:.2f}, "
              f"{max(xs) * 1e3:.2f}]  {mib / med(xs) / 1024:6.2f} GiB/s")
    ratio = med(up["pull_read_batched_async_s"]) / med(mk["pull_read_batched_async_s"])
    out["pull_speedup"] = ratio
    out["publish_speedup"] = med(up["publish_s"]) / med(mk["publish_s"])
    print(f"  pull: mstar_kv {ratio:.1f}x faster; publish {out['publish_speedup']:.0f}x")
    for impl in IMPLS:
        r = out[impl]
        print(f"  {impl:14} publish wrote {med(r['publish_shm_bytes']) / 2**20:.0f} MiB to "
              f"/dev/shm; after kill -9: {r['left_in_dev_shm']['entries']} entries, "
              f"{r['left_in_dev_shm']['bytes'] / 2**20:.0f} MiB left; read after kill: "
              f"{r['read_after_kill']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
