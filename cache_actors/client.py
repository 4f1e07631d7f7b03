"""``CacheClient``: what an inference rank (driver or any Ray actor) calls.

It talks to the cache actor of its own node: control calls (pools, stats) through Ray,
data calls (exists, put, get, group hits) through the actor's local channel (a Unix
socket, ~0.1 ms instead of a ~1 ms Ray call; Ray calls when the client is not on the
actor's node). Pools are shared memory owned by that actor and mapped here as torch
tensors; calls carry keys and offsets, and the actor moves the bytes between the pools
and Mooncake. Every input is validated here, before
any byte moves, and bad input raises ``ValueError`` naming the problem.

Return conventions (SGLang HiCache): ``batch_exists`` -> leading pages whose objects all
exist; ``batch_set_v1`` / ``batch_get_v1`` -> one bool per page, True only if every
object of the page was stored / read in full; ``batch_set`` -> True if every object was
stored; ``batch_get`` -> number of leading objects read in full.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import ray
import torch
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.host_pools import HostPool, PoolHandle, dtype_name, torch_dtype
from raykv.cache_actors.local_channel import ChannelClient, ChannelClosedError
from raykv.cache_actors.object_batch import ObjectBatch
from raykv.cache_actors.standalone_client import check_mode
from raykv.controllers.contract import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    StorageConfig,
)
from raykv.controllers.deployments import (
    ObjectPlan,
    PoolQuery,
    PoolSpec,
    Registration,
    group_hits,
    rank_plan_into,
)
from raykv.controllers.keys import KeyPlan, check_key_rule, is_replicated
from raykv.controllers.naming import CONTROLLER_NAME, NAMESPACE, node_actor_name
from raykv.controllers.pool_layout import PoolLayout, check_pool_name

log = logging.getLogger(__name__)

# Data ops: name on the local channel -> name of the node actor's Ray method.
_RAY_METHODS = {"exists": "batch_is_exist", "put": "batch_put", "get": "batch_get",
                "group_exists": "group_exists"}


def check_keys(keys: Sequence[str]) -> list[str]:
    """Return ``keys`` as a list; ``ValueError`` if empty, not strings, empty or repeated."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list of strings, got {type(keys).__name__}")
    if not keys:
        raise ValueError("keys is empty")
    keys = list(keys)
    try:  # the common case at the cost of one set; the loop below names what is wrong
        if set(map(type, keys)) == {str} and len(unique := set(keys)) == len(keys) \
                and "" not in unique:
            return keys
    except TypeError:  # an unhashable key
        pass
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise ValueError(f"key {i} is {k!r}: keys must be non-empty strings")
        if k in seen:
            raise ValueError(f"key {k!r} appears at positions {seen[k]} and {i}")
        seen[k] = i
    return keys


def _pool_name(name) -> PoolName:
    try:
        return PoolName(name)
    except ValueError:
        raise ValueError(f"unknown pool name {name!r}; expected one of "
                         f"{[p.value for p in PoolName]}") from None


def _numpy(indices):
    return indices.cpu().numpy() if isinstance(indices, torch.Tensor) else indices


def _copy_pages(src: torch.Tensor, dst: torch.Tensor, starts: Sequence[int],
                page_size: int) -> None:
    """Copy whole pages (slot dim 1 for MHA ``(2, size, ...)``, 0 for MLA) src -> dst."""
    if not starts:
        return
    slots = torch.as_tensor(np.add.outer(np.asarray(starts), np.arange(page_size)).ravel())
    dim = 1 if src.dim() == 5 else 0
    dst.index_copy_(dim, slots, src.index_select(dim, slots))


def _spec(name: PoolName, pool: HostPool) -> PoolSpec:
    """What the key rules need of a registered pool."""
    return PoolSpec(name, pool.kind, tuple(b.name for b in pool.handle.layout.buffers))


def _dtype_pair(dtype) -> tuple[str, int]:
    t = torch_dtype(dtype)
    return dtype_name(t), t.itemsize


def _layout(kind: str, *, size, page_size, layer_num, head_num, head_dim, kv_cache_dim,
            index_head_dim, dtype, temporal_shape, temporal_dtype, conv_shapes, conv_dtypes,
            layout) -> PoolLayout:
    """The ``PoolLayout`` that ``create_host_pool`` arguments describe."""
    if kind == "mamba":
        if page_size not in (None, 1):
            raise ValueError(f"a mamba pool holds one checkpoint per slot: page_size must be "
                             f"1, got {page_size}")
        conv_dtypes = list(conv_dtypes) if conv_dtypes is not None else [dtype] * len(conv_shapes)
        if len(conv_dtypes) != len(conv_shapes):
            raise ValueError(f"{len(conv_shapes)} conv_shapes but {len(conv_dtypes)} conv_dtypes")
        temporal = None if temporal_shape is None else (
            tuple(temporal_shape), *_dtype_pair(temporal_dtype or dtype))
        convs = [(tuple(s), *_dtype_pair(d)) for s, d in zip(conv_shapes, conv_dtypes,
                                                              strict=True)]
        return PoolLayout.mamba(size=size, temporal=temporal, convs=convs)
    if page_size is None:
        raise ValueError(f"a {kind} pool needs page_size")
    name, itemsize = _dtype_pair(dtype)
    common = dict(page_size=page_size, size=size, layer_num=layer_num, dtype=name,
                  itemsize=itemsize, layout=layout)
    if kind == "mha":
        return PoolLayout.mha(head_num=head_num, head_dim=head_dim, **common)
    if kind == "mla":
        return PoolLayout.mla(kv_cache_dim=kv_cache_dim, **common)
    if kind == "indexer":
        return PoolLayout.indexer(index_head_dim=index_head_dim, **common)
    if kind == "vllm":
        return PoolLayout.vllm(head_num=head_num, head_dim=head_dim, **common)
    raise ValueError(f"pool kind {kind!r} is unknown: expected mha, mla, indexer, mamba or "
                     "vllm")


@dataclass
class _Plan:
    """One call's objects: ``spans[pool] = (first object, objects per page, pages)``;
    ``fixed[pool]`` holds results decided without the store (replicas, disabled draft);
    ``staged[pool] = (engine tensor, staging pool, page starts)``."""

    batch: ObjectBatch = field(default_factory=ObjectBatch)
    spans: dict[PoolName, tuple[int, int, int]] = field(default_factory=dict)
    fixed: dict[PoolName, list[bool]] = field(default_factory=dict)
    staged: dict[PoolName, tuple[torch.Tensor, HostPool, list[int]]] = field(
        default_factory=dict)

    def results(self, ok: list[bool]) -> dict[PoolName, list[bool]]:
        """Per pool, one bool per page: every object of the page ``ok``."""
        out = dict(self.fixed)
        for name, (first, per_page, pages) in self.spans.items():
            out[name] = [all(ok[first + p * per_page:first + (p + 1) * per_page])
                         for p in range(pages)]
        return out


class CacheClient:
    """A rank's handle on the raykv cache of its node.

    ``config`` carries the rank's place in its deployment (TP/PP rank, MLA, model name,
    ``extra_config["extra_backend_tag"]``), which decides the object keys. If
    ``extra_config["standalone_storage"]`` is set it must match the node actor's mode,
    else ``ValueError``.

    After a ``NodeUnavailableError`` the next call first re-maps every pool of this client
    whose memory the node actor replaced (standalone mode, after a restart): the
    ``HostPool`` objects stay the same, their tensors point to the new memory.
    """

    def __init__(
        self,
        config: StorageConfig | None = None,
        *,
        node_id: str | None = None,
        namespace: str = NAMESPACE,
    ) -> None:
        if not ray.is_initialized():
            raise RuntimeError("CacheClient needs a connected Ray: call ray.init(...) or "
                               "start raykv with raykv.start_local() first")
        self.config = config or StorageConfig()
        self.plan = KeyPlan.from_config(self.config)
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        try:
            self._actor = ray.get_actor(node_actor_name(self.node_id), namespace=namespace)
        except ValueError as e:
            raise NodeUnavailableError(
                f"no raykv cache actor on node {self.node_id[:12]} (namespace {namespace!r}); "
                "is raykv running on this cluster?") from e
        self._pools: dict[str, HostPool] = {}
        self._registered: dict[PoolName, HostPool] = {}
        self._spec_cache: tuple[tuple[tuple[PoolName, HostPool], ...],
                                tuple[PoolSpec, ...]] = ((), ())
        self._staged: dict[PoolName, torch.Tensor] = {}
        self._draft_disabled: str | None = None
        self._namespace = namespace
        self._controller = None
        self._deployment: tuple[Registration, tuple[PoolSpec, ...]] | None = None
        self._local = self.node_id == ray.get_runtime_context().get_node_id()
        self._channel: ChannelClient | None = None
        self._epoch = 0
        self._stale = False
        if "standalone_storage" in (self.config.extra_config or {}):
            check_mode(self.config.extra_config, self._call("health")["mode"])

    def _call(self, method: str, *args):
        if self._stale:
            self._remap()
        return self._ask(self._actor, method, *args)

    def _data(self, op: str, *args, node_id: str | None = None):
        """Data op ``op`` on the cache actor of ``node_id`` (default: this client's node):
        over the local channel when that actor runs on this node, else through Ray."""
        if self._stale:
            self._remap()
        remote = node_id not in (None, self.node_id)
        if remote or not self._local:
            actor = self._actor_of(node_id) if remote else self._actor
            return self._ask(actor, _RAY_METHODS[op], *args)
        with self._retryable(op):
            if self._channel is None:
                self._channel = ChannelClient(self._call("channel_path"),
                                              async_ops=frozenset({"group_exists"}))
            return self._channel.call(op, *args)

    def _actor_of(self, node_id: str):
        try:
            return ray.get_actor(node_actor_name(node_id), namespace=self._namespace)
        except ValueError as e:
            self._controller = None  # ask the controller again: the group may have moved
            raise NodeUnavailableError(f"no raykv cache actor on node {node_id[:12]}; retry "
                                       "the call") from e

    def _remap(self) -> None:
        """Map again every pool whose handle the node actor changed (see the class doc)."""
        for name in list(self._pools):
            with contextlib.suppress(ValueError):  # destroyed meanwhile
                self._map(self._ask(self._actor, "get_pool", name))
        self._stale = False

    def _ask(self, actor, method: str, *args):
        with self._retryable(method):
            return ray.get(getattr(actor, method).remote(*args))

    @contextlib.contextmanager
    def _retryable(self, what: str):
        """Turn an unreachable actor (Ray says it is dead or restarting, or its channel
        broke) and a store restart inside it into ``NodeUnavailableError``, after looking
        the actors up again so that a retry reaches their replacements."""
        try:
            yield
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ChannelClosedError) as e:
            self._reattach()
            raise NodeUnavailableError(
                f"raykv actor for {what} (node {self.node_id[:12]}) is unavailable ({e}); "
                "it is restarted automatically: retry the call") from e
        except NodeUnavailableError as e:  # raised by the actor: its store is restarting
            self._reattach()
            raise NodeUnavailableError(
                f"node {self.node_id[:12]}: {getattr(e, 'cause', e)}") from None

    def _reattach(self) -> None:
        """Look the node actor and controller up by name again, so the next call reaches
        a replacement (one the reconciler started after the old one died for good)."""
        with contextlib.suppress(ValueError):
            self._actor = ray.get_actor(node_actor_name(self.node_id), namespace=self._namespace)
        self._controller = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._stale = True

    # ----------------------------------------------------------------- pools
    def create_host_pool(
        self,
        kind: str,
        *,
        size: int,
        page_size: int | None = None,
        layer_num: int = 0,
        head_num: int = 0,
        head_dim: int = 0,
        kv_cache_dim: int = 0,
        index_head_dim: int = 0,
        dtype: torch.dtype | str = torch.bfloat16,
        temporal_shape: Sequence[int] | None = None,
        temporal_dtype: torch.dtype | str | None = None,
        conv_shapes: Sequence[Sequence[int]] = (),
        conv_dtypes: Sequence[torch.dtype | str] | None = None,
        layout: str = "page_first",
        name: str | None = None,
    ) -> HostPool:
        """Create a shared host pool on this node and map it here.

        Kinds: ``"mha"`` (``page_size, layer_num, head_num, head_dim``), ``"mla"``
        (``page_size, layer_num, kv_cache_dim``), ``"indexer"`` (``page_size, layer_num,
        index_head_dim``), ``"vllm"`` (``page_size`` = vLLM block size, ``layer_num,
        head_num, head_dim``: one vLLM block of every layer per page, see
        ``PoolLayout.vllm``), ``"mamba"`` (``temporal_shape`` and ``conv_shapes`` per slot,
        e.g. ``(layers, heads, head_dim, state)``; dtypes default to ``dtype``; an empty
        ``temporal_shape`` means a conv-only model). ``size`` and ``page_size`` count
        token slots (Mamba: checkpoints, page_size 1). With ``name`` of a pool that exists
        with the same shape, that pool is attached instead (how a restarted rank finds
        its pool again). Raises ``ValueError`` for a bad shape.
        """
        spec = _layout(str(kind).lower(), size=size, page_size=page_size, layer_num=layer_num,
                       head_num=head_num, head_dim=head_dim, kv_cache_dim=kv_cache_dim,
                       index_head_dim=index_head_dim, dtype=dtype,
                       temporal_shape=temporal_shape, temporal_dtype=temporal_dtype,
                       conv_shapes=conv_shapes, conv_dtypes=conv_dtypes, layout=layout)
        name = check_pool_name(name or f"{spec.kind}-{uuid.uuid4().hex[:12]}")
        return self._map(self._call("create_pool", name, spec))

    def attach_host_pool(self, name: str) -> HostPool:
        """Map the existing pool ``name`` of this node; ``ValueError`` if there is none."""
        if name in self._pools:
            return self._pools[name]
        return self._map(self._call("get_pool", check_pool_name(name)))

    def destroy_host_pool(self, pool: HostPool | str) -> bool:
        """Remove a pool from this node for every rank; False if it did not exist."""
        name = pool if isinstance(pool, str) else pool.name
        mapped = self._pools.pop(name, None)
        if mapped is not None:
            self._registered = {k: v for k, v in self._registered.items() if v is not mapped}
            mapped.close()
        return self._call("destroy_pool", name)

    def _map(self, handle: PoolHandle) -> HostPool:
        if handle.epoch != self._epoch:  # the node's pools were allocated anew
            self._stale = self._stale or any(n != handle.name for n in self._pools)
            self._epoch = handle.epoch
        pool = self._pools.get(handle.name)
        if pool is None:
            pool = HostPool.attach(handle)
            pool.pin()
            self._pools[handle.name] = pool
        elif pool.handle != handle:
            pool.remap(handle)
        return pool

    def _own(self, pool, what: str) -> HostPool:
        if not isinstance(pool, HostPool) or self._pools.get(pool.name) is not pool:
            raise ValueError(f"{what} needs a pool returned by this client's create_host_pool "
                             "or attach_host_pool")
        return pool

    def register_mem_pool_host(self, pool: HostPool) -> None:
        """Make ``pool`` this rank's KV pool (v1 API and the v2 anchor).

        Raises ``ValueError`` if the pool was not mapped by this client or its kind does
        not match ``config.is_mla_model``.
        """
        self._own(pool, "register_mem_pool_host")
        want = "mla" if self.config.is_mla_model else "mha"
        if pool.kind != want and not (pool.kind == "vllm" and want == "mha"):
            raise ValueError(f"pool {pool.name!r} is {pool.kind.upper()} but the "
                             f"config says is_mla_model={self.config.is_mla_model}")
        self._registered[PoolName.KV] = pool

    def register_mem_host_pool_v2(self, pool, name: PoolName | str) -> None:
        """Register ``pool`` as pool ``name`` for the v2 API.

        A draft pool may also be a pool the engine allocated itself (any object with a
        contiguous ``kv_buffer`` tensor, MHA ``(2, size, layers, heads, dim)`` or MLA
        ``(size, layers, 1, dim)``, and ``page_size``): it is served through a shared
        staging pool and a copy. A draft pool that cannot be served disables draft
        offload with one warning. Other pools must come from this client.
        """
        name = _pool_name(name)
        if name == PoolName.DRAFT and not isinstance(pool, HostPool):
            self._register_engine_draft(pool)
            return
        self._own(pool, "register_mem_host_pool_v2")
        check_key_rule(name, pool.kind)
        if name == PoolName.KV:
            self.register_mem_pool_host(pool)
        self._registered[name] = pool

    def _register_engine_draft(self, pool) -> None:
        buf = getattr(pool, "kv_buffer", None)
        page_size = getattr(pool, "page_size", None)
        problem = None
        if not isinstance(buf, torch.Tensor) or buf.dim() not in (4, 5):
            problem = "it has no kv_buffer tensor of MHA (5-D) or MLA (4-D) shape"
        elif buf.dim() == 5 and buf.shape[0] != 2:
            problem = f"its MHA kv_buffer {tuple(buf.shape)} does not start with (2, ...)"
        elif not buf.is_contiguous():
            problem = ("its kv_buffer is not contiguous (heads split across ranks or a "
                       "layer_first view), so a page is not one run of bytes")
        elif not isinstance(page_size, int) or page_size < 1:
            problem = f"its page_size {page_size!r} is not a positive int"
        if problem:
            if self._draft_disabled is None:
                log.warning("draft offload disabled: the draft pool cannot be served: %s",
                            problem)
            self._draft_disabled = problem
            return
        slot = buf.shape[2:] if buf.dim() == 5 else buf.shape[1:]
        kind = "mha" if buf.dim() == 5 else "mla"
        size = buf.shape[1] if kind == "mha" else buf.shape[0]
        dims = (dict(layer_num=slot[0], head_num=slot[1], head_dim=slot[2]) if kind == "mha"
                else dict(layer_num=slot[0], kv_cache_dim=slot[2]))
        staging = self.create_host_pool(kind, size=size, page_size=page_size, dtype=buf.dtype,
                                        **dims)
        self._registered[PoolName.DRAFT] = staging
        self._staged[PoolName.DRAFT] = buf

    def _pool(self, name: PoolName) -> HostPool:
        pool = self._registered.get(name)
        if pool is None:
            hint = ("register_mem_pool_host(pool)" if name == PoolName.KV
                    else f"register_mem_host_pool_v2(pool, PoolName.{name.name})")
            raise ValueError(f"no {name.value!r} host pool is registered: call {hint}")
        return pool

    # -------------------------------------------------------- batches of pages
    def _plan_transfers(self, transfers: Sequence[PoolTransfer], write: bool) -> _Plan:
        """Validate ``transfers`` and lay out their objects in one batch (see _Plan)."""
        if isinstance(transfers, PoolTransfer) or not isinstance(transfers, Sequence) \
                or not transfers:
            raise ValueError("transfers must be a non-empty list of PoolTransfer")
        by_name: dict[PoolName, PoolTransfer] = {}
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise ValueError(f"transfers holds a {type(t).__name__}, not a PoolTransfer")
            name = _pool_name(t.name)
            if name in by_name:
                raise ValueError(f"pool {name.value!r} appears twice in one call")
            by_name[name] = t
        plan = _Plan()
        plan.batch.epoch = self._epoch
        for name, t in by_name.items():
            keys, idx = self._resolve(name, t, by_name)
            if name == PoolName.DRAFT and self._draft_disabled is not None:
                plan.fixed[name] = [False] * len(keys)
                continue
            pool = self._pool(name)
            layout = pool.handle.layout
            try:
                starts = layout.page_starts(_numpy(idx), len(keys))
            except ValueError as e:
                raise ValueError(f"pool {name.value!r}: {e}") from None
            if write and is_replicated(name, pool.kind) and not self.plan.writes_replicated:
                plan.fixed[name] = [True] * len(keys)
                continue
            if name in self._staged:
                plan.staged[name] = (self._staged[name], pool, starts)
            suffixes = self.plan.suffixes(name, pool.kind, [b.name for b in layout.buffers])
            first = len(plan.batch)
            plan.batch.extend([self.plan.prefix + h + s for h in keys for s in suffixes],
                              pool.name, layout.object_offsets(starts),
                              layout.object_sizes * len(keys))
            plan.spans[name] = (first, len(suffixes), len(keys))
        if len(set(plan.batch.keys)) != len(plan.batch):
            raise ValueError("the transfers name the same object twice")
        return plan

    def _resolve(self, name: PoolName, t: PoolTransfer,
                 by_name: dict[PoolName, PoolTransfer]) -> tuple[list[str], object]:
        """Keys and host indices of a transfer, a sidecar's taken from its source pool."""
        if t.indices_from_pool is None:
            if t.host_indices is None:
                raise ValueError(f"pool {name.value!r}: the transfer has no host_indices")
            return check_keys(t.keys), t.host_indices
        if t.host_indices is not None:
            raise ValueError(f"pool {name.value!r}: give host_indices or indices_from_pool, "
                             "not both")
        src_name = _pool_name(t.indices_from_pool)
        src = by_name.get(src_name)
        if src is None or src.indices_from_pool is not None or src.host_indices is None:
            raise ValueError(f"pool {name.value!r} takes its indices from pool "
                             f"{src_name.value!r}, which has no transfer with host_indices in "
                             "this call")
        return check_keys(t.keys if t.keys is not None else src.keys), src.host_indices

    def batch_set_v2(self, transfers: Sequence[PoolTransfer]) -> dict[PoolName, list[bool]]:
        """Store the pages of every pool in one round trip (existence check and put of
        the missing objects happen together in the node actor). Replicated pools are
        written by TP rank 0 only; other ranks get True without writing."""
        plan = self._plan_transfers(transfers, write=True)
        for buf, staging, starts in plan.staged.values():
            _copy_pages(buf, staging.kv_buffer, starts, staging.page_size)
        codes = self._data("put", plan.batch) if len(plan.batch) else []
        return plan.results([c >= 0 for c in codes])

    def batch_get_v2(self, transfers: Sequence[PoolTransfer]) -> dict[PoolName, list[bool]]:
        """Read the pages of every pool in one round trip; a page is True only if every
        one of its objects was read in full."""
        plan = self._plan_transfers(transfers, write=False)
        codes = self._data("get", plan.batch) if len(plan.batch) else []
        out = plan.results([c == s for c, s in zip(codes, plan.batch.sizes, strict=True)])
        for name, (buf, staging, starts) in plan.staged.items():
            read = [s for s, ok in zip(starts, out[name], strict=True) if ok]
            _copy_pages(staging.kv_buffer, buf, read, staging.page_size)
        return out

    def _queries(self, transfers: Sequence[PoolTransfer]) -> list[PoolQuery]:
        """Validated (pool, hit policy, window) of each extra pool of an exists call;
        KV is implied and a disabled draft pool is left out."""
        queries: dict[PoolName, PoolQuery] = {}
        for t in transfers:
            if not isinstance(t, PoolTransfer):
                raise ValueError(f"transfers holds a {type(t).__name__}, not a PoolTransfer")
            name = _pool_name(t.name)
            try:
                policy = PoolHitPolicy(t.hit_policy)
            except ValueError:
                raise ValueError(f"pool {name.value!r}: unknown hit policy {t.hit_policy!r}; "
                                 f"expected one of {[p.value for p in PoolHitPolicy]}") from None
            if name == PoolName.KV or (name == PoolName.DRAFT and self._draft_disabled):
                continue
            if name in queries:
                raise ValueError(f"pool {name.value!r} appears twice in one call")
            self._pool(name)
            queries[name] = PoolQuery(name, policy, len(t.keys) if t.keys else 1)
        return list(queries.values())

    def batch_exists_v2(self, keys: Sequence[str],
                        transfers: Sequence[PoolTransfer] = ()) -> PoolTransferResult:
        """The longest prefix of ``keys`` that KV and every pool in ``transfers`` can
        restore together, for this rank, from one existence check of all their objects.

        A ``trailing_pages`` transfer's window is the number of its keys (1 if none).
        """
        keys = check_keys(keys)
        kv = self._pool(PoolName.KV)
        queries = self._queries(transfers)
        rank = (self.config.tp_rank, self.config.pp_rank)
        plan = ObjectPlan(self.plan.prefix, keys)
        rank_plan_into(plan, self.plan, rank, [
            _spec(name, pool) for name, pool in [(PoolName.KV, kv),
                                                 *((q.name, self._pool(q.name)) for q in queries)]])
        return group_hits(plan, queries, self._data("exists", plan.objects))

    # ------------------------------------------------------------ group hits
    def _specs(self) -> tuple[PoolSpec, ...]:
        """The registered pools as the controller sees them, in a stable order (made
        again only when the registered pools changed)."""
        pools, specs = self._spec_cache
        if len(pools) != len(self._registered) or any(
                self._registered.get(name) is not pool for name, pool in pools):
            pools = tuple(self._registered.items())
            specs = tuple(sorted((_spec(name, pool) for name, pool in pools),
                                 key=lambda p: p.name.value))
            self._spec_cache = (pools, specs)
        return specs

    def register_deployment(self) -> str:
        """Register this rank and its pools with the controller; adopt the key plan it
        hands back. Returns the deployment id. ``ValueError`` if this rank contradicts
        what its group registered (parallel sizes, MLA flag, pool kinds)."""
        specs = self._specs()
        if self._controller is None:
            try:
                self._controller = ray.get_actor(CONTROLLER_NAME, namespace=self._namespace)
            except ValueError as e:
                raise NodeUnavailableError("no raykv controller in namespace "
                                           f"{self._namespace!r}; is raykv running?") from e
        reg = self._ask(self._controller, "register_rank", self.config, list(specs),
                        self.node_id)
        self.plan = reg.plan
        self._deployment = (reg, specs)
        return reg.deployment_id

    def group_exists(self, keys: Sequence[str],
                     transfers: Sequence[PoolTransfer] = ()) -> PoolTransferResult:
        """The hit of this rank's whole TP/PP group: the intersection of restorable
        prefixes over every rank and pool, from one existence check by the cache actor
        of the group's home node (the controller names it at registration). Every rank
        of the group asking about the same keys and pools gets the identical answer (a
        rank asking again gets a fresh one), so no all-reduce among ranks is needed."""
        keys = check_keys(keys)
        self._pool(PoolName.KV)
        queries = self._queries(transfers)
        if (self._controller is None or self._deployment is None
                or self._specs() != self._deployment[1]):
            self.register_deployment()
        reg = self._deployment[0]
        return self._data("group_exists", reg.deployment_id, reg.version,
                          (self.config.tp_rank, self.config.pp_rank), keys, queries,
                          node_id=reg.home_node)

    # ------------------------------------------------------------ v1 (pages)
    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of leading pages whose KV objects all exist in the store."""
        return self.batch_exists_v2(keys).kv_hit_pages

    def batch_set_v1(self, keys: Sequence[str], host_indices) -> list[bool]:
        """Store the KV pages at ``host_indices`` under ``keys`` (put-if-absent).

        On an MLA model only TP rank 0 writes; other ranks validate and report success,
        as their pages are identical.
        """
        return self.batch_set_v2([PoolTransfer(PoolName.KV, keys, host_indices)])[PoolName.KV]

    def batch_get_v1(self, keys: Sequence[str], host_indices) -> list[bool]:
        """Read the KV pages under ``keys`` into the pool at ``host_indices``."""
        return self.batch_get_v2([PoolTransfer(PoolName.KV, keys, host_indices)])[PoolName.KV]

    # ---------------------------------------------------- legacy pointer API
    def _pointer_batch(self, keys, target_locations, target_sizes) -> ObjectBatch:
        keys = check_keys(keys)
        if target_locations is None or target_sizes is None:
            raise ValueError("target_locations and target_sizes are required (raykv moves "
                             "bytes only between shared pools and the store)")
        if not len(keys) == len(target_locations) == len(target_sizes):
            raise ValueError(f"{len(keys)} keys, {len(target_locations)} target_locations and "
                             f"{len(target_sizes)} target_sizes: lengths must match")
        batch = ObjectBatch(epoch=self._epoch)
        for key, ptr, size in zip(keys, target_locations, target_sizes, strict=True):
            for pool in self._pools.values():
                off = pool.offset_of(int(ptr), int(size))
                if off is not None:
                    batch.add(self.plan.tag(key), pool.name, off, int(size))
                    break
            else:
                raise ValueError(f"key {key!r}: {size} bytes at {int(ptr):#x} do not lie inside "
                                 "a shared pool mapped by this client")
        return batch

    def batch_set(self, keys: Sequence[str], target_locations=None, target_sizes=None) -> bool:
        """Store each ``target_sizes[i]`` bytes at pointer ``target_locations[i]`` under
        ``keys[i]`` (tagged with the model prefix). True if every object was stored."""
        batch = self._pointer_batch(keys, target_locations, target_sizes)
        return all(c >= 0 for c in self._data("put", batch))

    def batch_get(self, keys: Sequence[str], target_locations=None, target_sizes=None) -> int:
        """Read objects into the given pointers; the number of leading objects read in full."""
        batch = self._pointer_batch(keys, target_locations, target_sizes)
        codes = self._data("get", batch)
        ok = [c == s for c, s in zip(codes, batch.sizes, strict=True)]
        return ok.index(False) if False in ok else len(ok)

    # --------------------------------------------------------------- control
    def health(self) -> dict:
        return self._call("health")

    def stats(self) -> dict:
        return self._call("stats")

    def close(self) -> None:
        """Unmap every pool of this client and close its channel; the pools stay on
        the node."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._registered.clear()
        self._staged.clear()
