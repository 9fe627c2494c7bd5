"""Statistics: counts and bytes equal what the test moved, across success,
failure (forged descriptor, killed peer) and cancel; histogram counts match
the reads; `mstar-kv serve`'s /metrics parses with prometheus_client."""
import os
import socket
import subprocess
import time
import urllib.request

import mstar_kv as kv
import pytest
from conftest import HERE, SEED, TOKENS, local_layout

CLI = os.path.join(HERE, "..", "..", "build", "release", "tools", "mstar-kv")


def test_counts_bytes_and_phases_match_what_moved(peer_factory):
    peer = peer_factory("shm")
    seq = peer.seqs[0]
    cache = kv.KVCache(local_layout())
    inner = kv.ShmKVTransferEngine(cache)
    mgr = kv.KVTransferManager(inner, cache)
    layout = cache.layout
    local = list(range(len(seq.page_indices)))
    full = layout.num_layers * 2 * TOKENS * layout.token_bytes
    tail = layout.num_layers * 2 * (TOKENS - 40) * layout.token_bytes
    assert mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices,
                             seq.kv_transfer_info) == full
    assert mgr.sync_retrieve(40, seq.num_tokens, local, seq.page_indices,
                             seq.kv_transfer_info) == tail
    with pytest.raises(kv.CorruptDescriptorError):  # refused: counted as failed
        mgr.start_async_retrieve(0, 16, [0], [0], kv.KVTransferInfo("shm", b"forged"))
    assert mgr.start_async_retrieve(5, 5, local, seq.page_indices, seq.kv_transfer_info) is None
    peer.kill()
    with pytest.raises(kv.NotFoundError):  # the dead owner's cache
        mgr.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)

    s = mgr.stats()
    t = s["total"]
    assert s["engine"] == "shm"
    assert t["reads_started"] == 4
    assert t["reads_succeeded"] == 2
    assert t["reads_failed"] == {"CorruptDescriptor": 1, "NotFound": 1}
    assert t["bytes"] == full + tail
    assert t["copies"] > 0
    pid_peer = f"pid {peer.proc.pid}"
    assert s["peers"][pid_peer]["reads_succeeded"] == 2
    assert s["peers"]["unknown"]["reads_started"] == 2  # refused before a peer was named
    lat = t["latency"]
    assert lat["plan"]["count"] == 4 and lat["post"]["count"] == 2
    assert lat["transfer"]["count"] == 2
    assert lat["transfer"]["buckets"][-1] == (float("inf"), 2)
    assert lat["transfer"]["sum_seconds"] > 0
    mgr.cleanup()


def test_cancel_and_timeout_are_counted():
    layout = local_layout(num_pages=64)
    src = kv.KVCache(layout, "shared")
    info = kv.ShmKVTransferEngine(src).get_kv_transfer_info()
    dst = kv.KVCache(layout)
    slow = kv.FaultInjectingKVTransferEngine(kv.ShmKVTransferEngine(dst), delay=5.0)
    mgr = kv.KVTransferManager(slow, dst)
    f = mgr.start_async_retrieve(0, 64 * 16, list(range(64)), list(range(64)), info)
    assert f.cancel()
    dropped = kv.FaultInjectingKVTransferEngine(kv.ShmKVTransferEngine(dst), drop=True,
                                                drop_timeout=0.1)
    m2 = kv.KVTransferManager(dropped, dst)
    with pytest.raises(kv.TransferTimeoutError):
        m2.sync_retrieve(0, 16, [0], [0], info)
    assert mgr.stats()["total"]["reads_failed"] == {"Cancelled": 1}
    assert m2.stats()["total"]["reads_failed"] == {"Timeout": 1}
    assert mgr.stats()["total"]["latency"]["transfer"]["count"] == 1


def test_prometheus_text_of_a_manager_parses():
    parser = pytest.importorskip("prometheus_client.parser")
    layout = local_layout(num_pages=8)
    src = kv.KVCache(layout, "shared")
    src.fill_pattern(1, list(range(8)), 0, 128)
    info = kv.ShmKVTransferEngine(src).get_kv_transfer_info()
    dst = kv.KVCache(layout)
    mgr = kv.KVTransferManager(kv.TransferEngineInfo("d", "", "shm"), dst)
    for _ in range(3):
        mgr.sync_retrieve(0, 128, list(range(8)), list(range(8)), info)
    families = {f.name: f for f in parser.text_string_to_metric_families(mgr.prometheus_text())}
    started = families["mstar_kv_reads_started"].samples
    assert [s.value for s in started] == [3.0]
    assert started[0].labels == {"engine": "shm", "peer": f"pid {os.getpid()}"}
    hist = families["mstar_kv_read_phase_seconds"]
    assert hist.type == "histogram"
    counts = [s for s in hist.samples if s.name.endswith("_count")]
    assert {s.labels["phase"]: s.value for s in counts} == {"plan": 3, "post": 3, "transfer": 3}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not os.access(CLI, os.X_OK), reason=f"{CLI} is not built")
def test_serve_metrics_scrape_parses():
    parser = pytest.importorskip("prometheus_client.parser")
    port = _free_port()
    serve = subprocess.Popen([CLI, "serve", "--engine", "shm", "--listen", f"127.0.0.1:{port}",
                              "--model", "llama3-8b", "--layers", "2", "--tokens", "64",
                              "--sequences", "2"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                seq = kv.SequenceInfo.from_bytes(
                    urllib.request.urlopen(base + "/v1/sequences/0", timeout=5).read())
                break
            except Exception:
                assert serve.poll() is None and time.monotonic() < deadline, "serve did not start"
                time.sleep(0.1)
        urllib.request.urlopen(urllib.request.Request(base + "/v1/sequences/1/done",
                                                      method="POST"), timeout=5).read()
        r = urllib.request.urlopen(base + "/metrics", timeout=5)
        assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        families = {f.name: f for f in parser.text_string_to_metric_families(r.read().decode())}
        assert families["mstar_kv_serve_descriptors_served"].samples[0].value == 1
        assert families["mstar_kv_serve_sequences_done"].samples[0].value == 1
        assert families["mstar_kv_serve_sequences_live"].samples[0].value == 1
        assert families["mstar_kv_pool_free_pages"].samples[0].value >= 4
        assert "mstar_kv_read_phase_seconds" in families  # declared, no reads by an owner
        assert families["mstar_kv_serve_descriptors_served"].samples[0].labels == {
            "engine": "shm"}
        assert seq.num_tokens == 64
    finally:
        serve.terminate()
        serve.wait(timeout=30)


def test_a_failed_peer_is_logged_once(peer_factory):
    """MSTAR_KV_LOG=warn: several reads fail on a killed UCX peer; the engine
    logs the peer's failure once, with its reason, on stderr."""
    import sys
    peer = peer_factory("ucx", "--pages", "1024", "--heads", "8", "--head-dim", "128",
                        "--tokens", str(16 * 500), env={"UCX_TLS": "tcp",
                                                          "UCX_NET_DEVICES": "lo"})
    code = r'''
import os, signal, sys, time
import mstar_kv as kv
from conftest import local_layout
seq = kv.SequenceInfo.from_bytes(bytes.fromhex(sys.argv[1]))
pid = int(sys.argv[2])
cache = kv.KVCache(local_layout(num_pages=512, num_kv_heads=8, head_dim=128))
mgr = kv.KVTransferManager(kv.TransferEngineInfo("d", "", "ucx", {"timeout": 10}), cache)
local = list(range(len(seq.page_indices)))
mgr.sync_retrieve(0, 16, local[:1], seq.page_indices[:1], seq.kv_transfer_info)  # connect
futs = [mgr.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                 seq.kv_transfer_info) for _ in range(4)]
os.kill(pid, signal.SIGKILL)
failed = 0
for f in futs:
    try:
        f.result(timeout=30)
    except kv.KVTransferError:
        failed += 1
s = mgr.stats()["total"]
print("FAILED", failed, "STATS", s["reads_started"], sum(s["reads_failed"].values()))
'''
    env = dict(os.environ, MSTAR_KV_LOG="warn", UCX_TLS="tcp", UCX_NET_DEVICES="lo",
               PYTHONPATH=HERE)
    r = subprocess.run([sys.executable, "-c", code, peer.seqs[0].to_bytes().hex(),
                        str(peer.proc.pid)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    failed = int(r.stdout.split("FAILED")[1].split()[0])
    if failed == 0:
        pytest.skip("every read finished before the peer died")
    started, failures = map(int, r.stdout.split("STATS")[1].split()[:2])
    assert started == 5 and failures == failed
    lines = [l for l in r.stderr.splitlines() if l.startswith("mstar-kv [warn] ucx peer at")]
    assert len(lines) == 1, r.stderr[-2000:]
    assert "failed: " in lines[0]


def test_owner_side_counts_what_it_served():
    """The owner's stats()["served"]: a UCX owner counts the read and the
    bytes it sent, its pool the descriptor published and the done notice."""
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if "ucx" not in kv.built_engines():
        pytest.skip("the ucx engine is not built")
    cache = kv.KVCache(local_layout(), "host")
    owner = kv.KVTransferManager(kv.TransferEngineInfo("owner", "", "ucx", {"timeout": 10}),
                                 cache)
    pool = kv.KVCachePool(cache, owner.get_kv_transfer_info(), scatter_seed=7)
    owner.serve_done_notices(pool)
    pool.allocate(1, TOKENS)
    cache.fill_pattern(SEED + 1, pool.pages(1), 0, TOKENS)
    served = owner.stats()["served"]
    assert served == {"reads": 0, "bytes": 0, "reads_refused": 0, "replies_dropped": 0,
                      "readers_connected": 0, "readers_gone": 0, "staged_bytes": 0,
                      "descriptors": 0, "done_notices": 0}
    seq = pool.publish(1)
    local_cache = kv.KVCache(local_layout())
    reader = kv.KVTransferManager(kv.TransferEngineInfo("reader", "", "ucx", {"timeout": 10}),
                                  local_cache)
    local = list(range(len(seq.page_indices)))
    n = reader.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
    assert local_cache.verify_pattern(SEED + 1, local, 0, seq.num_tokens)["ok"]
    reader.notify_done(seq)
    deadline = time.monotonic() + 10
    while owner.stats()["served"]["done_notices"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    served = owner.stats()["served"]
    assert served["reads"] == 1 and served["bytes"] == n
    assert served["readers_connected"] == 1 and served["replies_dropped"] == 0
    assert served["descriptors"] == 1 and served["done_notices"] == 1
    assert 1 not in pool  # the notice freed it
    assert "mstar_kv_served_bytes_total{engine=\"ucx\"} %d" % n in owner.prometheus_text()
    reader.cleanup()
    owner.cleanup()


def test_a_staged_owner_counts_what_it_staged():
    """ucx_staging=on (the path of GPU caches, here host caches with
    memcpy): a Python reader pulls every byte from a staged owner, which
    counts the bytes it gathered into host buffers first."""
    os.environ.setdefault("UCX_TLS", "tcp")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if "ucx" not in kv.built_engines():
        pytest.skip("the ucx engine is not built")
    cache = kv.KVCache(local_layout(), "host")
    staged = {"timeout": 10, "ucx_staging": "on"}
    owner = kv.KVTransferManager(kv.TransferEngineInfo("owner", "", "ucx", staged), cache)
    pool = kv.KVCachePool(cache, owner.get_kv_transfer_info(), scatter_seed=7)
    pool.allocate(1, TOKENS)
    cache.fill_pattern(SEED + 2, pool.pages(1), 0, TOKENS)
    seq = pool.publish(1)
    for reader_options in (staged, {"timeout": 10}):
        local_cache = kv.KVCache(local_layout())
        reader = kv.KVTransferManager(
            kv.TransferEngineInfo("reader", "", "ucx", reader_options), local_cache)
        local = list(range(len(seq.page_indices)))
        reader.sync_retrieve(0, seq.num_tokens, local, seq.page_indices, seq.kv_transfer_info)
        assert local_cache.verify_pattern(SEED + 2, local, 0, seq.num_tokens)["ok"]
        reader.cleanup()
    served = owner.stats()["served"]
    assert served["reads"] == 2 and served["bytes"] > 0
    assert served["staged_bytes"] == served["bytes"]
    owner.cleanup()
