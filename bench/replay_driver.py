"""One replay run of bench/replay.py: N prefill and M decode worker processes
(bench/replay_worker.py), the trace's arrivals played against them, the
router in this process. Workers talk JSON lines over their stdin/stdout; one
reader thread per worker feeds a single queue, so the loop below is the only
place any state changes."""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import replay_common as rc

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "replay_worker.py")


class Worker:
    def __init__(self, role, index, cfg, python, env, log, q):
        self.role, self.index, self.alive, self.killed = role, index, True, False
        wcfg = dict(cfg, role=role, index=index)
        self.proc = subprocess.Popen([python, WORKER, json.dumps(wcfg)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=env, text=True,
                                     bufsize=1)
        self.ready = None
        self.bye = None
        threading.Thread(target=self._read, args=(q,), daemon=True).start()

    def _read(self, q):
        for line in self.proc.stdout:
            try:
                q.put((self, json.loads(line)))
            except ValueError:
                q.put((self, {"op": "noise", "line": line}))
        q.put((self, {"op": "eof"}))

    def send(self, **msg):
        if not self.alive:
            return
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self.alive = False

    def kill(self):
        self.killed = True
        self.alive = False
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    @property
    def name(self):
        return f"{self.role}-{self.index}"


class Run:
    """cfg: engine, prefill, decode, route, layers, pages, timeout,
    verify_held, bt, time_scale, kill_at (request or None), deadline_s."""

    def __init__(self, cfg, trace, python, env, log):
        self.cfg, self.trace = cfg, trace
        self.q = queue.Queue()
        wcfg = {k: cfg[k] for k in ("engine", "layers", "pages", "timeout", "verify_held",
                                    "corrupt_at")}
        wcfg["engine_opts"] = cfg.get("engine_opts", {})
        self.prefills = [Worker("prefill", i, wcfg, python, env, log, self.q)
                         for i in range(cfg["prefill"])]
        self.decodes = [Worker("decode", i, wcfg, python, env, log, self.q)
                        for i in range(cfg["decode"])]
        self.holdings = [set() for _ in self.decodes]  # what each decode reported holding
        self.outstanding = [0] * len(self.decodes)
        self.rr_prefill = self.rr_decode = 0
        self.records = [{"req": r["req"], "trace_index": r["trace_index"],
                         "trace_tokens": r["trace_tokens"], "tokens": r["tokens"],
                         "status": "waiting", "prefill": None, "decode": None} for r in trace]
        self.unresolved = len(trace)
        self.unexpected = []  # worker deaths nobody asked for
        self.killed = None
        self.kill_time = None

    def workers(self):
        return self.prefills + self.decodes

    def start(self, timeout=180):
        deadline = time.monotonic() + timeout
        waiting = {id(w) for w in self.workers()}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("workers not ready in time")
            w, m = self.q.get(timeout=left)
            if m["op"] == "ready":
                w.ready = m
                waiting.discard(id(w))
            elif m["op"] == "eof":
                raise RuntimeError(f"{w.name} exited during start (see its log)")
        for p in self.prefills:
            if "meta" in p.ready:  # NIXL: each decode learns each prefill's agent
                for d in self.decodes:
                    d.send(**dict(p.ready, op="peer", prefill=p.index))

    def resolve(self, rec, status, **kw):
        if rec["status"] in ("ok", "failed", "mismatch"):
            return
        rec.update(status=status, **kw)
        self.unresolved -= 1
        self.last_t = time.monotonic()

    def arrive(self, i, now):
        rec = self.records[i]
        live = [p for p in self.prefills if p.alive]
        rec["arrival"] = now
        if not live:
            self.resolve(rec, "failed", why="no prefill alive")
            return
        p = live[self.rr_prefill % len(live)]
        self.rr_prefill += 1
        rec.update(status="prefill", prefill=p.index)
        r = self.trace[i]
        p.send(op="prefill", req=i, tokens=r["tokens"], blocks=r["blocks"], bt=self.cfg["bt"])

    def route(self, i):
        live = [d for d in self.decodes if d.alive]
        if not live:
            return None
        self.rr_decode += 1
        if self.cfg["route"] == "rr":
            return live[self.rr_decode % len(live)]
        blocks = self.trace[i]["blocks"]
        n = len(self.decodes)

        def key(d):
            score = sum(1 for h in blocks if h in self.holdings[d.index])
            return (score, -self.outstanding[d.index], -((d.index - self.rr_decode) % n))
        return max(live, key=key)

    def kill_prefill(self, p):
        p.kill()
        self.killed = p.index
        self.kill_time = time.monotonic()
        for rec in self.records:
            if rec["prefill"] == p.index and rec["status"] == "prefill":
                self.resolve(rec, "failed", why=f"prefill-{p.index} killed before publishing")

    def published(self, p, m):
        i = m["req"]
        rec = self.records[i]
        if rec["status"] != "prefill":  # resolved already (its prefill was declared gone)
            return
        rec.update(status="published", fill_s=m["fill_s"])
        if self.cfg["kill_at"] == i and self.killed is None:
            # Killed between publishing and the decode's pull: that pull, and
            # every other of this prefill's still to come, needs a dead peer.
            self.kill_prefill(p)
        d = self.route(i)
        if d is None:
            self.resolve(rec, "failed", why="no decode alive")
            return
        rec.update(status="pulling", decode=d.index)
        self.outstanding[d.index] += 1
        r = self.trace[i]
        d.send(op="pull", req=i, prefill=p.index, seq=m["seq"], pages=m["pages"],
               tokens=r["tokens"], blocks=r["blocks"], bt=self.cfg["bt"])

    def pulled(self, d, m, now):
        rec = self.records[m["req"]]
        self.outstanding[d.index] -= 1
        self.holdings[d.index].difference_update(m.get("evicted", []))
        self.holdings[d.index].update(m.get("added", []))
        status = {"pulled": "ok", "failed": "failed", "mismatch": "mismatch"}[m["op"]]
        extra = {k: m[k] for k in ("bytes", "saved", "verified", "pull_s", "why") if k in m}
        self.resolve(rec, status, e2e_s=now - rec["arrival"], **extra)
        p = self.prefills[rec["prefill"]]
        p.send(op="done", req=m["req"])  # frees its pages; a dead prefill hears nothing

    def worker_gone(self, w):
        if w.killed or not w.alive and w.bye is not None:
            return
        w.alive = False
        if w.bye is None:
            self.unexpected.append(w.name)
        for rec in self.records:
            mine = (rec["prefill"] == w.index and rec["status"] == "prefill"
                    if w.role == "prefill" else
                    rec["decode"] == w.index and rec["status"] == "pulling")
            if mine:
                self.resolve(rec, "failed", why=f"{w.name} exited")

    def replay(self):
        scale = self.cfg["time_scale"]
        t0 = time.monotonic()
        self.last_t = t0
        deadline = t0 + self.cfg["deadline_s"]
        nxt = 0
        while self.unresolved > 0:
            now = time.monotonic()
            while nxt < len(self.trace) and t0 + self.trace[nxt]["t_ms"] / 1e3 * scale <= now:
                self.arrive(nxt, now)
                nxt += 1
            if now > deadline:
                for rec in self.records:
                    self.resolve(rec, "failed", why=f"unresolved after {self.cfg['deadline_s']} s")
                break
            wait = 0.5
            if nxt < len(self.trace):
                wait = min(wait, max(0.0, t0 + self.trace[nxt]["t_ms"] / 1e3 * scale - now))
            try:
                w, m = self.q.get(timeout=wait)
            except queue.Empty:
                continue
            now = time.monotonic()
            op = m["op"]
            if op == "published":
                self.published(w, m)
            elif m.get("req", 0) < 0:  # a worker's error outside any request
                self.unexpected.append(f"{w.name}: {m.get('why')}")
            elif op in ("pulled", "failed", "mismatch") and w.role == "decode":
                self.pulled(w, m, now)
            elif op in ("failed", "error"):  # a prefill could not take the request
                self.resolve(self.records[m["req"]], "failed", why=f"{w.name}: {m['why']}")
            elif op == "eof":
                self.worker_gone(w)
        return self.last_t - t0

    def stop(self):
        for w in self.workers():
            w.send(op="quit")
        end = time.monotonic() + 30
        pending = [w for w in self.workers() if w.alive]
        while pending and time.monotonic() < end:
            try:
                w, m = self.q.get(timeout=max(0.01, end - time.monotonic()))
            except queue.Empty:
                break
            if m["op"] == "bye":
                w.bye = m
            elif m["op"] == "eof" and w in pending:
                pending.remove(w)
        for w in self.workers():
            if w.proc.poll() is None:
                w.proc.kill()
            w.proc.wait()

    def counters(self):
        out = {}
        for w in self.workers():
            if w.bye:
                for k, v in w.bye.items():
                    if k != "op":
                        out[k] = out.get(k, 0) + v
        return out


def run(cfg, trace, python, env, log):
    """Runs one configuration; returns (summary, records)."""
    r = Run(cfg, trace, python, env, log)
    try:
        r.start()
        wall = r.replay()
    finally:
        r.stop()
    label = {"engine": cfg["engine"], "size": f"{cfg['prefill']}x{cfg['decode']}",
             "route": cfg["route"]}
    s = rc.summarize(label, r.records, wall)
    s["killed_prefill"] = r.killed
    s["kill_time"] = r.kill_time  # time.monotonic(), as the records' "arrival"
    s["unexpected_exits"] = r.unexpected
    s["workers"] = r.counters()
    if r.unexpected:
        print(f"replay: workers exited unexpectedly: {r.unexpected}", file=sys.stderr)
    return s, r.records
