"""Shared pieces of bench/replay.py: the trace and its scaling, the cache
geometry, the decode's block cache, and the report.

The trace's unit of sharing is a 512-token block named by a hash id. With
--length-scale s a block becomes round(512 * s) tokens (a whole number of
16-token pages), and a request's prompt ceil(input_length * block / 512)
tokens, so every request keeps its number of blocks and its sharing.
"""
import collections
import json
import math
import statistics
from pathlib import Path

_ROOT = Path(__file__).resolve().parent.parent
# The full public trace beside the checkout; the excerpt in the tree otherwise.
EXCERPT = str(_ROOT / "bench" / "traces" / "mooncake_fast25_excerpt.jsonl")
_FULL = _ROOT.parent / "shared" / "traces" / "synthetic_trace.jsonl"
TRACE = str(_FULL) if _FULL.exists() else EXCERPT
TRACE_BLOCK = 512
PAGE_SIZE = 16
KV_HEADS = 8
HEAD_DIM = 128
BF16 = 2
# Pattern seeds start here so that hash id 0 is not seed 0.
SEED_BASE = 1 << 20
# Latency buckets by the trace's prompt length (before scaling), in tokens.
BUCKETS = ((4096, "<4K"), (16384, "4-16K"), (65536, "16-64K"), (None, ">64K"))


def page_bytes(layers):
    """Bytes of one page over every layer (K and V)."""
    return layers * 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM * BF16


def token_bytes(layers):
    return layers * 2 * KV_HEADS * HEAD_DIM * BF16


def block_tokens(length_scale):
    """Tokens of one hash block after scaling: whole pages, at least one."""
    pages = max(1, round(TRACE_BLOCK * length_scale / PAGE_SIZE))
    return pages * PAGE_SIZE


def load_trace(path, start, count, length_scale):
    """Requests [start, start + count) of the trace, arrival times rebased to
    the first one, prompt lengths scaled to whole blocks' worth of tokens."""
    bt = block_tokens(length_scale)
    out = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if count and len(out) >= count:
                break
            r = json.loads(line)
            blocks = list(r["hash_ids"])
            tokens = min(len(blocks) * bt, math.ceil(r["input_length"] * bt / TRACE_BLOCK))
            out.append({"req": len(out), "trace_index": i, "t_ms": r["timestamp"],
                        "trace_tokens": r["input_length"], "tokens": max(1, tokens),
                        "blocks": blocks})
    if out:
        t0 = out[0]["t_ms"]
        for r in out:
            r["t_ms"] -= t0
    return out


def block_spans(tokens, bt):
    """(block index, first token, token count) of every block of a prompt."""
    return [(b, b * bt, min(bt, tokens - b * bt)) for b in range(math.ceil(tokens / bt))]


class BlockCache:
    """A decode's prefix cache: hash id -> its local pages, least recently
    used first out, over a fixed set of pages. Only whole blocks are kept: a
    request's partial last block is pulled every time, as an engine's prefix
    cache keeps whole blocks only."""

    def __init__(self, num_pages):
        self.free = collections.deque(range(num_pages))
        self.lru = collections.OrderedDict()  # hash id -> [pages]
        self.evicted = 0

    def lookup(self, h):
        pages = self.lru.get(h)
        if pages is not None:
            self.lru.move_to_end(h)
        return pages

    def take(self, n, pinned, evicted_out):
        """n free pages, evicting the least recently used blocks not in
        `pinned` (the request's own hits); None if that is not enough."""
        while len(self.free) < n:
            victim = next((h for h in self.lru if h not in pinned), None)
            if victim is None:
                return None
            self.free.extend(self.lru.pop(victim))
            evicted_out.append(victim)
            self.evicted += 1
        return [self.free.popleft() for _ in range(n)]

    def give_back(self, pages):
        self.free.extend(pages)

    def insert(self, h, pages):
        """Keeps a pulled whole block; False (pages returned) if h is held
        already (a block named twice in one request)."""
        if h in self.lru:
            self.free.extend(pages)
            return False
        self.lru[h] = pages
        return True


def percentile(xs, q):
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def bucket_of(trace_tokens):
    for limit, name in BUCKETS:
        if limit is None or trace_tokens < limit:
            return name
    return BUCKETS[-1][1]


def summarize(cfg, records, wall_s):
    """One run's figures from its per-request records."""
    ok = [r for r in records if r["status"] == "ok"]
    failed = [r for r in records if r["status"] != "ok"]
    pulled = sum(r.get("bytes", 0) for r in ok)
    lat = collections.defaultdict(list)
    for r in ok:
        if r.get("bytes", 0) > 0:
            lat[bucket_of(r["trace_tokens"])].append(r["pull_s"])
    buckets = {}
    for _, name in BUCKETS:
        xs = lat.get(name, [])
        buckets[name] = {"n": len(xs), "p50_ms": percentile(xs, 0.5) * 1e3,
                         "p99_ms": percentile(xs, 0.99) * 1e3,
                         "max_ms": max(xs) * 1e3 if xs else float("nan")}
    e2e = [r["e2e_s"] for r in ok]
    return {
        **cfg, "requests": len(records), "completed": len(ok), "failed": len(failed),
        "mismatches": sum(1 for r in records if r["status"] == "mismatch"),
        "wall_s": wall_s, "req_per_s": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "bytes_pulled": pulled, "gbps": pulled / wall_s / 1e9 if wall_s > 0 else float("nan"),
        "bytes_saved": sum(r.get("saved", 0) for r in ok),
        "bytes_verified": sum(r.get("verified", 0) for r in ok),
        "e2e_p50_ms": percentile(e2e, 0.5) * 1e3, "e2e_p99_ms": percentile(e2e, 0.99) * 1e3,
        "pull_latency": buckets,
        "failures": [{"req": r["req"], "prefill": r["prefill"], "decode": r.get("decode"),
                      "status": r["status"], "why": r.get("why", "")} for r in failed],
    }


def fmt_ms(x):
    return "-" if x != x else f"{x:.1f}"


def medians(results):
    """Per (engine, size, route), the median of its rounds' figures (each
    percentile the median of the rounds' percentiles); counts are totals,
    and `req_per_s_runs` lists every round's rate."""
    groups = collections.OrderedDict()
    for s in results:
        if "skipped" not in s:
            groups.setdefault((s["engine"], s["size"], s["route"]), []).append(s)
    out = []
    for (engine, size, route), runs in groups.items():
        def med(f, runs=runs):
            return statistics.median(f(r) for r in runs)
        buckets = {name: {"n": sum(r["pull_latency"][name]["n"] for r in runs),
                          **{k: med(lambda r, k=k, n=name: r["pull_latency"][n][k])
                             for k in ("p50_ms", "p99_ms", "max_ms")}}
                   for _, name in BUCKETS}
        out.append({
            "engine": engine, "size": size, "route": route, "rounds": len(runs),
            "requests": sum(r["requests"] for r in runs),
            "completed": sum(r["completed"] for r in runs),
            "failed": sum(r["failed"] for r in runs),
            **{k: med(lambda r, k=k: r[k]) for k in ("req_per_s", "gbps", "bytes_pulled",
                                                     "bytes_saved", "e2e_p50_ms")},
            "pull_latency": buckets,
            "req_per_s_runs": [round(r["req_per_s"], 1) for r in runs],
        })
    return out


def table(results, rounds=False):
    """A markdown table of runs (rows) and their figures; `rounds`: a column
    for each run's round."""
    names = [name for _, name in BUCKETS]
    head = ["engine", "PxD", "route"] + (["round"] if rounds else [])
    head += ["req", "ok", "fail", "req/s", "GB/s", "GB pulled", "GB saved", "e2e p50 ms"]
    head += [f"pull {n} p50/p99/max ms (n)" for n in names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in results:
        first = [s["engine"], s["size"], s["route"]] + ([str(s.get("round", 0))] if rounds else [])
        if "skipped" in s:
            lines.append("| " + " | ".join(first) + f" | skipped: {s['skipped']} |")
            continue
        row = first + [str(s["requests"]), str(s["completed"]),
               str(s["failed"]), f"{s['req_per_s']:.1f}", f"{s['gbps']:.2f}",
               f"{s['bytes_pulled'] / 1e9:.2f}", f"{s['bytes_saved'] / 1e9:.2f}",
               fmt_ms(s["e2e_p50_ms"])]
        for n in names:
            b = s["pull_latency"][n]
            row.append("-" if not b["n"] else
                       f"{fmt_ms(b['p50_ms'])}/{fmt_ms(b['p99_ms'])}/{fmt_ms(b['max_ms'])}"
                       f" ({b['n']})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
