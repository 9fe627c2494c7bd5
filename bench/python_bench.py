#!/usr/bin/env python3
"""The Python package against the C++ library, and Mooncake through its wheel
against the wheel's own benchmark: every comparison taken in the same run.

    python3 bench/python_bench.py [--rounds 5] [--cases pull,overhead,mooncake,mooncake-bounce]
                                  [--engines shm,ucx] [--json FILE]

pull      the Llama-3-8B request (32 layers, 8 KV heads, head dim 128, bf16,
          16-token pages, 4096 tokens, scattered: 512 MiB) from a C++ owner
          (`mstar-kv serve`), pulled by `mstar-kv pull` (C++) and by the Python
          package, alternating, every page verified after each pull (outside
          the timing); each side's first pull of a round (it maps the peer)
          is left out; ratio = Python median / C++ median.
overhead  one start_async_retrieve + result() of a one-page request over shm
          in one process, from Python (median of --rounds timing loops) beside
          the C++ figure of bench/retrieve_bench.cpp (Google Benchmark, median
          of its repetitions): the difference is what Python adds per call.
mooncake  the Python Mooncake engine over the wheel's TransferEngine, reading
          128 blocks of 64 KiB per request from an owner process (the test
          peer, wheel engine too), beside the wheel's transfer_engine_bench
          (TCP, P2P handshake, --operation=read --block_size=65536
          --batch_size=128 --threads=1), alternating.
mooncake-bounce
          the cost of the wheel engine's bounce buffers (bounce=True, the
          default: nothing lands in the cache after a failed read) against
          reading straight into the cache (bounce=False), on the same owner,
          alternating, for a read of 8 MiB (64 KiB x 128) and one of 128 MiB
          (64 KiB x 2048); ratio = bounce median / direct.
Needs: `cmake --preset release && cmake --build build/release` (mstar-kv and
mstar_kv_retrieve_bench), the package installed (pip install ./python) and,
for mooncake, the wheel mooncake-transfer-engine-non-cuda.
"""
import argparse
import contextlib
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import timeit
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "release")
CLI = os.path.join(BUILD, "tools", "mstar-kv")
RETRIEVE_BENCH = os.path.join(BUILD, "bench", "mstar_kv_retrieve_bench")
PEER = os.path.join(ROOT, "python", "tests", "peer.py")

os.environ.setdefault("GLOG_minloglevel", "2")
UCX_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}

import mstar_kv as kv  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# -- pull: Python vs C++ on the Llama-3-8B request ---------------------------
def fetch(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.read()


def python_pulls(base, engine, repeat):
    seq = kv.SequenceInfo.from_bytes(fetch(base))
    meta = json.loads(fetch(base + "/meta"))
    lj = meta["layout"]
    layout = kv.KVLayout(lj["num_layers"], len(seq.page_indices), lj["page_size"],
                         lj["num_kv_heads"], lj["head_dim"], dtype=lj["dtype"],
                         has_v=lj["has_v"], cache_order=lj["cache_order"],
                         page_order=lj["page_order"])
    cache = kv.KVCache(layout)
    local = list(reversed(range(len(seq.page_indices))))  # as mstar-kv pull does
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("pull", "", engine), cache)
    view = cache.numpy()
    out = []
    for _ in range(repeat):
        view[...] = 0
        t0 = time.perf_counter()
        n = mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
        s = time.perf_counter() - t0
        v = cache.verify_pattern(meta["seed"], local, 0, seq.num_tokens)
        if not v["ok"]:
            raise SystemExit(f"python pull: {v['first_mismatch']}")
        out.append(n / s / 1e9)
    mgr.cleanup()
    return out


def cpp_pulls(port, repeat, env):
    r = subprocess.run([CLI, "pull", "--from", f"127.0.0.1:{port}", "--seq", "0", "--repeat",
                        str(repeat), "--keep"], capture_output=True, text=True, env=env,
                       timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"mstar-kv pull failed: {r.stdout}{r.stderr}")
    return [float(m) for m in re.findall(r"= ([0-9.]+) GB/s", r.stdout)]


def case_pull(engine, rounds, repeat=6):
    env = dict(os.environ, **(UCX_ENV if engine == "ucx" else {}))
    os.environ.update(env)
    port = free_port()
    serve = subprocess.Popen([CLI, "serve", "--engine", engine, "--listen", f"127.0.0.1:{port}",
                              "--tokens", "4096", "--sequences", "1",
                              "--lease-ms", "0"],  # rounds outlast the 60 s default lease
                             stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    base = f"http://127.0.0.1:{port}/v1/sequences/0"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                fetch(base)
                break
            except Exception:
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(
                        f"mstar-kv serve did not come up: {serve.stdout.read()}") from None
                time.sleep(0.2)
        cpp, py = [], []
        for _ in range(rounds):
            cpp += cpp_pulls(port, repeat, env)[1:]
            py += python_pulls(base, engine, repeat)[1:]
    finally:
        serve.terminate()
        serve.wait(timeout=30)
    return {"case": f"pull llama3-8b 4096 tokens scattered, {engine}",
            "cpp_gbps": median(cpp), "python_gbps": median(py),
            "ratio": median(py) / median(cpp), "samples": len(py),
            "cpp_range": [min(cpp), max(cpp)], "python_range": [min(py), max(py)]}


# -- overhead: one-page start_async_retrieve ----------------------------------
def python_one_page_us(tiny, rounds):
    layout = (kv.KVLayout(1, 16, 16, 1, 64) if tiny else kv.KVLayout(32, 16, 16, 8, 128))
    src = kv.KVCache(layout, "shared")
    owner = kv.KVTransferManager(kv.TransferEngineInfo("prefill", "", "shm"), src)
    info = owner.get_kv_transfer_info()
    dst = kv.KVCache(layout)
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("decode", "", "shm"), dst)
    local, remote = [3], [5]
    mgr.sync_retrieve(0, 16, local, remote, info)

    def once():
        mgr.start_async_retrieve(0, 16, local, remote, info).result()

    number = 20000 if tiny else 2000
    times = [t / number * 1e6 for t in timeit.repeat(once, number=number, repeat=rounds)]
    mgr.cleanup()
    owner.cleanup()
    return median(times)


def cpp_one_page_us(rounds):
    if not os.access(RETRIEVE_BENCH, os.X_OK):
        return {}
    r = subprocess.run([RETRIEVE_BENCH, "--benchmark_format=json",
                        f"--benchmark_repetitions={rounds}", "--benchmark_min_time=0.3"],
                       capture_output=True, text=True, timeout=600)
    out = {}
    for b in json.loads(r.stdout)["benchmarks"]:
        parts = b["run_name"].split("/")  # OnePage/<geometry>/<stats on>/real_time
        if b.get("aggregate_name") == "median" and parts[0] == "OnePage" and parts[2] == "1":
            out[parts[1]] = b["real_time"]
    return out


def case_overhead(rounds):
    cpp = cpp_one_page_us(rounds)
    rows = []
    for name, tiny in (("llama3_8b", False), ("tiny", True)):
        py = python_one_page_us(tiny, rounds)
        c = cpp.get(name, float("nan"))
        rows.append({"case": f"one-page start_async_retrieve+result, shm, {name}",
                     "python_us": py, "cpp_us": c, "python_overhead_us": py - c})
    return rows


# -- mooncake: the wheel engine vs transfer_engine_bench ----------------------
def mooncake_bench_binary():
    import mooncake
    b = os.path.join(os.path.dirname(mooncake.__file__), "transfer_engine_bench")
    return b if os.access(b, os.X_OK) else None


def run_transfer_engine_bench(binary, seconds):
    env = {k: v for k, v in os.environ.items()
           if k not in ("MC_TCP_ENABLE_CONNECTION_POOL", "MC_LOG_LEVEL", "GLOG_minloglevel")}
    common = ["--metadata_server=P2PHANDSHAKE", "--protocol=tcp",
              "--local_server_name=127.0.0.1", "--buffer_size=268435456", "--logtostderr=1"]
    target = subprocess.Popen([binary, "--mode=target", *common], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=env)
    try:
        peer, log = None, ""
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and peer is None:
            line = target.stdout.readline()
            if not line:
                break
            log += line
            m = re.search(r"listening on (127\.0\.0\.1:[0-9]+)", log)
            if m and "TcpTransport: listen" in log:
                peer = m.group(1)
        if peer is None:
            raise SystemExit(f"transfer_engine_bench target did not come up: {log[-500:]}")
        time.sleep(0.5)
        r = subprocess.run([binary, "--mode=initiator", *common, f"--segment_id={peer}",
                            "--operation=read", "--block_size=65536", "--batch_size=128",
                            "--threads=1", f"--duration={seconds}"], capture_output=True,
                           text=True, env=env, timeout=seconds + 60)
        m = re.search(r"Test completed:.*throughput ([0-9.]+) GB/s", r.stdout + r.stderr)
        if not m:
            raise SystemExit(f"transfer_engine_bench failed: {(r.stdout + r.stderr)[-500:]}")
        return float(m.group(1))
    finally:
        target.terminate()
        try:
            target.wait(timeout=10)
        except subprocess.TimeoutExpired:
            target.kill()


def wheel_engine_gbps(seq, seconds, pages=256, te=None, **engine_kw):
    from mooncake.engine import TransferEngine
    layout = kv.KVLayout(1, pages, 16, 8, 256)  # blocks of 64 KiB
    cache = kv.KVCache(layout)
    if te is None:
        te = TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    engine = kv.MooncakeKVTransferEngine(cache, "bench", te, **engine_kw)
    mgr = kv.KVTransferManager(engine, cache)
    local = list(range(len(seq.page_indices)))
    mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
    moved, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        moved += mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                   seq.kv_transfer_info)
    gbps = moved / (time.perf_counter() - t0) / 1e9
    spans = len(kv.plan_copy_addresses(layout, 0, layout, 0, kv.plan_reads(
        layout, 0, seq.num_tokens, local, seq.page_indices))[2])
    mgr.cleanup()
    return gbps, spans


@contextlib.contextmanager
def mooncake_owner(pages, tokens):
    """The test peer owning `tokens` tokens of one layer of 64 KiB blocks
    (8 heads x 256) in a cache of `pages` pages, through the wheel engine:
    yields its SequenceInfo; stopped (stdin closed) on leaving."""
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python", "tests"))
    owner = subprocess.Popen([sys.executable, PEER, "mooncake", "--layers", "1", "--pages",
                              str(pages), "--heads", "8", "--head-dim", "256", "--tokens",
                              str(tokens)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = ""
        while not line.startswith("READY"):
            line = owner.stdout.readline()
            if not line:
                raise SystemExit("the Mooncake owner did not start")
        yield kv.SequenceInfo.from_bytes(bytes.fromhex(line.split()[1]))
    finally:
        owner.stdin.close()
        owner.wait(timeout=30)


def case_mooncake(rounds, seconds=2):
    binary = mooncake_bench_binary()
    # 64 pages x (K, V) of one layer: 128 blocks of 64 KiB, scattered.
    with mooncake_owner(256, 1024) as seq:
        ours, theirs, spans = [], [], 0
        for _ in range(rounds):
            g, spans = wheel_engine_gbps(seq, seconds)
            ours.append(g)
            if binary:
                theirs.append(run_transfer_engine_bench(binary, seconds))
    return {"case": f"mooncake wheel, TCP, 64 KiB x 128 ({spans} spans after coalescing)",
            "mstar_kv_gbps": median(ours), "transfer_engine_bench_gbps": median(theirs),
            "ratio": median(ours) / median(theirs) if theirs else float("nan"),
            "mstar_kv_range": [min(ours), max(ours)],
            "bench_range": [min(theirs), max(theirs)] if theirs else None}


def case_mooncake_bounce(rounds, seconds=2):
    from mooncake.engine import TransferEngine
    out = []
    with mooncake_owner(2048, 16384) as big:
        small = kv.SequenceInfo(big.seq_id, 1024, big.page_indices[:64], big.kv_transfer_info,
                               page_size=big.page_size)
        te = TransferEngine()  # one for every engine: one connection to the owner
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        for name, seq in (("64 KiB x 128", small), ("64 KiB x 2048", big)):
            on, off = [], []
            for _ in range(rounds):
                on.append(wheel_engine_gbps(seq, seconds, 2048, te, bounce=True)[0])
                off.append(wheel_engine_gbps(seq, seconds, 2048, te, bounce=False)[0])
            out.append({"case": f"mooncake wheel bounce buffers, TCP, {name}",
                        "bounce_gbps": median(on), "direct_gbps": median(off),
                        "ratio": median(on) / median(off), "bounce_range": [min(on), max(on)],
                        "direct_range": [min(off), max(off)]})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cases", default="pull,overhead,mooncake")
    p.add_argument("--engines", default="shm,ucx")
    p.add_argument("--json")
    args = p.parse_args()
    cases = args.cases.split(",")
    results = []
    if "overhead" in cases:
        for r in case_overhead(args.rounds):
            results.append(r)
            print(f"{r['case']}: python {r['python_us']:.1f} us, C++ {r['cpp_us']:.1f} us, "
                  f"python adds {r['python_overhead_us']:.1f} us", flush=True)
    if "pull" in cases:
        for engine in args.engines.split(","):
            r = case_pull(engine, args.rounds)
            results.append(r)
            print(f"{r['case']}: python {r['python_gbps']:.2f} GB/s "
                  f"[{r['python_range'][0]:.2f}, {r['python_range'][1]:.2f}], C++ "
                  f"{r['cpp_gbps']:.2f} GB/s [{r['cpp_range'][0]:.2f}, {r['cpp_range'][1]:.2f}]"
                  f", ratio {r['ratio']:.3f} ({r['samples']} pulls each)", flush=True)
    if "mooncake" in cases:
        r = case_mooncake(args.rounds)
        results.append(r)
        print(f"{r['case']}: mstar-kv {r['mstar_kv_gbps']:.2f} GB/s, transfer_engine_bench "
              f"{r['transfer_engine_bench_gbps']:.2f} GB/s, ratio {r['ratio']:.2f}", flush=True)
    if "mooncake-bounce" in cases:
        for r in case_mooncake_bounce(args.rounds):
            results.append(r)
            print(f"{r['case']}: bounce {r['bounce_gbps']:.2f} GB/s "
                  f"[{r['bounce_range'][0]:.2f}, {r['bounce_range'][1]:.2f}], direct "
                  f"{r['direct_gbps']:.2f} GB/s [{r['direct_range'][0]:.2f}, "
                  f"{r['direct_range'][1]:.2f}], ratio {r['ratio']:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
