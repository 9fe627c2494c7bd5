"""mstar_kv.integrations.mstar between two real processes: a producer
worker (mstar_peer.py: upstream's KVCache, a LocalTransferEngine or a
MooncakeTransferEngine around the real wheel) publishes pickled
request-scoped descriptors; this process pulls them as upstream's KVManager
does and compares every byte with what the producer holds. Both tensor
orders; stale reads after remove_request and a new reset_generation; an
owner killed fails only its own request's future; nothing is left in
/dev/shm after kill -9 of the producer."""
import os
import pickle
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (./scripts/test installs it)")

import mstar_kv as kv  # noqa: E402
import mstar_upstream as up  # noqa: E402
from conftest import LineProcess  # noqa: E402
from mstar_kv.integrations.mstar import KVTransferManager, TransferEngineInfo  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import mooncake.engine  # noqa: F401
    HAVE_MOONCAKE = True
except ImportError:
    HAVE_MOONCAKE = False


class Producer(LineProcess):
    def __init__(self, order, engine="local", seed=1, resource_key="kv"):
        env = dict(os.environ, GLOG_minloglevel="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), HERE]))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "mstar_peer.py"), order, engine,
             "--seed", str(seed), "--resource-key", resource_key],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline()
        assert line.startswith("READY"), f"producer did not start: {line!r}"
        self.expected = up.KVCache(order)
        self.expected.tensor.copy_(up.content(self.expected, seed))

    def publish(self, rid, pages, seq_len, label="main", gen="-"):
        answer = self.command(f"publish {rid} {label} {','.join(map(str, pages))} {seq_len} {gen}")
        assert answer.startswith("INFO "), answer
        return pickle.loads(bytes.fromhex(answer.split()[1]))


@pytest.fixture
def producers():
    made = []

    def make(*args, **kw):
        p = Producer(*args, **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def consumer(order, engine="local"):
    cache = up.KVCache(order)
    te = up.LocalTransferEngine("consumer") if engine == "local" else up.MooncakeTransferEngine()
    return cache, KVTransferManager(TransferEngineInfo("consumer", "s", te), cache)


ENGINES = ["local", pytest.param("mooncake", marks=pytest.mark.skipif(
    not HAVE_MOONCAKE, reason="the Mooncake wheel is not installed"))]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("order", up.ORDERS)
def test_pull_of_another_process_moves_only_requested_pages_and_tokens(producers, order, engine):
    p = producers(order, engine)
    cache, m = consumer(order, engine)
    info = p.publish("req", [6, 1, 4], 10, label="cfg_img", gen=0)
    assert (info.request_id, info.label, info.seq_len) == ("req", "cfg_img", 10)
    assert m.start_async_retrieve(0, 10, [0, 5, 2], [6, 1, 4], info).result(timeout=30) > 0
    src = p.expected
    assert torch.equal(cache.page(0), src.page(6)) and torch.equal(cache.page(5), src.page(1))
    assert torch.equal(cache.page(2)[:, :, :2], src.page(4)[:, :, :2])
    assert not cache.page(2)[:, :, 2:].any()
    for page in (1, 3, 4, 6, 7):
        assert not cache.page(page).any(), page
    assert p.publish("req", [6, 1, 4], 10, label="cfg_img", gen=0) == info  # equal again
    m.cleanup()


@pytest.mark.parametrize("engine", ENGINES)
def test_stale_after_remove_and_after_a_new_generation_in_another_process(producers, engine):
    p = producers("layer_page", engine)
    cache, m = consumer("layer_page", engine)
    old = p.publish("r", [3], 4, gen=0)
    assert p.command("rewrite 5 3") == "OK"  # computed again: another generation
    new = p.publish("r", [3], 4, gen=1)
    assert isinstance(m.start_async_retrieve(0, 4, [1], [3], old).exception(timeout=30),
                      kv.StaleDescriptorError)
    assert not cache.page(1).any()
    assert m.start_async_retrieve(0, 4, [1], [3], new).result(timeout=30) > 0
    fresh = up.content(p.expected, 5)
    assert torch.equal(cache.page(1), p.expected.page(3, fresh))
    assert p.command("remove r") == "OK"
    e = m.start_async_retrieve(0, 4, [1], [3], new).exception(timeout=30)
    assert isinstance(e, kv.StaleDescriptorError), e
    m.cleanup()


def test_an_owner_killed_fails_only_its_own_requests_future(producers):
    doomed = producers("layer", seed=1)
    healthy = producers("layer", seed=2)
    cache, m = consumer("layer")
    lost = doomed.publish("lost", [1, 2], 8)
    kept = healthy.publish("kept", [1, 2], 8)
    doomed.kill()
    failed = m.start_async_retrieve(0, 8, [0, 1], [1, 2], lost)
    done = m.start_async_retrieve(0, 8, [4, 5], [1, 2], kept)
    error = failed.exception(timeout=30)
    assert isinstance(error, (kv.NotFoundError, kv.StaleDescriptorError, kv.PeerFailureError)), error
    assert done.result(timeout=30) > 0
    assert torch.equal(cache.page(4), healthy.expected.page(1))
    assert not cache.page(0).any() and not cache.page(1).any()
    m.cleanup()


def test_nothing_is_left_in_dev_shm_after_kill_9_of_the_producer(producers):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm on this host")
    before = set(os.listdir("/dev/shm"))
    p = producers("layer_page")
    cache, m = consumer("layer_page")
    info = p.publish("r", list(range(8)), 32)
    assert m.start_async_retrieve(0, 32, list(range(8)), list(range(8)), info).result(30) > 0
    p.kill()
    left = set(os.listdir("/dev/shm")) - before
    assert not {name for name in left if name.startswith("mstar")}, left
    m.cleanup()
