"""A prefill or decode process of bench/replay.py (started by it, never by
hand): one JSON object per line on stdin, one per line back on stdout.

    python3 bench/replay_worker.py CONFIG_JSON

Prefill: {"op": "prefill", req, tokens, blocks, bt} allocates the request's
pages with a KVCachePool, writes every block with the pattern of its hash id
and publishes it ("published", with the SequenceInfo bytes); a request that
does not fit waits until a "done" frees pages. Decode: {"op": "pull", ...}
pulls the blocks its BlockCache lacks, verifies them, answers "pulled" or
"failed" / "mismatch". Both: "quit" answers "bye" with counters and exits.
"""
import json
import math
import os
import sys
import time

# The protocol owns the stdout this process started with; whatever the
# transfer libraries print afterwards goes to stderr (the run's log).
OUT = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mstar_kv as kv  # noqa: E402
import replay_common as rc  # noqa: E402
import replay_transports as rt  # noqa: E402


def say(**msg):
    OUT.write(json.dumps(msg) + "\n")
    OUT.flush()


def pages_of(pages, t0, n):
    """The pages of a sequence's table that hold tokens [t0, t0 + n)."""
    return pages[t0 // rc.PAGE_SIZE: math.ceil((t0 + n) / rc.PAGE_SIZE)]


class Prefill:
    def __init__(self, cfg, transport):
        self.t = transport
        self.pending = []  # requests waiting for pages
        self.published = 0
        self.waited = 0
        # --corrupt-at: one block written with another block's bytes, so that
        # a test can show the decodes' verification catches it.
        self.corrupt = cfg.get("corrupt_at")

    def prefill(self, m):
        # First come, first served: a request waits behind those already
        # waiting for pages.
        if self.pending or not self._try(m):
            self.waited += 1
            self.pending.append(m)

    def _try(self, m):
        """False when the pool has no room for the request now."""
        try:
            pages = self.t.pool.allocate(m["req"] + 1, m["tokens"])
        except kv.RetryLaterError:
            need = math.ceil(m["tokens"] / rc.PAGE_SIZE)
            if need <= self.t.num_pages:
                return False
            say(op="error", req=m["req"],
                why=f"prompt of {need} pages exceeds the prefill cache of "
                    f"{self.t.num_pages} pages")
            return True
        t0 = time.perf_counter()
        for b, start, n in rc.block_spans(m["tokens"], m["bt"]):
            seed = rc.SEED_BASE + m["blocks"][b] + (self.corrupt == m["req"] and b == 0)
            self.t.cache.fill_pattern(seed, pages_of(pages, start, n), 0, n)
        fill_s = time.perf_counter() - t0
        say(op="published", req=m["req"], seq=self.t.publish(m["req"] + 1), pages=pages,
            fill_s=fill_s)
        self.published += 1
        return True

    def done(self, m):
        self.t.pool.done(m["req"] + 1)
        while self.pending and self._try(self.pending[0]):
            self.pending.pop(0)

    def counters(self):
        return {"published": self.published, "waited_for_pages": self.waited}


class Decode:
    def __init__(self, cfg, transport):
        self.t = transport
        self.blocks = rc.BlockCache(transport.num_pages)
        self.verify_held = cfg["verify_held"]
        self.hits = self.misses = 0

    def pull(self, m):
        bt, blocks, req = m["bt"], m["blocks"], m["req"]
        spans = rc.block_spans(m["tokens"], bt)
        held, pinned = {}, set()
        for b, _, n in spans:
            pages = self.blocks.lookup(blocks[b]) if n == bt else None
            if pages is not None:
                held[b] = pages
                pinned.add(blocks[b])
        missing = [s for s in spans if s[0] not in held]
        evicted = []
        local = self.blocks.take(sum(math.ceil(n / rc.PAGE_SIZE) for _, _, n in missing),
                                 pinned, evicted)
        if local is None:
            say(op="failed", req=req, why="decode cache too small for this prompt",
                added=[], evicted=evicted)
            return
        got, at = {}, 0
        for b, _, n in missing:
            k = math.ceil(n / rc.PAGE_SIZE)
            got[b] = local[at:at + k]
            at += k
        runs = []  # (first token, end token, local pages): consecutive missing blocks
        for b, start, n in missing:
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], start + n, runs[-1][2] + got[b])
            else:
                runs.append((start, start + n, list(got[b])))
        self.hits += len(held)
        self.misses += len(missing)
        t0 = time.perf_counter()
        nbytes, err = self.t.pull(m, runs) if runs else (0, None)
        pull_s = time.perf_counter() - t0
        if err is not None:
            self.blocks.give_back(local)
            say(op="failed", req=req, why=err, added=[], evicted=evicted, pull_s=pull_s)
            return
        checks = [(blocks[b], got[b], n) for b, _, n in missing]
        if self.verify_held:
            checks += [(blocks[b], held[b], n) for b, _, n in spans if b in held]
        verified = 0
        for h, pages, n in checks:
            v = self.t.cache.verify_pattern(rc.SEED_BASE + h, pages, 0, n)
            verified += v["bytes_checked"]
            if not v["ok"]:
                self.blocks.give_back(local)
                say(op="mismatch", req=req, why=f"hash {h}: {v['first_mismatch']}",
                    added=[], evicted=evicted)
                return
        added = []
        for b, _, n in missing:
            if n == bt and self.blocks.insert(blocks[b], got[b]):
                added.append(blocks[b])
            elif n != bt:
                self.blocks.give_back(got[b])
        saved = sum(n for b, _, n in spans if b in held) * self.t.token_bytes
        say(op="pulled", req=req, bytes=nbytes, saved=saved, verified=verified, pull_s=pull_s,
            added=added, evicted=evicted)

    def counters(self):
        return {"block_hits": self.hits, "block_misses": self.misses,
                "evicted_blocks": self.blocks.evicted}


def main():
    cfg = json.loads(sys.argv[1])
    transport = rt.make(cfg)
    role = Prefill(cfg, transport) if cfg["role"] == "prefill" else Decode(cfg, transport)
    say(op="ready", **transport.ready_info())
    for line in sys.stdin:
        m = json.loads(line)
        op = m["op"]
        try:
            if op == "prefill":
                role.prefill(m)
            elif op == "done":
                role.done(m)
            elif op == "pull":
                role.pull(m)
            elif op == "peer":
                transport.add_peer(m)
            elif op == "quit":
                break
        except Exception as e:  # noqa: BLE001 - reported per request, the run goes on
            say(op="failed", req=m.get("req", -1), why=f"{type(e).__name__}: {e}",
                added=[], evicted=[])
    say(op="bye", **role.counters())
    OUT.flush()
    # NIXL's and Mooncake's bundled libraries can crash at interpreter exit;
    # nothing is left to flush, and the OS releases the caches.
    os._exit(0)


if __name__ == "__main__":
    main()
