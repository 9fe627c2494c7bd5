"""The decode worker connects to its prefill peers ahead of its pulls
(prefill_peers, peers.py): a prefill worker process publishes a request
(random bytes in vLLM's own KV tensors, ucx over loopback); the decode
worker is connected to it before the first load, and that load starts on
the engine's thread from the params with no new connection (the producer's
engine counts the connections it accepted). A peer down at start or
restarted is connected in the background once it is up, without hanging
the worker; loads meanwhile fail in bounded time."""
import base64
import json
import threading
import time

import pytest

pytest.importorskip("vllm", reason="needs vLLM (./scripts/test makes build/venvs/vllm)")

import mstar_kv as kv  # noqa: E402
import vllm_kit as K  # noqa: E402
from mstar_kv.integrations.vllm.metadata import LoadReq  # noqa: E402
from mstar_kv.integrations.vllm.params import (  # noqa: E402
    ConnectorConfig,
    make_decode_params,
    parse_remote_prefill,
)
from test_vllm_worker import (  # noqa: E402,F401  (zygote: its autouse fixture)
    SEED,
    Producer,
    consumer,
    model_dir,
    pull,
    zygote,
)
from test_vllm_worker import params as side_channel_params  # noqa: E402


def ask(prod, cmd: str, prefix: str, timeout: float = 10.0) -> str:
    """The producer's answer to ``cmd`` (a FREED line before it is noted:
    freed_seen)."""
    prod.p.stdin.write(cmd + "\n")
    prod.p.stdin.flush()
    # readline, not select: two lines may sit in the file's buffer at once. A
    # peer that does not answer is killed (readline then ends).
    watchdog = threading.Timer(timeout, prod.p.kill)
    watchdog.start()
    try:
        while True:
            line = prod.p.stdout.readline()
            if line.strip() == "FREED":
                prod.freed_seen = True
                continue
            assert line.startswith(prefix), f"no answer to {cmd!r}: {line!r}"
            return line[len(prefix):].strip()
    finally:
        watchdog.cancel()


def freed(prod) -> bool:
    return getattr(prod, "freed_seen", False) or prod.freed()


def served(prod) -> dict:
    return json.loads(ask(prod, "served", "SERVED "))


def direct_params(prod, port: int, n: int):
    """The params a finished request carries: the producer's descriptor,
    pages and epoch (the decode pulls without asking the producer)."""
    seq = kv.SequenceInfo.from_bytes(base64.b64decode(ask(prod, "seq", "SEQ ")))
    info = seq.kv_transfer_info
    cache_desc = kv.KVTransferInfo(info.engine, bytes(info.payload))
    params = make_decode_params(ConnectorConfig(side_channel_port=port), "p1", 1, K.PRODUCER_BS,
                                n, descs=[cache_desc.to_bytes()],
                                pages=list(seq.page_indices), epoch=info.epoch)
    rp = parse_remote_prefill(params)
    assert rp.direct
    return rp


def wait_state(glue, port: int, state: str, timeout: float = 15.0, connects: int = 0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = glue.connector.consumer.peers().get(f"127.0.0.1:{port}")
        if st and st["state"] == state and st["connects"] >= connects:
            return st
        assert time.monotonic() < deadline, f"peer 127.0.0.1:{port} not {state}: {st}"
        time.sleep(0.02)


def test_configured_peer_is_connected_before_the_first_pull(model_dir):  # noqa: F811
    port = K.free_port()
    n = 90
    prod = Producer(model_dir, port, "LBNHC", [4, 9, 2], n)
    glue, kvt = consumer(model_dir, extra={"prefill_peers": [f"127.0.0.1:{port}"]})
    try:
        wait_state(glue, port, "connected")
        assert served(prod)["readers_connected"] == 1  # connected: before any load
        c_blocks = [7, 3, 11]
        assert not pull(glue, LoadReq("d1", direct_params(prod, port, n), c_blocks, 0, n))
        assert K.check_request(kvt, c_blocks, SEED, 0, n) == []
        st = glue.connector.consumer.stats
        # Started on the engine's thread from the params, over the connection
        # made ahead: no side-channel round trip, no new connection.
        assert st["loads_direct"] == 1 and st["loads_side_channel"] == 0
        s = served(prod)
        assert s["readers_connected"] == 1 and s["reads"] >= 1
        assert freed(prod)
    finally:
        glue.close()
        prod.close()


def test_peer_down_at_start_is_connected_once_it_is_up(model_dir):  # noqa: F811
    port = K.free_port()
    n = 60
    t0 = time.monotonic()
    glue, kvt = consumer(model_dir, extra={"prefill_peers": [f"127.0.0.1:{port}"],
                                           "fetch_timeout_s": 1.0})
    try:
        assert time.monotonic() - t0 < 30  # the worker starts whatever its peers do
        deadline = time.monotonic() + 10
        while not (st := glue.connector.consumer.peers().get(f"127.0.0.1:{port}", {})).get(
                "error"):
            assert time.monotonic() < deadline, st
            time.sleep(0.02)
        assert st["state"] == "down" and "refused" in st["error"].lower(), st
        # A load from it meanwhile fails in bounded time (vLLM recomputes).
        t1 = time.monotonic()
        assert pull(glue, LoadReq("d0", side_channel_params(port, n), [5, 6], 0, n)) == {5, 6}
        assert time.monotonic() - t1 < 10
        prod = Producer(model_dir, port, "LBNHC", [1, 2], n)
        try:
            wait_state(glue, port, "connected")  # retried in the background
            assert served(prod)["readers_connected"] == 1
            assert not pull(glue, LoadReq("d1", direct_params(prod, port, n), [8, 9], 0, n))
            assert K.check_request(kvt, [8, 9], SEED, 0, n) == []
            assert glue.connector.consumer.stats["loads_direct"] == 1
            assert served(prod)["readers_connected"] == 1
        finally:
            prod.close()
    finally:
        glue.close()


@pytest.mark.parametrize("configured", [True, False])
def test_restarted_peer_is_connected_again_in_the_background(model_dir, configured):  # noqa: F811
    """The producer dies and a new one starts on the same side channel: the
    decode worker learns it from the watch's end, connects to the new one
    before any load names it, and pulls from it directly. Without
    prefill_peers the first pull (which learns the peer) connects itself."""
    port = K.free_port()
    n = 70
    extra = {"prefill_peers": [f"127.0.0.1:{port}"]} if configured else {}
    old = Producer(model_dir, port, "LBNHC", [3, 5, 7], n)
    glue, kvt = consumer(model_dir, extra=extra)
    try:
        if configured:
            wait_state(glue, port, "connected")
        assert not pull(glue, LoadReq("d1", direct_params(old, port, n), [1, 2, 3], 0, n))
        assert K.check_request(kvt, [1, 2, 3], SEED, 0, n) == []
        wait_state(glue, port, "connected", connects=1)
        assert served(old)["readers_connected"] == 1
        old.p.kill()
        old.p.wait(10)
        wait_state(glue, port, "down", timeout=10)  # the watch ended: no pull needed
        new = Producer(model_dir, port, "LBNHC", [6, 2, 9], n, seed=SEED + 1)
        try:
            wait_state(glue, port, "connected", connects=2)
            assert served(new)["readers_connected"] == 1  # before any load named it
            assert not pull(glue, LoadReq("d2", direct_params(new, port, n), [20, 21, 22], 0, n))
            assert K.check_request(kvt, [20, 21, 22], SEED + 1, 0, n) == []
            st = glue.connector.consumer.stats
            assert st["loads_ok"] == 2 and st["loads_failed"] == 0
            assert st["loads_direct"] == (2 if configured else 1)
            assert served(new)["readers_connected"] == 1
        finally:
            new.close()
    finally:
        glue.close()
        old.close()
