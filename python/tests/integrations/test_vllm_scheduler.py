"""MstarKVConnector's scheduler side driven by vLLM 0.34's real Scheduler
(build/venvs/vllm): remote prefill -> asynchronous load -> finished; the
producer's delayed free; abort mid-load; a load error (the producer's owner
gone) -> recompute; preemption; a decode-side prefix-cache hit where only
the missing blocks move. The worker side is played by the test (it reports
what the real workers would); the data path is test_vllm_worker.py's."""
import pytest

vllm = pytest.importorskip("vllm", reason="needs vLLM (./scripts/test makes build/venvs/vllm)")

import vllm_kit as K  # noqa: E402
from mstar_kv.integrations.vllm.params import parse_remote_prefill  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

BS = 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return K.make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), weights=False)


def producer(model_dir, num_blocks=64):
    cfg = K.make_vllm_config(model_dir, "kv_producer", {"side_channel_port": 31000}, BS)
    return K.make_scheduler(cfg, num_blocks)


def consumer(model_dir, num_blocks=64, batched=256):
    cfg = K.make_vllm_config(model_dir, "kv_consumer", {}, BS, max_num_batched_tokens=batched)
    return K.make_scheduler(cfg, num_blocks)


def step(sched, token=7, **kvo):
    so = sched.schedule()
    reqs = [sched.requests[r] for r in so.num_scheduled_tokens]
    out = sched.update_from_output(so, K.model_output(reqs, token, **kvo))
    return so, out


def outputs_of(engine_outputs):
    return [o for eo in engine_outputs.values() for o in eo.outputs]


def meta(so):
    return so.kv_connector_metadata.step


def prefill_params(model_dir, prompt, p=None, req_id="p1"):
    """Runs a prompt through a producer; returns (params, producer, req, the
    step's metadata)."""
    p = p or producer(model_dir)
    req = K.make_request(req_id, prompt, 1, {"do_remote_decode": True}, BS)
    p.add_request(req)
    so, out = step(p)
    (o,) = outputs_of(out)
    assert o.finish_reason is not None
    return o.kv_transfer_params, p, req, meta(so)


def remote_prefilled(model_dir, prompt, max_tokens):
    """A consumer scheduler with request "d1" of the prompt added, its KV
    that of the producer's request "p1" (prefill_params); returns (the
    scheduler, the request)."""
    params, _, _, _ = prefill_params(model_dir, prompt)
    d = consumer(model_dir)
    req = K.make_request("d1", prompt, max_tokens, params, BS)
    d.add_request(req)
    return d, req


def free_blocks(sched):
    return sched.kv_cache_manager.block_pool.get_num_free_blocks()


def test_producer_publishes_before_the_forward_pass_and_keeps_blocks_until_sent(model_dir):
    prompt = list(range(10, 10 + 70))  # 3 blocks of 32
    params, p, req, m0 = prefill_params(model_dir, prompt)
    m = params["mstar"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (m["request_id"], m["num_tokens"], m["block_size"], m["tp_size"], m["port"]) == \
        ("p1", 70, BS, 1, 31000)
    # The step that runs the prompt tells the workers to publish exactly its
    # blocks, with no layer written yet (they mark them as the forward pass
    # saves them), under the epoch the params name: by the time a decode
    # has the params, the pages are published and written.
    (pub,) = m0.publish
    assert pub.req_id == "p1" and pub.num_tokens == 70 and len(pub.block_ids) == 3
    assert pub.layers_ready == 0 and pub.epoch > 0
    # Before the workers' handshake reached the scheduler the params carry
    # no descriptor (the decode then asks the side channel); after it, they
    # carry everything a pull needs.
    assert "descs" not in m and "epoch" not in m
    p.connector.scheduler.set_descriptors({0: b"desc-of-rank-0"})
    params2, _, _, m2 = prefill_params(model_dir, list(range(300, 340)), p, "p2")
    (pub2,) = m2.publish
    rp = parse_remote_prefill(params2)
    assert rp.direct and rp.descs == (b"desc-of-rank-0",)
    assert list(rp.pages) == pub2.block_ids and rp.epoch == pub2.epoch != pub.epoch
    held = free_blocks(p)
    so, _ = step(p)
    assert not meta(so).publish  # published once
    for _ in range(3):  # delayed free: still held while the workers hold them
        step(p)
        assert free_blocks(p) == held and "p1" in p.requests
    step(p, finished_sending={"p1"})
    assert "p1" not in p.requests and free_blocks(p) == held + 3


def test_prefix_shared_blocks_keep_the_epoch_of_their_first_publication(model_dir):
    """The producer's prefix cache gives a second request the blocks of a
    first one still published: its params name those pages with the first
    one's epoch (the workers' pool keeps it while any holder does) and its
    own pages with its own; once no publication holds them, a third request
    over the same cached blocks gets a fresh epoch for all of them."""
    shared = list(range(500, 564))  # two full blocks of 32
    p = producer(model_dir)
    p.connector.scheduler.set_descriptors({0: b"desc-of-rank-0"})
    a, _, _, _ = prefill_params(model_dir, shared + list(range(1, 7)), p)
    b, _, _, _ = prefill_params(model_dir, shared + list(range(7, 40)), p, "p2")
    ma, mb = a["mstar"], b["mstar"]
    assert ma["page_epochs"] == [] and mb["epoch"] != ma["epoch"]
    assert mb["pages"][:2] == ma["pages"][:2]  # vLLM's prefix cache shared them
    assert mb["page_epochs"] == [[ma["pages"][0], ma["epoch"]], [ma["pages"][1], ma["epoch"]]]
    step(p, finished_sending={"p1"})  # the first one freed: the second still holds them
    c, _, _, _ = prefill_params(model_dir, shared + list(range(40, 45)), p, "p3")
    assert c["mstar"]["page_epochs"] == mb["page_epochs"]
    step(p, finished_sending={"p2", "p3"})
    step(p)
    d, _, _, _ = prefill_params(model_dir, shared + list(range(50, 55)), p, "p4")
    assert d["mstar"]["pages"][:2] == ma["pages"][:2] and d["mstar"]["page_epochs"] == []


def test_shared_pages_are_named_in_page_order_whatever_the_groups_order():
    """A hybrid request's pages go group after group (a Mamba state block
    first, whatever its id), and vLLM hands out block ids in any order: the
    exceptions a descriptor carries are in page order, which the
    descriptor's reader requires (an unordered list failed every pull of a
    prefix-shared Mamba request as a corrupt descriptor)."""
    import mstar_kv as kv
    from mstar_kv.integrations.vllm.scheduler import PageEpochs
    e = PageEpochs()
    first, _ = e.hold("a", [9, 4, 5, 6])
    epoch, shared = e.hold("b", [12, 9, 5, 4])
    assert shared == [(4, first), (5, first), (9, first)] and epoch != first
    info = kv.KVTransferInfo("ucx", b"x")
    info.epoch = epoch
    info.page_epochs = list(shared)
    assert list(kv.KVTransferInfo.from_bytes(info.to_bytes()).page_epochs) == shared
    with pytest.raises(kv.CorruptDescriptorError, match="names page 4 after page 9"):
        info.page_epochs = [shared[2], shared[0]]


def test_remote_prefill_loads_asynchronously_then_runs(model_dir):
    prompt = list(range(100, 170))
    d, req = remote_prefilled(model_dir, prompt, 4)
    so, out = step(d)
    assert so.num_scheduled_tokens == {}  # waiting for the remote KV
    (load,) = meta(so).load
    assert (load.req_id, load.start, load.end, load.remote.request_id) == ("d1", 0, 70, "p1")
    assert len(load.block_ids) == 3
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.kv_transfer_params["do_remote_prefill"] is False  # one transfer only
    step(d)  # still loading: nothing runs
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step(d, finished_recving={"d1"})
    so, _ = step(d)
    # Only the last prompt token is recomputed (to sample the first token).
    assert so.num_scheduled_tokens == {"d1": 1} and not meta(so).load
    for _ in range(3):
        so, out = step(d)
    assert req.is_finished() and len(req.output_token_ids) == 4


def test_decode_prefix_hit_moves_only_the_missing_blocks(model_dir):
    shared = list(range(200, 264))       # 2 full blocks
    a_prompt, b_prompt = shared + [1] * 20, shared + [2] * 40
    d = consumer(model_dir)
    params_a, _, _, _ = prefill_params(model_dir, a_prompt)
    a = K.make_request("a", a_prompt, 1, params_a, BS)
    d.add_request(a)
    so, _ = step(d)
    assert (meta(so).load[0].start, meta(so).load[0].end) == (0, 84)
    step(d, finished_recving={"a"})
    step(d)
    assert a.is_finished()
    params_b, _, _, _ = prefill_params(model_dir, b_prompt)
    b = K.make_request("b", b_prompt, 1, params_b, BS)
    d.add_request(b)
    so, _ = step(d)
    (load,) = meta(so).load
    assert (load.start, load.end) == (64, 104)  # the two shared blocks stay local
    assert load.block_ids[:2] == [blk for blk in d.kv_cache_manager.get_block_ids("b")[0][:2]]


def test_nothing_left_to_pull_only_releases_the_producer(model_dir):
    """The remote holds no token beyond the local prefix-cache hit (vLLM
    always computes a prompt's last token itself, so a hit stops a block
    short of a whole prompt): nothing moves, the producer is told to free."""
    prompt = list(range(300, 364)) + [5]
    d = consumer(model_dir)
    params, _, _, _ = prefill_params(model_dir, prompt)
    d.add_request(K.make_request("x", prompt, 1, params, BS))
    step(d)
    step(d, finished_recving={"x"})
    step(d)
    params2 = dict(params, mstar=dict(params["mstar"], request_id="p2", num_tokens=32),
                   do_remote_prefill=True)
    y = K.make_request("y", prompt[:64], 1, params2, BS)  # its first 32 tokens hit here
    d.add_request(y)
    so, _ = step(d)
    assert not meta(so).load and [r.remote.request_id for r in meta(so).release] == ["p2"]


def test_abort_mid_load_cancels_and_frees_once_the_worker_reports(model_dir):
    prompt = list(range(400, 470))
    params, _, _, _ = prefill_params(model_dir, prompt)
    d = consumer(model_dir)
    free0 = free_blocks(d)
    req = K.make_request("d1", prompt, 4, params, BS)
    d.add_request(req)
    step(d)
    d.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    so, _ = step(d)
    assert meta(so).cancel == ["d1"]
    assert free_blocks(d) == free0 - 3  # the pull may still write them
    step(d, finished_recving={"d1"})
    assert free_blocks(d) == free0 and "d1" not in d.requests


def test_abort_before_the_load_started_releases_the_producer(model_dir):
    prompt = list(range(500, 540))
    d, _ = remote_prefilled(model_dir, prompt, 4)
    d.finish_requests("d1", RequestStatus.FINISHED_ABORTED)
    so, _ = step(d)
    assert [r.remote.request_id for r in meta(so).release] == ["p1"] and not meta(so).load


def test_load_error_recomputes_the_prompt(model_dir):
    """The owner is gone: the worker reports the load finished with its
    blocks invalid; vLLM (policy recompute) recomputes them."""
    prompt = list(range(600, 670))
    d, req = remote_prefilled(model_dir, prompt, 2)
    so, _ = step(d)
    (load,) = meta(so).load
    step(d, finished_recving={"d1"}, invalid_block_ids=set(load.block_ids))
    so, _ = step(d)
    assert so.num_scheduled_tokens == {"d1": 70}  # the whole prompt, computed here
    assert not meta(so).load
    step(d)
    assert req.is_finished() and len(req.output_token_ids) == 2


def test_partial_load_error_keeps_the_valid_prefix(model_dir):
    prompt = list(range(700, 770))
    d, req = remote_prefilled(model_dir, prompt, 1)
    so, _ = step(d)
    (load,) = meta(so).load
    step(d, finished_recving={"d1"}, invalid_block_ids={load.block_ids[2]})
    so, _ = step(d)
    assert so.num_scheduled_tokens == {"d1": 70 - 64}


def test_preempted_after_its_load_recomputes_without_a_second_pull(model_dir):
    prompt = list(range(800, 862))  # 2 blocks; its third output needs a third
    params, _, _, _ = prefill_params(model_dir, prompt)
    d = consumer(model_dir, num_blocks=4)  # 3 usable blocks
    other = K.make_request("o", list(range(5000, 5020)), 40, None, BS)  # grows to 2 blocks
    d.add_request(other)
    step(d)
    req = K.make_request("d1", prompt, 8, params, BS)
    d.add_request(req)
    so, _ = step(d)
    assert len(meta(so).load) == 1
    step(d, finished_recving={"d1"})
    loads, preempted = [], False
    for _ in range(80):
        so, _ = step(d)
        loads += meta(so).load
        preempted |= req.num_preemptions > 0
        if req.is_finished() and other.is_finished():
            break
    assert preempted, "the test did not preempt the loaded request"
    assert loads == [] and req.is_finished() and len(req.output_token_ids) == 8
    assert other.is_finished()


def test_malformed_params_are_ignored_with_a_warning(model_dir, caplog):
    d = consumer(model_dir)
    req = K.make_request("d1", list(range(40)), 1,
                         {"do_remote_prefill": True, "mstar": {"v": 1, "engine": "tcp"}}, BS)
    d.add_request(req)
    so, _ = step(d)
    assert so.num_scheduled_tokens == {"d1": 40} and not meta(so).load
    assert "engine" in caplog.text


def early_producer(model_dir, batched=64, num_blocks=64):
    cfg = K.make_vllm_config(model_dir, "kv_producer",
                             {"side_channel_port": 31000, "publish_early": True}, BS,
                             max_num_batched_tokens=batched)
    return K.make_scheduler(cfg, num_blocks)


def test_publish_early_publishes_before_the_last_chunk_runs(model_dir):
    """publish_early: the step that schedules a remote-decode request's last
    prompt chunk publishes it (no layer ready yet: the workers mark them in
    save_kv_layer), under the client's mstar_request_id, with every block of
    the prompt; request_finished hands over the same name and publishes
    nothing more; the blocks stay held until the workers report them sent."""
    p = early_producer(model_dir)
    prompt = list(range(10, 10 + 150))  # 3 chunks of 64 tokens; 5 blocks
    req = K.make_request("p1", prompt, 1, {"do_remote_decode": True,
                                          "mstar_request_id": "proxy-7"}, BS)
    p.add_request(req)
    for _ in range(2):  # two chunks that are not the last
        so = p.schedule()
        assert so.num_scheduled_tokens == {"p1": 64} and not meta(so).publish
        p.update_from_output(so, K.model_output([req], partial={"p1"}))
    so = p.schedule()  # the last chunk: published before its forward pass
    (pub,) = meta(so).publish
    assert (pub.req_id, pub.name, pub.num_tokens, pub.layers_ready) == ("p1", "proxy-7", 150, 0)
    assert pub.block_ids == p.kv_cache_manager.get_block_ids("p1")[0][:5]
    held = free_blocks(p)
    out = p.update_from_output(so, K.model_output([req]))
    (o,) = outputs_of(out)
    m = o.kv_transfer_params["mstar"]
    assert (m["request_id"], m["num_tokens"]) == ("proxy-7", 150)
    so, _ = step(p)
    assert not meta(so).publish and not meta(so).unpublish
    assert free_blocks(p) == held and "p1" in p.requests
    step(p, finished_sending={"p1"})
    assert "p1" not in p.requests and free_blocks(p) == held + 5


def test_publish_early_then_aborted_unpublishes(model_dir):
    """A request published early and aborted before it finished: the workers
    are told to unpublish (its readers fail: stale pages, they recompute)
    and report it, and vLLM frees its blocks only then."""
    p = early_producer(model_dir, batched=256)
    prompt = list(range(300, 370))
    req = K.make_request("p2", prompt, 5, {"do_remote_decode": True}, BS)
    p.add_request(req)
    so = p.schedule()
    (pub,) = meta(so).publish
    assert pub.name == "p2" and pub.layers_ready == 0
    p.update_from_output(so, K.model_output([req]))
    held = free_blocks(p)
    p.finish_requests("p2", RequestStatus.FINISHED_ABORTED)
    so, _ = step(p)
    (un,) = meta(so).unpublish
    assert (un.req_id, un.name, un.report) == ("p2", "p2", True) and not meta(so).publish
    assert free_blocks(p) == held
    step(p, finished_sending={"p2"})
    assert free_blocks(p) == held + 3 and "p2" not in p.requests


def test_a_kv_cache_group_it_cannot_move_is_refused_by_name_at_engine_start(model_dir):
    """A hybrid model's groups are moved (groups.py), but a group the
    connector cannot move (here Mamba state with speculative blocks,
    beside attention) fails the connector's construction, in both roles,
    naming the group: not a request later. The same model without them,
    with mamba_cache_mode 'none' or 'align' (prefix caching), is accepted."""
    import torch
    from mstar_kv.integrations.vllm import MstarKVConnector
    from mstar_kv.integrations.vllm.layout import LayoutError
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )
    cfg = K.make_vllm_config(model_dir, "kv_consumer", {}, BS)
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)

    def kcc(mode, spec_blocks=0):
        mamba = MambaSpec(block_size=BS, shapes=((3, 256), (4, 64, 16)),
                          dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode,
                          num_speculative_blocks=spec_blocks)
        return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
            KVCacheGroupSpec(["model.layers.1.self_attn.attn"], attn),
            KVCacheGroupSpec(["model.layers.0.mixer", "model.layers.2.mixer"], mamba)])
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        with pytest.raises(LayoutError, match=r"cannot move: group 1 \(MambaSpec, 2 layers: "
                           r"model.layers.0.mixer, ...\): Mamba state with "
                           r"mamba_cache_mode 'align' and 1 speculative blocks is not moved"):
            MstarKVConnector(cfg, role, kcc("align", 1))
    for mode in ("none", "align"):
        c = MstarKVConnector(cfg, KVConnectorRole.SCHEDULER, kcc(mode))
        assert [g.name for g in c.groups] == ["full", "mamba"]
    # One group: the one-group path, as before.
    one = KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                        kv_cache_groups=kcc("none").kv_cache_groups[:1])
    assert MstarKVConnector(cfg, KVConnectorRole.SCHEDULER, one).groups == []
