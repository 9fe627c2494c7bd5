"""bench/replay.py end to end, as real processes moving real bytes: the smoke
replay (shm and ucx, 1x1 and 2x2, every pulled byte verified), a prefill
killed mid-run (only its requests fail, every other completes verified), and
a corrupted block (the decodes' verification catches it)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REPLAY = os.path.join(ROOT, "bench", "replay.py")
# The trace's requests 3970-3992, in the tree (prefix sharing inside them).
TRACE = os.path.join(ROOT, "bench", "traces", "mooncake_fast25_excerpt.jsonl")

# The smoke's window of the trace, tiny caches.
WINDOW = ["--trace", TRACE, "--start", "0", "--requests", "20", "--layers", "2",
          "--pages", "192",
          "--length-scale", "0.03125", "--time-scale", "0.05", "--timeout", "5",
          "--verify-held"]


def replay(tmp_path, *args, timeout=150):
    out = tmp_path / "replay.json"
    r = subprocess.run([sys.executable, REPLAY, *args, "--json", str(out),
                        "--log-dir", str(tmp_path / "logs")],
                       capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    data = json.loads(out.read_text()) if out.exists() else None
    return r, data


def check_completed(run, records):
    assert run["completed"] == run["requests"] == 20, run
    assert run["failed"] == 0 and run["mismatches"] == 0, run["failures"]
    for rec in records:
        assert rec["status"] == "ok", rec
        # A pull reads what it needed and the decode checked at least that
        # (held blocks are checked too under --verify-held).
        assert rec["verified"] >= rec["bytes"] > 0 or rec["bytes"] == 0 < rec["verified"], rec


def test_smoke_every_request_verified(tmp_path):
    r, data = replay(tmp_path, "--smoke")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = data["runs"]
    assert [(x["engine"], x["size"]) for x in runs] == [
        ("shm", "1x1"), ("shm", "2x2"), ("ucx", "1x1"), ("ucx", "2x2")]
    for run in runs:
        check_completed(run, data["records"][f"{run['engine']} {run['size']} {run['route']}"])
        assert run["bytes_pulled"] > 0
    # The window shares blocks: some decode must have reused them, and the
    # tiny caches must have evicted, or the cache logic went untested.
    assert any(run["bytes_saved"] > 0 for run in runs)
    assert any(run["workers"].get("evicted_blocks", 0) > 0 for run in runs)


@pytest.mark.parametrize("engine", ["shm", "ucx"])
def test_killed_prefill_fails_only_its_requests(tmp_path, engine):
    kill_at = 4
    r, data = replay(tmp_path, *WINDOW, "--engines", engine, "--sizes", "2x2",
                     "--kill-prefill-at", str(kill_at))
    assert r.returncode == 0, r.stdout + r.stderr
    (run,) = data["runs"]
    records = data["records"][f"{engine} 2x2 rr"]
    killed = run["killed_prefill"]
    assert killed == records[kill_at]["prefill"]
    failed = [rec for rec in records if rec["status"] != "ok"]
    # The killed request was published and then pulled from a dead peer.
    assert records[kill_at]["status"] == "failed", records[kill_at]
    assert all(rec["prefill"] == killed and rec["status"] == "failed" for rec in failed), failed
    assert run["mismatches"] == 0
    for rec in records:
        if rec["status"] == "ok":
            assert rec["verified"] > 0, rec
    # Every request of the other prefill completed, and those that arrived
    # after the kill all went to it.
    others = [rec for rec in records if rec["prefill"] != killed]
    assert others and all(rec["status"] == "ok" for rec in others)
    late = [rec for rec in records if rec["arrival"] > run["kill_time"]]
    assert all(rec["prefill"] != killed for rec in late), late


def test_corrupted_block_fails_the_run(tmp_path):
    r, data = replay(tmp_path, *WINDOW, "--engines", "shm", "--sizes", "1x1",
                     "--requests", "6", "--corrupt-at", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    records = data["records"]["shm 1x1 rr"]
    assert records[2]["status"] == "mismatch", records[2]
    assert "hash" in records[2]["why"]
    assert [rec["status"] for i, rec in enumerate(records) if i != 2] == ["ok"] * 5


def test_rounds_give_medians_and_options_reach_the_engine(tmp_path):
    # Two timed rounds after an untimed one, engines alternating; the option
    # is one the ucx engine checks, so a run that ignored it would not differ.
    r, data = replay(tmp_path, *WINDOW, "--engines", "shm,ucx", "--sizes", "1x1",
                     "--repeat", "2", "--warmup", "1", "--engine-opt", "ucx_progress=event")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = data["runs"]
    assert [(x["engine"], x["round"]) for x in runs] == [
        ("shm", 0), ("ucx", 0), ("shm", 1), ("ucx", 1)]
    for run in runs:
        check_completed(run, data["records"][f"{run['engine']} 1x1 rr round {run['round']}"])
    assert "round -1 (warm-up, untimed)" in r.stdout
    med = {m["engine"]: m for m in data["medians"]}
    for engine in ("shm", "ucx"):
        rates = sorted(x["req_per_s"] for x in runs if x["engine"] == engine)
        assert med[engine]["rounds"] == 2 and med[engine]["completed"] == 40
        assert med[engine]["req_per_s"] == pytest.approx(sum(rates) / 2)
    assert "medians of 2 rounds" in r.stdout

    r, _ = replay(tmp_path, *WINDOW, "--engines", "ucx", "--sizes", "1x1",
                  "--engine-opt", "ucx_progress=bogus")
    assert r.returncode == 1
    assert "exited during start" in r.stderr, r.stderr
    log = (tmp_path / "logs" / "ucx-1x1-rr-0.log").read_text()
    assert "ucx_progress 'bogus'" in log, log
