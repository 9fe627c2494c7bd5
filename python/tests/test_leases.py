"""Never the wrong KV: page epochs, leases and done notices against a real
prefill process (peer.py) over shm, UCX (tcp) and Mooncake (the PyPI wheel,
where installed)."""
import os
import time

import mstar_kv as kv
import pytest
from conftest import SEED, TOKENS, local_layout

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

try:
    import mooncake.engine as mooncake_engine
except ImportError:
    mooncake_engine = None

ENGINES = [e for e in ("shm", "ucx") if e in kv.built_engines()] + ["mooncake"]


@pytest.fixture(autouse=True)
def _need_mooncake_wheel(request):
    if "mooncake" in request.node.name and mooncake_engine is None:
        pytest.skip("the Mooncake wheel (mooncake-transfer-engine-non-cuda) is not installed")


def reader(engine, cache):
    if engine == "mooncake":
        te = mooncake_engine.TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
        mgr = kv.KVTransferManager(kv.TransferEngineInfo("decode", "", te, {"timeout": 10.0}),
                                   cache)
        mgr._te = te  # the application's engine lives as long as the manager
        return mgr
    return kv.KVTransferManager(kv.TransferEngineInfo("decode", "", engine, {"timeout": 10.0}),
                                cache)


def pull(mgr, seq, local):
    fut = mgr.start_async_retrieve(0, seq.num_tokens, local, seq.page_indices,
                                   seq.kv_transfer_info)
    return fut.result(timeout=30)


@pytest.mark.parametrize("engine", ENGINES)
def test_reused_pages_raise_stale_never_the_other_requests_kv(engine, peer_factory):
    peer = peer_factory(engine)
    seq1 = peer.seqs[0]
    assert seq1.kv_transfer_info.epoch != 0
    cache = kv.KVCache(local_layout())
    local = list(range(len(seq1.page_indices)))
    with reader(engine, cache) as mgr:
        assert pull(mgr, seq1, local) > 0
        assert cache.verify_pattern(SEED + 1, local, 0, TOKENS)["ok"]
        answer = peer.command("reuse")
        assert answer.startswith("REUSED ")
        seq3 = kv.SequenceInfo.from_bytes(bytes.fromhex(answer.split()[1]))
        assert seq3.page_indices == seq1.page_indices
        assert seq3.kv_transfer_info.epoch != seq1.kv_transfer_info.epoch
        with pytest.raises(kv.StaleDescriptorError, match="changed owner"):
            pull(mgr, seq1, local)
        assert pull(mgr, seq3, local) > 0
        assert cache.verify_pattern(SEED + 3, local, 0, TOKENS)["ok"]


@pytest.mark.parametrize("engine", ENGINES)
def test_page_reuse_race_never_reports_another_requests_kv(engine, peer_factory):
    """The owner frees and reuses the pages while the pull runs, many times:
    every pull verifies as its own sequence or raises StaleDescriptorError."""
    peer = peer_factory(engine)
    seq = peer.seqs[0]
    cache = kv.KVCache(local_layout())
    local = list(range(len(seq.page_indices)))
    ok = stale = wrong = 0
    delay = 0.0005  # adapts so that about half the pulls lose the race
    deadline = time.monotonic() + 3.0
    with reader(engine, cache) as mgr:
        while time.monotonic() < deadline and ok + stale < 3000:
            # The owner reuses the pages after `delay`...
            d = delay * (0.5 + (ok + stale) % 7 / 7)
            peer.proc.stdin.write(f"reuse {d:.6f}\n" if d >= 2e-5 else "reuse\n")
            peer.proc.stdin.flush()
            try:  # ...while this pull runs
                pull(mgr, seq, local)
                if cache.verify_pattern(SEED + seq.seq_id, local, 0, TOKENS)["ok"]:
                    ok += 1
                else:
                    wrong += 1
                delay = max(1e-6, delay * 0.9)
            except kv.StaleDescriptorError:
                stale += 1
                delay = min(0.05, delay * 1.1)
            answer = peer.proc.stdout.readline().split()
            assert answer[0] == "REUSED", answer
            seq = kv.SequenceInfo.from_bytes(bytes.fromhex(answer[1]))
    print(f"{engine}: {ok + stale + wrong} pulls, {ok} verified, {stale} stale, "
          f"wrong-sequence reads: {wrong}")
    assert wrong == 0
    assert ok + stale >= 100
    assert stale > 0 and ok > 0  # the race really ran both ways


@pytest.mark.parametrize("engine", ENGINES)
def test_expired_lease_then_late_pull(engine, peer_factory):
    peer = peer_factory(engine, "--lease", "0.2")
    seq1 = peer.seqs[0]
    now_ms = time.time() * 1000
    assert now_ms - 5000 < seq1.lease_expiry_ms <= now_ms + 200
    cache = kv.KVCache(local_layout())
    local = list(range(len(seq1.page_indices)))
    with reader(engine, cache) as mgr:
        assert pull(mgr, seq1, local) > 0
        time.sleep(0.3)
        assert peer.command("expire") == "EXPIRED 2"
        with pytest.raises(kv.StaleDescriptorError):
            pull(mgr, seq1, local)


@pytest.mark.parametrize("engine", ENGINES)
def test_done_notice_over_the_engines_channel(engine, peer_factory):
    peer = peer_factory(engine)
    seq1 = peer.seqs[0]
    cache = kv.KVCache(local_layout())
    with reader(engine, cache) as mgr:
        if engine != "ucx":
            with pytest.raises(kv.NotSupportedError, match="side channel"):
                mgr.notify_done(seq1)
            return
        mgr.notify_done(seq1)
        deadline = time.monotonic() + 5
        while peer.command("contains 1") != "CONTAINS 0" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert peer.command("contains 1") == "CONTAINS 0"
        assert peer.command("contains 2") == "CONTAINS 1"
        with pytest.raises(kv.StaleDescriptorError):
            pull(mgr, seq1, list(range(len(seq1.page_indices))))


def test_pool_epochs_leases_and_done_in_process():
    layout = local_layout()
    cache = kv.KVCache(layout, "shared" if "shm" in kv.built_engines() else "host")
    with pytest.raises(kv.InvalidArgumentError, match="lease"):
        kv.KVCachePool(cache, lease=-1)
    pool = kv.KVCachePool(cache, kv.KVTransferInfo("shm", b"\x01"), lease=0.05)
    assert pool.lease == pytest.approx(0.05)
    pool.allocate(1, 32)
    s1 = pool.publish(1)
    assert s1.lease_expiry_ms > 0 and s1.kv_transfer_info.epoch != 0
    again = kv.SequenceInfo.from_bytes(s1.to_bytes())
    assert again.kv_transfer_info.epoch == s1.kv_transfer_info.epoch
    assert again.lease_expiry_ms == s1.lease_expiry_ms
    assert not pool.done(1, s1.kv_transfer_info.epoch + 1)
    assert pool.done(1, s1.kv_transfer_info.epoch)
    assert 1 not in pool
    pool.allocate(2, 32)
    pool.publish(2)
    time.sleep(0.1)
    assert pool.expire_leases() == 1
    assert 2 not in pool
    assert issubclass(kv.StaleDescriptorError, kv.KVTransferError)
