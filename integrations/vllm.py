"""raykv as a vLLM KV connector: ``RayKVConnector`` (a ``KVConnectorBase_V1``).

Loaded by stock vLLM (this module is imported by vLLM only; ``import raykv`` never
imports vLLM)::

    KVTransferConfig(kv_connector="RayKVConnector",
                     kv_connector_module_path="raykv.integrations.vllm",
                     kv_role="kv_both", kv_connector_extra_config={...})

Keys: one Mooncake object per vLLM block per TP rank, ``P_{block hash}_{tp}_kv``, with
``P`` = ``extra_backend_tag`` (default ``vllm-tp{TP}``) and the model name, as raykv's
other keys. The block hash is vLLM's own chained block hash (``request.block_hashes``).

Scheduler side (one per engine): ``get_num_new_matched_tokens`` asks ONE raykv group
query (``CacheClient.group_exists``) about every TP rank's objects of the request's
full blocks beyond vLLM's local hit, and leaves at least one token to compute. The
answer is the same for every rank, so ranks never load different prefixes.

Worker side (one per TP rank): a shared host pool of kind ``vllm`` on the rank's node
(page = one vLLM block of every layer, laid out as vLLM's CPU block layout, so a block
of one layer is one contiguous copy); the node actor moves pages between that pool
and Mooncake with no copy. Loads run before the forward (``start_load_kv``), saves of
newly completed full blocks after it (``wait_for_save``); both synchronous. Every block
that did not load is reported by ``get_block_ids_with_load_errors`` (so
``kv_load_failure_policy="recompute"`` recomputes it); an unavailable node actor or
store never raises into vLLM and never counts as a loaded block.

``kv_connector_extra_config`` (all optional): see ``_Options``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.controllers.contract import (
    DEFAULT_TIMEOUT_S,
    PoolName,
    PoolTransfer,
    StorageConfig,
)
from raykv.controllers.naming import NAMESPACE
from raykv.integrations.vllm_plan import (
    BlockTransfer,
    RequestBlocks,
    external_tokens,
    first_invalid_block,
    hash_hex,
    max_loadable_blocks,
    plan_load,
    plan_save,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm." + __name__)  # shows up with vLLM's own log lines

__all__ = ["RayKVConnector", "RayKVConnectorMetadata"]


@dataclass(frozen=True)
class _Options:
    """``kv_connector_extra_config`` of ``RayKVConnector``.

    - ``model_name``: the model part of the key prefix (default: vLLM's served model
      name). Engines that must share blocks need the same model name and tag.
    - ``extra_backend_tag``: the first part of the key prefix (default ``vllm-tp{TP}``,
      ``-pp{PP}`` added when PP > 1: blocks of another TP size are other bytes).
    - ``namespace``: the Ray namespace raykv runs in (default ``raykv``).
    - ``ray_address``: the Ray cluster to join from a process that is not a Ray worker
      (vLLM's multiprocess engine core and TP worker processes); default
      ``$RAY_ADDRESS``, else the cluster of the Ray actor that started the engine, else
      ``auto`` (see ``join_ray``).
    - ``pool_blocks``: blocks in each TP rank's shared staging pool (default 64); larger
      loads and saves go through it in chunks of this many blocks.
    - ``timeout_s``: the deadline of each call to raykv, in seconds (default
      ``DEFAULT_TIMEOUT_S``, 5): a hung or stopped node actor then costs a failed load
      (recomputed under ``kv_load_failure_policy="recompute"``) or a lost save, and the
      scheduler's hit query a miss, never a stalled engine.
    - ``debug_corrupt_loads``: test only: overwrite every loaded block with random
      values (shows that loaded KV is really used).
    """

    model_name: str
    extra_backend_tag: str
    namespace: str = NAMESPACE
    ray_address: str | None = None
    pool_blocks: int = 64
    timeout_s: float = DEFAULT_TIMEOUT_S
    debug_corrupt_loads: bool = False

    @classmethod
    def from_config(cls, vllm_config: VllmConfig) -> _Options:
        extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
        known = {"model_name", "extra_backend_tag", "namespace", "ray_address", "pool_blocks",
                 "timeout_s", "debug_corrupt_loads"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"RayKVConnector: unknown kv_connector_extra_config keys "
                             f"{unknown}; known: {sorted(known)}")
        pc = vllm_config.parallel_config
        tag = f"vllm-tp{pc.tensor_parallel_size}"
        if pc.pipeline_parallel_size > 1:
            tag += f"-pp{pc.pipeline_parallel_size}"
        mc = vllm_config.model_config
        model = extra.get("model_name") or mc.served_model_name or mc.model
        pool_blocks = int(extra.get("pool_blocks", 64))
        if pool_blocks < 1:
            raise ValueError(f"RayKVConnector: pool_blocks must be >= 1, got {pool_blocks}")
        return cls(model_name=str(model), extra_backend_tag=str(extra.get("extra_backend_tag",
                                                                          tag)),
                   namespace=str(extra.get("namespace", NAMESPACE)),
                   ray_address=extra.get("ray_address"), pool_blocks=pool_blocks,
                   timeout_s=StorageConfig(extra_config=extra).timeout_s,  # validated
                   debug_corrupt_loads=bool(extra.get("debug_corrupt_loads", False)))


def inherited_ray_node() -> tuple[str, str] | None:
    """``(node id, GCS address)`` of the Ray node this process belongs to when it descends
    from a Ray worker without being one (vLLM's engine core and worker processes started
    inside a Ray actor), else None.

    Ray gives every worker its raylet's pid (``RAY_RAYLET_PID``) and processes a worker
    starts inherit it; the raylet's command line names its node and GCS (``--node_id``,
    ``--gcs-address``; Ray's own ``find_node_ids`` reads the same flags). None when the
    variable is unset or that raylet cannot be read (another PID namespace, gone).
    """
    pid = os.environ.get("RAY_RAYLET_PID", "")
    if not pid.isdigit():
        return None
    import psutil

    try:
        args = psutil.Process(int(pid)).cmdline()
    except psutil.Error:
        return None
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    node, gcs = flags.get("--node_id"), flags.get("--gcs-address")
    return (node, gcs) if node and gcs else None


def join_ray(address: str | None, namespace: str) -> str | None:
    """Connect this process to the raykv cluster unless it already is (a Ray worker, or
    a process that joined before); return the node whose cache actor it uses (None: the
    node Ray attached this process to).

    vLLM's multiprocess engine core and TP worker processes are plain processes even when
    the engine runs inside a Ray actor. They join the cluster at ``address``, else
    ``$RAY_ADDRESS`` (vLLM sets it to the actor's cluster before it starts them), else
    the cluster of the Ray node they descend from (``inherited_ray_node``), else
    ``auto``; and use that node's cache actor (Ray attaches a joining process to a raylet
    of its machine, the head node's when a machine runs several, as tests do). Ray >=
    2.60 local clusters use token authentication; a process that was refused for want of
    a token retries with ``RAY_AUTH_MODE=token`` (the token is read from
    ``~/.ray/auth_token``).
    """
    import ray

    inherited = inherited_ray_node()
    if not ray.is_initialized():
        address = (address or os.environ.get("RAY_ADDRESS")
                   or (inherited[1] if inherited else None) or "auto")
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False,
                     include_dashboard=False)
        except Exception as e:
            if "auth" not in str(e).lower() or os.environ.get("RAY_AUTH_MODE") == "token":
                raise
            with contextlib.suppress(Exception):
                ray.shutdown()
            os.environ["RAY_AUTH_MODE"] = "token"
            ray.init(address=address, namespace=namespace, log_to_driver=False,
                     include_dashboard=False)
        log.info("RayKVConnector joined Ray at %s (pid %d)", address, os.getpid())
    if inherited is None or inherited[0] == ray.get_runtime_context().get_node_id():
        return None
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return inherited[0] if inherited[0] in alive else None


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    """What every worker does in one step: blocks to load before the forward, blocks to
    save after it (page hashes in hex; each worker tags them with its own TP rank)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)


class _Throttled:
    """Log a recurring failure at most once per ``period_s``."""

    def __init__(self, period_s: float = 30.0) -> None:
        self.period_s = period_s
        self._last: dict[str, float] = {}

    def warning(self, what: str, msg: str, *args) -> None:
        now = time.monotonic()
        if now - self._last.get(what, -math.inf) >= self.period_s:
            self._last[what] = now
            log.warning(msg, *args)


class RayKVConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by raykv (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.opts = _Options.from_config(vllm_config)
        if vllm_config.model_config.use_mla:
            raise ValueError("RayKVConnector does not serve MLA models yet (their KV is "
                             "replicated across TP ranks and laid out differently)")
        if kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1:
            raise ValueError("RayKVConnector serves models with one KV cache group; this model "
                             f"has {len(kv_cache_config.kv_cache_groups)} (hybrid attention)")
        kv = self._kv_transfer_config
        self.do_load = kv.kv_role in ("kv_both", "kv_consumer")
        self.do_save = kv.kv_role in ("kv_both", "kv_producer")
        self.block_size = vllm_config.cache_config.block_size
        pc = vllm_config.parallel_config
        self.tp_size, self.pp_size = pc.tensor_parallel_size, pc.pipeline_parallel_size
        self.tp_rank = self.pp_rank = 0
        self._warn = _Throttled()
        self._client = None
        self._pool = None
        self._attaching: threading.Thread | None = None
        self._attach_error: Exception | None = None
        # scheduler side
        self._reqs: dict[str, RequestBlocks] = {}
        # worker side
        self._layers: list[torch.Tensor] = []  # per layer: (num_blocks, *block) views
        self._block_shape: tuple[int, ...] = ()
        self._load_errors: set[int] = set()
        self.stats = {"queries": 0, "hit_blocks": 0, "loaded": 0, "load_failed": 0,
                      "saved": 0, "save_failed": 0}
        if role == KVConnectorRole.WORKER:
            from vllm.distributed.parallel_state import (
                get_pp_group,
                get_tensor_model_parallel_rank,
            )

            self.tp_rank = get_tensor_model_parallel_rank()
            self.pp_rank = get_pp_group().rank_in_group
        log.info("RayKVConnector %s tp %d/%d: keys %s_%s_<block>_%d_kv, block_size %d",
                 role.name, self.tp_rank, self.tp_size, self.opts.extra_backend_tag,
                 self.opts.model_name.replace("/", "-"), self.tp_rank, self.block_size)
        if role == KVConnectorRole.SCHEDULER and self.do_load:
            self._attach_at_start()  # not in the first lookup: see _cache

    # ------------------------------------------------------------ raykv client
    def _storage_config(self) -> StorageConfig:
        return StorageConfig(tp_rank=self.tp_rank, tp_size=self.tp_size, pp_rank=self.pp_rank,
                             pp_size=self.pp_size, model_name=self.opts.model_name,
                             extra_config={"extra_backend_tag": self.opts.extra_backend_tag,
                                           "timeout_s": self.opts.timeout_s})

    def _attach(self) -> None:
        """Make this process's ``CacheClient`` and its registered pool (raises what the
        client raises). Its calls to the node actor are control calls (deadline
        ``CONTROL_TIMEOUT_S``, 120 s), so this runs at start-up (the scheduler's
        construction, ``register_kv_caches``) or on ``_cache``'s background thread,
        never on vLLM's step."""
        from raykv.cache_actors.rank.client import CacheClient

        node_id = join_ray(self.opts.ray_address, self.opts.namespace)
        client = CacheClient(self._storage_config(), node_id=node_id,
                             namespace=self.opts.namespace)
        try:
            name = f"vllm-{uuid.uuid4().hex[:12]}"
            if self.role == KVConnectorRole.SCHEDULER:
                # The scheduler only asks group queries: a one-page pool of the same kind
                # names the deployment's pool spec; the ranks' pools hold the bytes.
                pool = client.create_host_pool("vllm", page_size=self.block_size,
                                               size=self.block_size, layer_num=1, head_num=1,
                                               head_dim=1, name=name, per_process=True)
            else:  # vLLM's KV cache, served through a staging pool of pool_blocks pages
                from raykv.cache_actors.rank.engine_pools import StagedPool, staging_layout

                pool = client.create_host_pool(
                    staging_layout(self._memory.layout, self.opts.pool_blocks), name=name,
                    per_process=True)
            client.register_mem_host_pool_v2(
                pool if self.role == KVConnectorRole.SCHEDULER else StagedPool(
                    self._memory, pool, self.opts.pool_blocks, shared=True, stage=self._pages),
                PoolName.KV)
        except BaseException:
            client.close()
            raise
        self._pool = pool  # first: a caller that sees the client uses the pool
        self._client = client

    def _attach_at_start(self) -> None:
        try:
            self._attach()
        except Exception as e:  # raykv may come up later: retried on first use
            self._warn.warning("attach", "RayKVConnector: raykv not reachable yet (%s); "
                               "lookups miss, loads fail and saves are skipped until it is",
                               e)

    def _attach_in_background(self) -> None:
        try:
            self._attach()
        except Exception as e:
            self._attach_error = e

    def _cache(self):
        """This process's ``CacheClient`` (callers turn what it raises into misses,
        failed loads and skipped saves). If start-up did not attach, a background thread
        attaches (one at a time) and this waits for it at most ``timeout_s``, then raises
        ``NodeUnavailableError``: a hung node actor never holds vLLM's scheduler or a
        forward longer than one deadline per call."""
        if self._client is not None:
            return self._client
        if self._attaching is None or not self._attaching.is_alive():
            self._attach_error = None
            self._attaching = threading.Thread(target=self._attach_in_background,
                                               name="raykv-attach", daemon=True)
            self._attaching.start()
        self._attaching.join(self.opts.timeout_s)
        if self._client is None:
            raise NodeUnavailableError(
                f"raykv is not attached yet ({self._attach_error or 'still attaching'}); "
                "attaching again in the background")
        return self._client

    # --------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.do_load or num_computed_tokens % self.block_size:
            return 0, False
        local = num_computed_tokens // self.block_size
        hashes = request.block_hashes[local:max_loadable_blocks(request.num_tokens,
                                                                self.block_size)]
        if not hashes:
            return 0, False
        try:
            hit = self._cache().group_exists([hash_hex(h) for h in hashes]).kv_hit_pages
        except Exception as e:  # raykv unreachable, restarting, or refused: a miss
            self._warn.warning("query", "RayKVConnector: hit query failed, treated as a miss: "
                               "%s", e)
            hit = 0
        self.stats["queries"] += 1
        self.stats["hit_blocks"] += hit
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = RequestBlocks(request)
        st.local_hit_tokens = num_computed_tokens
        return external_tokens(local + hit, num_computed_tokens, self.block_size), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = RequestBlocks(request)
        st.request = request
        if num_external_tokens > 0:
            st.pending_load = plan_load(request.request_id, blocks.get_block_ids()[0],
                                        request.block_hashes, st.local_hit_tokens,
                                        num_external_tokens, self.block_size)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = RayKVConnectorMetadata()
        scheduled = scheduler_output.num_scheduled_tokens
        spec = scheduler_output.scheduled_spec_decode_tokens or {}

        def step(st: RequestBlocks, rid: str, computed_before: int) -> None:
            if st.pending_load is not None:
                meta.loads.append(st.pending_load)
                st.pending_load = None
            if self.do_save:
                # Draft tokens' KV may be rejected: only tokens known to be right count.
                after = computed_before + scheduled.get(rid, 0) - len(spec.get(rid, ()))
                save = plan_save(st, after, self.block_size)
                if save is not None:
                    meta.saves.append(save)

        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            # Blocks vLLM had or loaded are not saved again.
            st.saved_blocks = max(st.saved_blocks, new.num_computed_tokens // self.block_size)
            step(st, new.req_id, new.num_computed_tokens)
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            st = self._reqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                st.block_ids = list(new_ids[0]) if new_ids is not None else []
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])
            step(st, rid, cached.num_computed_tokens[i])
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids
        if not invalid:
            return
        # Blocks that failed to load are recomputed: save them (and what follows) again.
        for st in self._reqs.values():
            idx = first_invalid_block(st.block_ids, invalid)
            if idx is not None:
                st.saved_blocks = min(st.saved_blocks, idx)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise ValueError("RayKVConnector: vLLM registered no KV cache tensors")
        first = tensors[0]
        for name, t in kv_caches.items():
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(f"RayKVConnector: layer {name} has KV {tuple(t.shape)} "
                                 f"{t.dtype}, layer 0 {tuple(first.shape)} {first.dtype}; "
                                 "all layers must match")
        num_blocks = (self._kv_cache_config.num_blocks if self._kv_cache_config is not None
                      else first.shape[0])
        dims = [d for d, n in enumerate(first.shape) if n == num_blocks]
        if not dims:
            raise ValueError(f"RayKVConnector: no dimension of the KV tensor "
                             f"{tuple(first.shape)} counts the {num_blocks} blocks")
        # Per layer a (num_blocks, *block) view: vLLM's CPU layout is blocks-first already.
        self._layers = [t.movedim(dims[0], 0) for t in tensors]
        self._block_shape = tuple(self._layers[0].shape[1:])
        if math.prod(self._block_shape) % self.block_size:
            raise ValueError(f"RayKVConnector: a block {self._block_shape} is not a multiple "
                             f"of block_size {self.block_size}")
        from raykv.cache_actors.rank.engine_pools import EngineMemory, dtype_of
        from raykv.controllers.pool_layout import PoolLayout

        heads, dim = self._pool_dims()
        dtype, itemsize = dtype_of(first)
        # vLLM's blocks as a raykv pool: page = block id, one view per layer.
        self._memory = EngineMemory(PoolLayout.vllm(
            page_size=self.block_size, size=num_blocks * self.block_size,
            layer_num=len(tensors), head_num=heads, head_dim=dim, dtype=dtype,
            itemsize=itemsize), self._layers)
        log.info("RayKVConnector tp %d: %d layers of %d blocks %s %s", self.tp_rank,
                 len(tensors), num_blocks, self._block_shape, first.dtype)
        self._attach_at_start()

    def _pool_dims(self) -> tuple[int, int]:
        """``head_num, head_dim`` of the pool: vLLM's CPU block ``(heads, block_size,
        2 * head_size)`` as it is; any other block shape as ``(1, elements / block_size)``
        (same bytes per page, which is all the store sees)."""
        shape = self._block_shape
        if len(shape) == 3 and shape[1] == self.block_size:
            return shape[0], shape[2]
        return 1, math.prod(shape) // self.block_size

    def _pages(self, pool) -> list[torch.Tensor]:
        """The staging pool's pages per layer, ``(pool_blocks, *block)`` views lining up
        with ``self._layers`` (a page holds every layer's block, layer after layer)."""
        buf = pool.kv_buffer
        pages = buf.view(buf.shape[0], buf.shape[1], -1)
        return [pages[:, layer].view(buf.shape[0], *self._block_shape)
                for layer in range(buf.shape[1])]

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        """Host indices (token slots) of vLLM's blocks ``block_ids``."""
        ids = torch.tensor(block_ids, dtype=torch.long)
        return (ids[:, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RayKVConnectorMetadata) or not meta.loads:
            return
        firsts = [self._load(x) for x in meta.loads]  # first failed block per request
        if self.tp_size > 1:
            firsts = self._agree(firsts)
        self._bad_reqs = set()
        for x, first in zip(meta.loads, firsts, strict=True):
            if first < len(x.block_ids):
                self._load_errors.update(x.block_ids[first:])
                self._bad_reqs.add(x.req_id)
                self.stats["load_failed"] += len(x.block_ids) - first
            self.stats["loaded"] += first

    def _load(self, x: BlockTransfer) -> int:
        """Load ``x``'s blocks into vLLM's KV cache (the client copies each block read in
        full out of the staging pool), ``pool_blocks`` at a time, up to the first chunk
        with a block that did not load; the index of that block (``len`` if all did).
        Never raises."""
        done = 0
        try:
            self._cache()
            n_pool = self.opts.pool_blocks
            while done < len(x.block_ids):
                n = min(n_pool, len(x.block_ids) - done)
                hashes = x.hashes[done:done + n]
                ok = self._client.batch_get_v2([PoolTransfer(
                    PoolName.KV, hashes, self._slots(x.block_ids[done:done + n]))])[PoolName.KV]
                good = ok.index(False) if False in ok else n
                if good and self.opts.debug_corrupt_loads:
                    self._copy_in(x.block_ids[done:done + good])
                done += good
                if good < n:
                    break
        except Exception as e:  # node actor restarting, store down, bad state: not loaded
            self._warn.warning("load", "RayKVConnector: load of %d blocks failed (%s); "
                               "vLLM recomputes them", len(x.block_ids) - done, e)
        return done

    def _copy_in(self, block_ids: list[int]) -> None:
        """Test only (``debug_corrupt_loads``): overwrite loaded blocks with random
        values."""
        device = self._layers[0].device  # vLLM's KV cache: host memory on CPU, else a GPU's
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        for blocks in self._layers:
            noise = torch.randn((len(block_ids), *self._block_shape)).to(blocks.dtype)
            blocks.index_copy_(0, ids, noise.to(device))

    def _agree(self, firsts: list[int]) -> list[int]:
        """Every TP rank takes the smallest first-failed block of any rank, so all ranks
        report the same blocks and none saves KV computed over another rank's bad load."""
        from vllm.distributed.parallel_state import get_tp_group

        t = torch.tensor(firsts, dtype=torch.int64)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN,
                                     group=get_tp_group().cpu_group)
        return t.tolist()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        return  # every layer's blocks are saved together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, RayKVConnectorMetadata):
            return
        bad = getattr(self, "_bad_reqs", set())
        for x in meta.saves:
            if x.req_id in bad:  # computed over a failed load: never store it
                continue
            self._save(x)
        self._bad_reqs = set()

    def _save(self, x: BlockTransfer) -> None:
        done = 0
        try:
            self._cache()
            while done < len(x.block_ids):  # the client copies the blocks into staging
                n = min(self.opts.pool_blocks, len(x.block_ids) - done)
                ok = self._client.batch_set_v2([PoolTransfer(
                    PoolName.KV, x.hashes[done:done + n],
                    self._slots(x.block_ids[done:done + n]))])[PoolName.KV]
                self.stats["saved"] += sum(ok)
                self.stats["save_failed"] += n - sum(ok)
                done += n
        except Exception as e:  # a lost save is a future miss, never an error for vLLM
            self.stats["save_failed"] += len(x.block_ids) - done
            self._warn.warning("save", "RayKVConnector: save of %d blocks failed (%s)",
                               len(x.block_ids) - done, e)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        client, pool = self._client, self._pool
        self._client = self._pool = None
        if client is None:
            return
        with contextlib.suppress(Exception):
            client.destroy_host_pool(pool)
        with contextlib.suppress(Exception):
            client.close()
