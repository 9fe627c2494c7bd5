"""MstarKVConnector's worker side on CPU tensors, through vLLM 0.34's CPU
connector glue (vllm.v1.worker.cpu.kv_connector.ActiveKVConnector) on the
decode side and vLLM's own KV allocation (allocate_kv_cache) on both: a
prefill worker process publishes a request's blocks (random bytes); the
decode worker pulls them into its blocks; every token of every layer is
compared. Layouts (NHD, HND, block-major), block sizes and TP merges;
the producer's frees on the done notice and on lease expiry; a stale
sequence (the blocks freed and reused) fails instead of loading wrong KV."""
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM (./scripts/test makes build/venvs/vllm)")

import vllm_kit as K  # noqa: E402
from mstar_kv.integrations.vllm.metadata import LoadReq, StepMeta  # noqa: E402
from mstar_kv.integrations.vllm.params import parse_remote_prefill  # noqa: E402

PEER = Path(__file__).with_name("vllm_worker_peer.py")
SEED = 11


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return K.make_tiny_llama(tmp_path_factory.mktemp("tiny"), weights=False)


_ZYGOTE = {}


@pytest.fixture(scope="module", autouse=True)
def zygote(tmp_path_factory):
    """One process that imports vLLM once and forks every producer peer
    (each peer's own process, as before, without its 25 s of imports)."""
    sock = str(tmp_path_factory.mktemp("zygote") / "peer.sock")
    z = subprocess.Popen([sys.executable, str(PEER), "--zygote", sock], stdout=subprocess.PIPE,
                         text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    line = z.stdout.readline()
    assert line.strip() == "READY", line
    _ZYGOTE["sock"] = sock
    yield sock
    _ZYGOTE.clear()
    z.kill()
    z.wait()


class Forked:
    """A peer forked by the zygote, with Popen's stdin, stdout, poll, wait
    and kill (it is the zygote's child: its exit is seen through a pidfd)."""

    def __init__(self, sock, argv, env):
        import json
        import socket
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(sock)
            socket.send_fds(s, [json.dumps({"argv": argv, "env": env}).encode()], [r_in, w_out])
            self.pid = int(s.recv(64))
        os.close(r_in)
        os.close(w_out)
        self.stdin = os.fdopen(w_in, "w")
        self.stdout = os.fdopen(r_out, "r")
        self._pidfd = os.pidfd_open(self.pid)
        self.returncode = None

    def wait(self, timeout=None):
        import select
        r, _, _ = select.select([self._pidfd], [], [], timeout)
        if not r:
            raise subprocess.TimeoutExpired(f"peer {self.pid}", timeout)
        self.returncode = 0
        return 0

    def poll(self):
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self):
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


class Producer:
    def __init__(self, model_dir, port, layout, blocks, tokens, tp=(0, 1), cell="kv_cells",
                 env=None, seed=SEED):
        argv = [str(PEER), str(model_dir), str(port), layout, ",".join(map(str, blocks)),
                str(tokens), str(seed), str(tp[0]), str(tp[1])]
        env = dict(os.environ, HF_HUB_OFFLINE="1", PEER_CELL_LAYOUT=cell, **(env or {}))
        self.p = Forked(_ZYGOTE["sock"], argv, env)
        line = self.p.stdout.readline()
        assert line.strip() == "READY", line

    def freed(self, timeout=10.0) -> bool:
        import select
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        return bool(r) and self.p.stdout.readline().strip() == "FREED"

    def close(self):
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.p.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def params(port, tokens, tp=1, cell="kv_cells"):
    return parse_remote_prefill({"do_remote_prefill": True, "mstar": {
        "v": 1, "engine": "ucx", "request_id": "p1", "host": "127.0.0.1", "port": port,
        "tp_size": tp, "block_size": K.PRODUCER_BS, "num_tokens": tokens, "cell_layout": cell}})


def consumer(model_dir, layout="LBNHC", block_size=32, extra=None, num_blocks=64,
             cell="kv_cells"):
    cfg = K.make_vllm_config(model_dir, "kv_consumer", dict(extra or {}, cell_layout=cell),
                             block_size, layout=layout)
    kv = K.vllm_kv_tensors(cfg, num_blocks)
    return K.Glue(cfg, kv), kv


@contextlib.contextmanager
def consuming(model_dir, *args, **kw):
    """consumer(...), its connector shut down on the way out."""
    glue, kv = consumer(model_dir, *args, **kw)
    try:
        yield glue, kv
    finally:
        glue.close()


def pull(glue, load, finished_within=20.0):
    out = glue.step(StepMeta(load=[load]))
    deadline = time.monotonic() + finished_within
    recv = set(out.finished_recving or ()) if out else set()
    bad = set(out.invalid_block_ids or ()) if out else set()
    while load.req_id not in recv:
        assert time.monotonic() < deadline, "the load never finished"
        time.sleep(0.01)
        out = glue.step()
        if out:
            recv |= set(out.finished_recving or ())
            bad |= set(out.invalid_block_ids or ())
    return bad


CASES = [  # K|V storage, producer layout, consumer layout, consumer block size
    ("kv_cells", "LBNHC", "LBNHC", 32),
    ("kv_cells", "LBNHC", "LBHNC", 32),   # NHD -> HND
    ("kv_cells", "BLNHC", "LBNHC", 32),   # block-major producer
    ("kv_cells", "LBNHC", "LBNHC", 64),   # another block size
    ("kv_cells", "LBHNC", "BLHNC", 16),
    ("kv_planes", "LBHNC", "LBHNC", 32),  # the CPU backend's K and V planes
    ("kv_planes", "BLHNC", "LBHNC", 32),
]


@pytest.mark.parametrize("cell,p_layout,c_layout,c_bs", CASES)
def test_pull_lands_the_producers_bytes_in_vllms_blocks(model_dir, cell, p_layout, c_layout,
                                                        c_bs):
    port = K.free_port()
    n = 150
    p_blocks = [9, 3, 40, 17, 22]            # 5 blocks of 32 (scattered)
    with (Producer(model_dir, port, p_layout, p_blocks, n, cell=cell) as prod,
          consuming(model_dir, c_layout, c_bs, cell=cell) as (glue, kv)):
        c_blocks = [(7 * j + 5) % 64 for j in range((n + c_bs - 1) // c_bs)]
        assert len(set(c_blocks)) == len(c_blocks)
        assert K.check_request(kv, c_blocks, SEED, 0, n), "test set-up: zeros already match?"
        bad = pull(glue, LoadReq("d1", params(port, n, cell=cell), c_blocks, 0, n))
        assert not bad
        assert K.check_request(kv, c_blocks, SEED, 0, n) == []
        st = glue.connector.consumer.stats
        assert st["loads_ok"] == 1 and st["tokens_loaded"] == n
        assert prod.freed(), "the producer did not free on the done notice"


def test_a_step_that_computes_nothing_reports_the_pull_it_started(model_dir):
    """vLLM sleeps 1 ms after a step with nothing scheduled: such a step
    (StepMeta.idle) waits up to idle_wait_ms for its pull, which is then
    reported by the step that started it, not a later one."""
    port = K.free_port()
    n = 150
    with (Producer(model_dir, port, "LBNHC", [9, 3, 40, 17, 22], n),
          consuming(model_dir, extra={"idle_wait_ms": 1000}) as (glue, kv)):
        c_blocks = [4, 8, 15, 16, 23]
        # A load through the side channel and the engine: milliseconds at least.
        t0 = time.monotonic()
        out = glue.step(StepMeta(load=[LoadReq("d1", params(port, n), c_blocks, 0, n)],
                                 idle=True))
        took = time.monotonic() - t0
        assert out and "d1" in (out.finished_recving or ()), \
            f"the idle step returned after {took * 1e3:.1f} ms without reporting the pull"
        assert not out.invalid_block_ids
        assert K.check_request(kv, c_blocks, SEED, 0, n) == []


def test_kv_planes_with_another_block_size_fail_the_load(model_dir):
    """The CPU backend's K and V planes do not map across block sizes: the
    load fails (vLLM recomputes) instead of landing misplaced rows."""
    port = K.free_port()
    with (Producer(model_dir, port, "LBHNC", [1, 2], 50, cell="kv_planes"),
          consuming(model_dir, "LBHNC", 64, cell="kv_planes") as (glue, kv)):
        assert pull(glue, LoadReq("d1", params(port, 50, cell="kv_planes"), [4], 0, 50)) == {4}
        assert bool((kv[sorted(kv)[0]][4] == 0).all())


def test_layer_by_layer_each_layer_lands_once_the_producer_marked_it(model_dir):
    """The producer publishes before its layers are written and marks each as
    saved (KVCachePool.mark_layers_ready); the decode connector streams
    (layerwise) and its wait for a layer returns once that layer's bytes
    are in vLLM's blocks, while the next layer is still untouched."""
    port = K.free_port()
    n = 100
    c_blocks = [20, 21, 22, 23]
    with (Producer(model_dir, port, "LBNHC", [3, 1, 4, 2], n,
                   env={"PEER_LAYERWISE": "1"}) as prod,
          consuming(model_dir, extra={"layerwise": True}) as (glue, kv)):
        names = sorted(kv, key=lambda x: kv[x].data_ptr())
        glue.step(StepMeta(load=[LoadReq("d1", params(port, n), c_blocks, 0, n)]))
        time.sleep(0.5)
        assert K.check_request(kv, c_blocks, SEED, 0, n, layers=[0]), "layer 0 before its mark"
        for layer in range(len(names)):
            prod.p.stdin.write("next\n")
            prod.p.stdin.flush()
            assert prod.p.stdout.readline().strip() == f"MARKED {layer}"
            t0 = time.monotonic()
            while glue.connector.consumer.pending() and not any(
                    ld.stream for ld in glue.connector.consumer._loads.values()):
                time.sleep(0.01)  # the stream is opened once the sequence is fetched
            # The stream's layer wait (vLLM's wait_for_layer_load does not
            # wait: loads are asynchronous).
            glue.connector.consumer.wait_layer(layer, 20)
            assert time.monotonic() - t0 < 20
            assert K.check_request(kv, c_blocks, SEED, 0, n, layers=[layer]) == []
            for later in range(layer + 1, len(names)):
                assert all(bool((kv[names[later]][b] == 0).all()) for b in c_blocks)
        deadline = time.monotonic() + 10
        while not getattr(glue.step(), "finished_recving", None):  # None: nothing finished
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert K.check_request(kv, c_blocks, SEED, 0, n) == []


def test_prefix_hit_pulls_only_the_missing_tokens(model_dir):
    port = K.free_port()
    n = 120
    with (Producer(model_dir, port, "LBNHC", [1, 2, 3, 4], n),
          consuming(model_dir) as (glue, kv)):
        c_blocks = [10, 11, 12, 13]
        for t in kv.values():
            t[10].fill_(3.0)   # the "locally cached" first block stays untouched
        assert not pull(glue, LoadReq("d1", params(port, n), c_blocks, 32, n))
        assert K.check_request(kv, c_blocks, SEED, 32, n) == []
        assert all(bool((t[10] == 3.0).all()) for t in kv.values())
        assert glue.connector.consumer.stats["tokens_loaded"] == n - 32


def test_tp_merge_two_prefill_ranks_into_one_decode_rank(model_dir):
    port = K.free_port_pair()
    n = 70
    with contextlib.ExitStack() as stack:
        prods = [stack.enter_context(Producer(model_dir, port, "LBHNC", [5, 6, 7], n, tp=(r, 2)))
                 for r in range(2)]
        glue, kv = stack.enter_context(consuming(model_dir))
        c_blocks = [30, 20, 10]
        assert not pull(glue, LoadReq("d1", params(port, n, tp=2), c_blocks, 0, n))
        assert K.check_request(kv, c_blocks, SEED, 0, n) == []
        assert all(p.freed() for p in prods)


def test_owner_gone_reports_the_blocks_invalid(model_dir):
    port = K.free_port()
    prod = Producer(model_dir, port, "LBNHC", [1, 2], 50)
    prod.p.kill()
    prod.p.wait()
    with consuming(model_dir, extra={"fetch_timeout_s": 1.0}) as (glue, kv):
        t0 = time.monotonic()
        bad = pull(glue, LoadReq("d1", params(port, 50), [4, 5], 0, 50))
        assert bad == {4, 5} and time.monotonic() - t0 < 10
        assert glue.connector.consumer.stats["loads_failed"] == 1


def test_lease_expiry_frees_and_a_late_reader_fails(model_dir):
    port = K.free_port()
    with Producer(model_dir, port, "LBNHC", [1, 2], 50, env={"PEER_LEASE_S": "1.0"}) as prod:
        t0 = time.monotonic()
        assert prod.p.stdout.readline().strip() == "FREED"   # nobody read it
        assert time.monotonic() - t0 < 5
        with consuming(model_dir, extra={"fetch_timeout_s": 1.0}) as (glue, kv):
            bad = pull(glue, LoadReq("d1", params(port, 50), [4, 5], 0, 50))
            assert bad == {4, 5}
            assert K.check_request(kv, [4, 5], SEED, 0, 50)  # nothing was loaded


def test_abort_mid_load_still_reports_it_finished(model_dir):
    port = K.free_port()
    with (Producer(model_dir, port, "LBNHC", [1, 2], 50),
          consuming(model_dir) as (glue, kv)):
        load = LoadReq("d1", params(port, 50), [4, 5], 0, 50)
        glue.step(StepMeta(load=[load], cancel=["d1"]))
        deadline = time.monotonic() + 10
        done = set()
        while "d1" not in done:
            assert time.monotonic() < deadline
            out = glue.step()
            done |= set((out.finished_recving or ()) if out else ())
            time.sleep(0.01)


# -- MLA: one latent vector per token, the same on every TP rank ------------
@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    return K.make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-dsv2"), weights=False)


@pytest.mark.parametrize("c_bs", [32, 64, 16])
def test_mla_latent_lands_byte_exact_in_vllms_blocks(mla_dir, c_bs):
    port = K.free_port()
    n = 150
    with (Producer(mla_dir, port, "LBNHC", [9, 3, 7, 1, 5], n, cell="latent") as prod,
          consuming(mla_dir, block_size=c_bs, cell="latent") as (glue, kv)):
        assert next(iter(kv.values())).shape[1:] == (1, c_bs, K.MLA_LATENT)
        c_blocks = list(range(40, 40 + -(-n // c_bs)))
        assert not pull(glue, LoadReq("d1", params(port, n, cell="latent"), c_blocks, 0, n))
        assert K.check_request(kv, c_blocks, SEED, 0, n) == []
        assert prod.freed()


def test_mla_two_prefill_ranks_one_decode_rank_reads_one_rank_whole(mla_dir):
    """TP 2 -> 1: the latent is not split by heads: the decode rank reads
    all of it from one prefill rank (rank 1 holds other bytes here, so a
    read that mixed the ranks would show), and both ranks are told done."""
    port = K.free_port_pair()
    n = 70
    with contextlib.ExitStack() as stack:
        prods = [stack.enter_context(Producer(mla_dir, port, "LBNHC", [5, 6, 7], n, tp=(r, 2),
                                              cell="latent", seed=SEED + r)) for r in range(2)]
        glue, kv = stack.enter_context(consuming(mla_dir, cell="latent"))
        c_blocks = [30, 20, 10]
        assert not pull(glue, LoadReq("d1", params(port, n, tp=2, cell="latent"), c_blocks, 0, n))
        assert K.check_request(kv, c_blocks, SEED, 0, n) == []
        assert all(p.freed() for p in prods)


def test_mla_one_prefill_rank_two_decode_ranks_each_read_it_whole(mla_dir, monkeypatch):
    """TP 1 -> 2: each decode rank pulls the whole latent; the prefill frees
    the request after both ranks' done notices, not the first."""
    from mstar_kv.integrations.vllm import connector as conn_mod
    port = K.free_port()
    n = 90
    with Producer(mla_dir, port, "LBNHC", [2, 4, 6], n, cell="latent") as prod:
        for rank in range(2):
            monkeypatch.setattr(conn_mod, "_tp", lambda _c, r=rank: (r, 2))
            with consuming(mla_dir, cell="latent") as (glue, kv):
                c_blocks = [11 + rank, 21, 31]
                assert not pull(glue, LoadReq(f"d{rank}", params(port, n, cell="latent"),
                                              c_blocks, 0, n))
                assert K.check_request(kv, c_blocks, SEED, 0, n) == []
            if rank == 0:
                assert not prod.freed(timeout=1.0), "freed before the second rank's pull"
        assert prod.freed()


def test_mla_decode_ranks_spread_over_the_prefill_ranks(mla_dir, monkeypatch):
    """TP 2 -> 2: decode rank r reads prefill rank r (the ranks hold other
    bytes here), so the pulls spread over the prefill ranks."""
    from mstar_kv.integrations.vllm import connector as conn_mod
    port = K.free_port_pair()
    n = 40
    with contextlib.ExitStack() as stack:
        prods = [stack.enter_context(Producer(mla_dir, port, "LBNHC", [3, 8], n, tp=(r, 2),
                                              cell="latent", seed=SEED + r)) for r in range(2)]
        for rank in range(2):
            monkeypatch.setattr(conn_mod, "_tp", lambda _c, r=rank: (r, 2))
            with consuming(mla_dir, cell="latent") as (glue, kv):
                c_blocks = [12, 13]
                assert not pull(glue, LoadReq(f"d{rank}", params(port, n, tp=2, cell="latent"),
                                              c_blocks, 0, n))
                assert K.check_request(kv, c_blocks, SEED + rank, 0, n) == [], f"rank {rank}"
        assert all(p.freed() for p in prods)
