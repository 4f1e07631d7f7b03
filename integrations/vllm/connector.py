"""``RayKVConnector``: raykv as vLLM's ``KVConnectorBase_V1``, a thin class whose methods
are grouped as vLLM's base class groups them and delegate to this process's side of the
connector: ``RayKVConnectorScheduler`` (role ``SCHEDULER``, one per engine) or
``RayKVConnectorWorker`` (role ``WORKER``, one per TP rank). See the package docstring
for the keys and the configuration."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
from raykv.integrations.vllm.connector_stats import (
    ConnectorStats,
    growth_from_vllm,
    growth_to_vllm,
)
from raykv.integrations.vllm.metadata import LandedReports, RayKVConnectorMetadata
from raykv.integrations.vllm.options import (
    ConnectorOptions,
    KVIdentity,
    check_attention_backends,
    kv_layout,
)
from raykv.integrations.vllm.scheduler import RayKVConnectorScheduler
from raykv.integrations.vllm.side import ConnectorSide
from raykv.integrations.vllm.vllm_stats import RayKVConnectorStats, RayKVPromMetrics, StatsDelta
from raykv.integrations.vllm.worker import RayKVConnectorWorker
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm." + __name__)  # shows up with vLLM's own log lines

__all__ = ["RayKVConnector", "RayKVConnectorMetadata", "kv_identity"]


def attention_backend(vllm_config: VllmConfig) -> str | None:
    """The name of the attention backend vLLM runs this model's layers with (``CPU_ATTN``,
    ``FLASH_ATTN``), chosen as vLLM's selector chooses it: the platform's choice for the
    model's head size, dtypes, block size and MLA, given the backend set in
    ``attention_config`` (None: vLLM's automatic choice). The same in the scheduler and
    in every worker of one engine; a worker checks it against the backend its layers
    really run (``check_attention_backends``), since a layer's own traits (sliding
    window, sinks) may change the choice. None if the platform cannot answer here (a
    scheduler on a host without the engine's device): the workers then refuse, naming
    the fix."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.selector import AttentionSelectorConfig

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    chosen = vllm_config.attention_config.backend
    try:
        selector = AttentionSelectorConfig(
            head_size=mc.get_head_size(), dtype=mc.dtype, kv_cache_dtype=cc.cache_dtype,
            block_size=cc.block_size if cc.user_specified_block_size else None,
            use_mla=mc.use_mla, use_kv_connector=True)
        with set_current_vllm_config(vllm_config):
            path = current_platform.get_attn_backend_cls(
                chosen, attn_selector_config=selector,
                num_heads=mc.get_num_attention_heads(vllm_config.parallel_config))
        return resolve_obj_by_qualname(path).get_name()
    except Exception as e:  # the workers check, and refuse if they run another
        log.warning("RayKVConnector: could not tell vLLM's attention backend here (%s)", e)
        return None if chosen is None else chosen.name


def kv_identity(vllm_config: VllmConfig) -> KVIdentity:
    """The identity of this engine's KV bytes from vLLM's own config (the same in the
    scheduler and in every worker): KV dtype (``cache_dtype``, ``auto`` resolved to the
    model's dtype), block size, the device and the attention backend vLLM runs
    (``attention_backend``, whether chosen explicitly or automatically) with raykv's
    ``PAGE_LAYOUT`` (``kv_layout``), the model revision."""
    from vllm.platforms import current_platform

    cc, mc = vllm_config.cache_config, vllm_config.model_config
    kv_dtype = cc.cache_dtype
    if kv_dtype == "auto":
        kv_dtype = str(mc.dtype).removeprefix("torch.")
    backend = attention_backend(vllm_config)
    return KVIdentity(kv_dtype=str(kv_dtype), page_size=cc.block_size,
                      layout=kv_layout(current_platform.device_type, backend),
                      model_revision=mc.revision or None, attn_backend=backend)


def running_backends(vllm_config: VllmConfig, layer_names) -> dict[str, str]:
    """Per attention layer of ``layer_names`` (those vLLM registered KV caches for) the
    name of the backend it runs (on a worker, once the model is loaded)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layers = get_layers_from_vllm_config(vllm_config, AttentionLayerBase, layer_names)
    return {name: layer.get_attn_backend().get_name() for name, layer in layers.items()}


class RayKVConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by raykv (see the package docstring).

    ``connector_scheduler`` (scheduler role) or ``connector_worker`` (worker role) is
    this process's side; the other is None. ``stats`` and ``tp_rank`` are that side's.
    vLLM calls worker-side methods on the worker role only, scheduler-side methods on
    the scheduler role only, ``shutdown`` on both."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        pc, mc = vllm_config.parallel_config, vllm_config.model_config
        kv = self._kv_transfer_config
        identity = kv_identity(vllm_config)
        opts = ConnectorOptions.parse(kv.kv_connector_extra_config,
                                      tp_size=pc.tensor_parallel_size,
                                      pp_size=pc.pipeline_parallel_size,
                                      served_model=mc.served_model_name or mc.model,
                                      identity=identity)
        events = vllm_config.kv_events_config
        opts = replace(opts, kv_events=bool(events and events.enable_kv_cache_events))
        # the default tag names the attention backend: the worker checks it is the one
        # it runs (a tag given explicitly is the operator's word for the bytes)
        self._tagged_backend = identity.attn_backend
        self._check_backend = "extra_backend_tag" not in (kv.kv_connector_extra_config
                                                          or {})
        if mc.use_mla:
            raise ValueError("RayKVConnector does not serve MLA models yet (their KV is "
                             "replicated across TP ranks and laid out differently)")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("RayKVConnector serves models with one KV cache group; this model "
                             f"has {len(kv_cache_config.kv_cache_groups)} (hybrid attention)")
        block_size = vllm_config.cache_config.block_size
        tp_rank = pp_rank = 0
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            tp_rank = get_tensor_model_parallel_rank()
            pp_rank = get_pp_group().rank_in_group
        log.info("RayKVConnector %s tp %d/%d: keys %s_%s_<block>_%d_kv, block_size %d",
                 role.name, tp_rank, pc.tensor_parallel_size, opts.extra_backend_tag,
                 opts.model_name.replace("/", "-"), tp_rank, block_size)
        if role == KVConnectorRole.SCHEDULER and kv.kv_load_failure_policy == "fail":
            log.warning("RayKVConnector: kv_load_failure_policy is 'fail' (vLLM's default): "
                        "a raykv load that fails (node actor restarting, object evicted, "
                        "deadline) then fails the request. Set kv_load_failure_policy="
                        "'recompute' in kv_transfer_config to recompute those blocks.")
        self.connector_scheduler: RayKVConnectorScheduler | None = None
        self.connector_worker: RayKVConnectorWorker | None = None
        if role == KVConnectorRole.WORKER:
            self.connector_worker = RayKVConnectorWorker(
                opts, kv_cache_config, block_size=block_size, tp_rank=tp_rank,
                tp_size=pc.tensor_parallel_size, pp_rank=pp_rank,
                pp_size=pc.pipeline_parallel_size)
        else:
            self.connector_scheduler = RayKVConnectorScheduler(
                opts, do_load=kv.kv_role in ("kv_both", "kv_consumer"),
                do_save=kv.kv_role in ("kv_both", "kv_producer"), block_size=block_size,
                tp_size=pc.tensor_parallel_size, pp_size=pc.pipeline_parallel_size,
                kv_cache_config=kv_cache_config)
        self._stats_delta = StatsDelta(self._side.stats, self._side.loads)

    @property
    def requires_kv_delivery(self) -> bool:
        """False, as vLLM's best-effort caches answer: raykv hands nothing off to another
        engine that waits for it, and a save lost when vLLM preempts a request is a
        future miss, so vLLM delivers a preempted request's output in flight (its
        lossless path) instead of dropping it and recomputing the request (what it does
        for connectors that hand KV off, the default of ``kv_both``)."""
        return False

    @property
    def _side(self) -> ConnectorSide:
        return self.connector_worker or self.connector_scheduler

    @property
    def stats(self) -> ConnectorStats:
        """This side's counters (``connector_stats.ConnectorStats``). Read on
        the side's vLLM thread: on the worker side, reading them first ends the L2 save
        behind the last step (``settle``), so that they count it."""
        self._side.settle()
        return self._side.stats

    @property
    def tp_rank(self) -> int:
        """This worker's TP rank (0 on the scheduler side)."""
        return self._side.tp_rank

    # ==============================
    # Worker-side methods
    # ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Checks that the layers run the attention backend the key tag names (default
        tag; ``ValueError`` naming the fix otherwise; layers vLLM does not know are not
        checked, with a warning), then the worker side's."""
        if self._check_backend and not check_attention_backends(
                self._tagged_backend, running_backends(self._vllm_config, kv_caches)):
            log.warning("RayKVConnector: none of the registered KV cache layers is one of "
                        "vLLM's attention layers; their backend is taken to be the tag's "
                        "(%s)", self._tagged_backend)
        self.connector_worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.connector_worker.start_load_kv(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        return  # every layer's blocks are saved together in wait_for_save

    def wait_for_save(self) -> None:
        self.connector_worker.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                               set[str] | None]:
        return self.connector_worker.get_finished(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.connector_worker.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> LandedReports | None:
        return self.connector_worker.get_kv_connector_kv_cache_events()

    def shutdown(self) -> None:
        self._side.shutdown()

    # ==============================
    # vLLM's stats (both sides)
    # ==============================

    def get_kv_connector_stats(self) -> RayKVConnectorStats | None:
        """What this side's counters grew by since vLLM last asked (None: nothing);
        vLLM asks on its scheduler thread after each step's output, on each worker
        after each step (``vllm_stats``). vLLM's scheduler asks once per step's output,
        in step order: the scheduler side's load guard takes it as the step's end
        (``load_choice.StepClock``)."""
        if self.connector_scheduler is not None:
            self.connector_scheduler.step_output()
        return self._stats_delta.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> \
            RayKVConnectorStats:
        """vLLM's stats of ``data`` (what a ``RayKVConnectorStats`` carried across
        vLLM's processes), read back and checked: ``ValueError`` naming any key raykv's
        counters do not have (``connector_stats.growth_from_vllm``)."""
        return RayKVConnectorStats(data=growth_to_vllm(growth_from_vllm(data or {})))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> \
            RayKVPromMetrics:
        return RayKVPromMetrics(vllm_config, metric_types, labelnames,
                                per_engine_labelvalues)

    # ==============================
    # Scheduler-side methods
    # ==============================

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.connector_scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.connector_scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.connector_scheduler.take_events()
