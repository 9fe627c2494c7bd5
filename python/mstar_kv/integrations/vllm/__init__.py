"""mstar-kv as a vLLM KV connector (disaggregated prefill/decode, pull model).

Load it in vLLM with::

    KVTransferConfig(kv_connector="MstarKVConnector",
                     kv_connector_module_path="mstar_kv.integrations.vllm",
                     kv_role="kv_producer" | "kv_consumer" | "kv_both",
                     kv_connector_extra_config={"engine": "ucx", ...},
                     kv_load_failure_policy="recompute")   # a failed pull recomputes

See docs/integrations/vllm.md. vLLM is imported only when MstarKVConnector
is first used, so ``import mstar_kv`` works without vLLM.
"""
from __future__ import annotations

from .params import ConnectorConfig, RemotePrefill, make_decode_params, parse_remote_prefill

__all__ = ["ConnectorConfig", "MstarKVConnector", "RemotePrefill", "make_decode_params",
           "parse_remote_prefill"]


def __getattr__(name: str):
    # vLLM's KVConnectorFactory does getattr(module, "MstarKVConnector").
    if name in ("MstarKVConnector", "MstarConnectorMetadata"):
        from . import connector
        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
