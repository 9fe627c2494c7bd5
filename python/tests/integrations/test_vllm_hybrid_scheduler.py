"""MstarKVConnector's scheduler side for a hybrid model (a sliding-window
group of a 48-token window beside a full-attention group, 32-token blocks)
driven by vLLM 0.34's real Scheduler and KV cache manager
(build/venvs/vllm): the blocks it publishes per group are those vLLM's
block table of the request holds, the decode's load pairs each published
page with the block vLLM allocated for it in the same group (vLLM's null
block where the sliding window keeps nothing), and a decode of another TP
size than the producer loads alike (a state group between TP sizes:
test_vllm_state_tp.py, test_vllm_mamba_tp_e2e.py). The worker side is
played by the test; the data path is test_vllm_hybrid_e2e.py's."""
import pytest

pytest.importorskip("vllm", reason="needs vLLM (./scripts/test makes build/venvs/vllm)")

import torch  # noqa: E402
import vllm_kit as K  # noqa: E402
from mstar_kv.integrations.vllm.groups import check_groups, pair_pages  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

BS, WINDOW, NULL = 32, 48, 0


def hybrid_config(num_blocks: int) -> KVCacheConfig:
    spec = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                         SlidingWindowSpec(sliding_window=WINDOW, **spec)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**spec))])


def scheduler(model_dir, role: str, extra: dict, tp: int = 1, num_blocks: int = 64):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    cfg = K.make_vllm_config(model_dir, role, extra, BS)
    cfg.parallel_config.tensor_parallel_size = tp
    cfg.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=cfg, kv_cache_config=hybrid_config(num_blocks), log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=BS)


def step(sched, **kvo):
    so = sched.schedule()
    reqs = [sched.requests[r] for r in so.num_scheduled_tokens]
    return so, sched.update_from_output(so, K.model_output(reqs, 7, **kvo))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return K.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), weights=False)


@pytest.mark.parametrize("n", [40, 97, 150, 209])
@pytest.mark.parametrize("prefill_tp,decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_hybrid_blocks_published_and_loaded_per_group(model_dir, n, prefill_tp, decode_tp):
    prompt = [(i * 13) % 500 + 3 for i in range(n)]
    blocks = -(-n // BS)
    first = max(0, n - WINDOW) // BS  # the window of the decode's first computed token
    p = scheduler(model_dir, "kv_producer", {"side_channel_port": 31000}, prefill_tp)
    req = K.make_request("p1", prompt, 1, {"do_remote_decode": True}, BS)
    p.add_request(req)
    so, out = step(p)
    (pub,) = so.kv_connector_metadata.step.publish
    (o,) = [o for eo in out.values() for o in eo.outputs]
    m = o.kv_transfer_params["mstar"]
    assert m["tp_size"] == prefill_tp and m["num_tokens"] == n
    assert m["groups"] == [["sliding_window:48", first, blocks - first], ["full", 0, blocks]]
    # vLLM's own block table of the request: the window's blocks of the
    # sliding group (those before are its null block, or still held), then
    # every block of the full group.
    swa, full = p.kv_cache_manager.get_block_ids("p1")
    assert len(full) == blocks and NULL not in full and NULL not in swa[first:blocks]
    assert pub.block_ids == list(swa[first:blocks]) + list(full)
    assert pub.num_tokens == len(pub.block_ids) * BS
    held = p.kv_cache_manager.block_pool.get_num_free_blocks()
    step(p)  # delayed free: vLLM keeps the published blocks until the workers let go
    assert "p1" in p.requests and p.kv_cache_manager.get_block_ids("p1") == (swa, full)
    step(p, finished_sending={"p1"})
    assert "p1" not in p.requests
    assert p.kv_cache_manager.block_pool.get_num_free_blocks() > held

    c = scheduler(model_dir, "kv_consumer", {}, decode_tp)
    creq = K.make_request("d1", prompt, 4, dict(o.kv_transfer_params), BS)
    c.add_request(creq)
    so, _ = step(c)
    (load,) = so.kv_connector_metadata.step.load
    assert (load.start, load.end) == (0, n) and load.remote.tp_size == prefill_tp
    d_swa, d_full = c.kv_cache_manager.get_block_ids("d1")
    assert load.block_ids == [list(d_swa), list(d_full)]
    # vLLM nulls the sliding group's blocks before token n - WINDOW + 1
    # (get_num_skipped_tokens(n)); the connector moves the rest of the window.
    skipped = max(0, n - WINDOW + 1) // BS
    assert list(d_swa[:skipped]) == [NULL] * skipped and NULL not in d_swa[skipped:blocks]
    groups = check_groups(hybrid_config(64))
    remote, local = pair_pages(groups, m["groups"], pub.block_ids, load.block_ids,
                               load.start, load.end)
    want = [(swa[j], d_swa[j]) for j in range(max(first, skipped), blocks)] + \
        [(full[j], d_full[j]) for j in range(blocks)]
    assert list(zip(remote, local)) == want
    assert len(local) == 2 * blocks - max(first, skipped)
    # The load finished: the request computes its first token.
    so, _ = step(c, finished_recving={"d1"})
    so, _ = step(c)
    assert so.num_scheduled_tokens.get("d1", 0) >= 1 and creq.num_computed_tokens >= n
