"""The host pools one client mapped and registered, from creation to destruction.

Pools are shared memory owned by the node actor; the client maps them here as torch
tensors (``HostPool``) and registers them by role (``PoolName``) for the batch calls.
Engine memory raykv cannot map (a draft pool the engine allocated itself, an SGLang
pool of another allocator, vLLM's KV cache) is registered as a ``StagedPool``
(``staging_pools``): its pages are copied into a staging pool before a put and out of it
after a get.

Every pool call names the client's owner claim for that call (``link.claim``): the node actor
serves this client's own pools only (``controllers.ownership``).

Threads: pool management (create, attach, destroy, register, close) is expected from
one thread of the rank, not concurrently with batch calls on the same pools; the
read-only views (``plan_pools``, ``specs``, ``disabled``) are replaced, never mutated,
so a batch call sees one consistent set.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Sequence

import torch
from raykv.cache_actors.host_pools import HostPool, PoolHandle, dtype_name, torch_dtype
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.rank.node_route import NodeRoute
from raykv.cache_actors.rank.staging_pools import StagedPool, describe_kv_buffer
from raykv.controllers.contract import PoolName
from raykv.controllers.deployments import PoolSpec
from raykv.controllers.keys import check_key_rule
from raykv.controllers.pool_layout import PoolLayout, check_pool_name
from raykv.controllers.transfer_plan import PlanPool

log = logging.getLogger(__name__)


def _dtype_pair(dtype: torch.dtype | str) -> tuple[str, int]:
    t = torch_dtype(dtype)
    return dtype_name(t), t.itemsize


def pool_layout(kind: str, *, size: int, page_size: int | None, layer_num: int,
                head_num: int, head_dim: int, kv_cache_dim: int, index_head_dim: int,
                dtype: torch.dtype | str, temporal_shape: Sequence[int] | None,
                temporal_dtype: torch.dtype | str | None, conv_shapes: Sequence[Sequence[int]],
                conv_dtypes: Sequence[torch.dtype | str] | None, order: str) -> PoolLayout:
    """The ``PoolLayout`` that ``CacheClient.create_host_pool`` arguments describe (the
    same names and units); ``ValueError`` for a bad shape."""
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
                  itemsize=itemsize, order=order)
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


def _draft_problem(buf: object, page_size: object) -> str | None:
    """Why an engine's draft pool cannot be served through a staging pool, or None."""
    if not isinstance(buf, torch.Tensor) or buf.dim() not in (4, 5):
        return "it has no kv_buffer tensor of MHA (5-D) or MLA (4-D) shape"
    if buf.dim() == 5 and buf.shape[0] != 2:
        return f"its MHA kv_buffer {tuple(buf.shape)} does not start with (2, ...)"
    if not buf.is_contiguous():
        return ("its kv_buffer is not contiguous (heads split across ranks or a "
                "layer_first view), so a page is not one run of bytes")
    if not isinstance(page_size, int) or page_size < 1:
        return f"its page_size {page_size!r} is not a positive int"
    return None


class PoolLifecycle:
    """The pools of one client: mapped by name, registered by role.

    ``epoch``: that of the node's pool memory the mappings belong to (``PoolHandle``);
    when a handle of a newer epoch arrives, every other mapping is marked for re-mapping
    (``link.stale``). ``plan_pools`` and ``specs``: the registered pools as transfer
    planning and the controller see them (a staged pool: its staging pool's name, the
    engine's layout); ``staged``: the registered ``StagedPool``s by role; ``disabled``:
    pools whose pages fail without the store (a draft pool that cannot be served).
    """

    def __init__(self, link: NodeRoute) -> None:
        self._link = link
        self._mapped: dict[str, HostPool] = {}
        self._registered: dict[PoolName, HostPool | StagedPool | PlanPool] = {}
        self._draft_problem: str | None = None
        self.epoch = 0
        self.plan_pools: dict[PoolName, PlanPool] = {}
        self.staged: dict[PoolName, StagedPool] = {}
        self.specs: tuple[PoolSpec, ...] = ()
        self.disabled: frozenset[PoolName] = frozenset()

    # ------------------------------------------------------------- mapping
    def create(self, layout: PoolLayout, name: str | None = None,
               per_process: bool = False) -> HostPool:
        """Create a pool of ``layout`` on the node (or attach the pool ``name`` if it
        exists with that layout) and map it; a generated name if ``name`` is None.
        ``per_process``: the pool serves this process alone, and the node removes it
        once this process exited (``NodePools.create``'s ``process``); otherwise it
        outlives every rank (a restarted rank finds its L2 intact)."""
        name = check_pool_name(name or f"{layout.kind}-{uuid.uuid4().hex[:12]}")
        process = ProcessIdentity.current() if per_process else None
        return self._map(self._link.call("create_pool", name, layout, process,
                                         claim=self._link.claim(None, "create_pool", name,
                                                                layout, process)))

    def adopt_engine(self, name: str, path: str, layout: PoolLayout,
                     inode: Sequence[int]) -> HostPool:
        """Have the node serve an engine's own memfd ``path`` (``/proc/<pid>/fd/<fd>``,
        ``inode`` its ``(st_dev, st_ino)``) as pool ``name`` with no copy, then map that
        pool here (``NodeService.adopt_engine_pool``)."""
        inode = tuple(inode)
        self._link.call("adopt_engine_pool", name, path, layout, inode,
                        claim=self._link.claim(None, "adopt_engine_pool", name, path, layout,
                                               inode))
        return self.attach(name)

    def attach(self, name: str) -> HostPool:
        """Map the existing pool ``name``; ``ValueError`` if the node has none."""
        if name in self._mapped:
            return self._mapped[name]
        name = check_pool_name(name)
        return self._map(self._link.call("get_pool", name,
                                         claim=self._link.claim(None, "get_pool", name)))

    def destroy(self, pool: HostPool | str) -> bool:
        """Unmap and unregister ``pool`` here, remove it from the node; False if the
        node had no such pool."""
        name = pool if isinstance(pool, str) else pool.name
        mapped = self._mapped.pop(name, None)
        if mapped is not None:
            self._set_registered({k: v for k, v in self._registered.items()
                                  if v is not mapped and getattr(v, "pool", None) is not mapped})
            mapped.close()
        return self._link.call("destroy_pool", name,
                               claim=self._link.claim(None, "destroy_pool", name))

    def remap(self) -> None:
        """Map again every pool whose handle the node actor changed (the link calls
        this after a re-attach); a pool destroyed meanwhile is left as it is."""
        for name in list(self._mapped):
            with contextlib.suppress(ValueError):
                self._map(self._link.ask("get_pool", name,
                                         claim=self._link.claim(None, "get_pool", name)))

    def _map(self, handle: PoolHandle) -> HostPool:
        if handle.epoch != self.epoch:  # the node's pools were allocated anew
            self._link.stale = self._link.stale or any(n != handle.name for n in self._mapped)
            self.epoch = handle.epoch
        pool = self._mapped.get(handle.name)
        if pool is None:
            pool = HostPool.attach(handle)
            pool.pin()
            self._mapped[handle.name] = pool
        elif pool.handle != handle:
            pool.remap(handle)
        return pool

    def mapped(self) -> list[HostPool]:
        """Every pool this client mapped."""
        return list(self._mapped.values())

    # -------------------------------------------------------- registration
    def _own(self, pool: object, what: str) -> HostPool | StagedPool:
        """``pool`` if this client mapped it (a ``StagedPool``: its staging pool)."""
        mapped = pool.pool if isinstance(pool, StagedPool) else pool
        if not isinstance(mapped, HostPool) or self._mapped.get(mapped.name) is not mapped:
            raise ValueError(f"{what} needs a pool returned by this client's create_host_pool "
                             "or attach_host_pool")
        return pool

    def register_kv(self, pool: HostPool | StagedPool, is_mla_model: bool) -> None:
        """Register ``pool`` as KV (see ``CacheClient.register_mem_pool_host``)."""
        self._own(pool, "register_mem_pool_host")
        check_kv_kind(f"pool {pool.name!r}", pool.kind, is_mla_model)
        self._set_registered({**self._registered, PoolName.KV: pool})

    def register(self, pool: object, name: PoolName, is_mla_model: bool) -> None:
        """Register ``pool`` as ``name`` (see ``CacheClient.register_mem_host_pool_v2``)."""
        if isinstance(pool, PoolLayout):  # its geometry alone: no memory, no transfer
            check_key_rule(name, pool.kind)
            if name == PoolName.KV:
                check_kv_kind("a KV layout", pool.kind, is_mla_model)
            self._set_registered({**self._registered, name: PlanPool("", pool)})
            return
        if name == PoolName.DRAFT and not isinstance(pool, HostPool | StagedPool):
            self._register_engine_draft(pool)
            return
        pool = self._own(pool, "register_mem_host_pool_v2")
        check_key_rule(name, pool.kind)
        if name == PoolName.KV:
            self.register_kv(pool, is_mla_model)
        self._set_registered({**self._registered, name: pool})

    def _register_engine_draft(self, pool: object) -> None:
        buf = getattr(pool, "kv_buffer", None)
        page_size = getattr(pool, "page_size", None)
        problem = _draft_problem(buf, page_size)
        if problem:
            if self._draft_problem is None:
                log.warning("draft offload disabled: the draft pool cannot be served: %s",
                            problem)
            self._draft_problem = problem
            self.disabled = frozenset({PoolName.DRAFT})
            return
        memory = describe_kv_buffer(buf, page_size)
        staging = self.create(memory.layout, per_process=True)
        self._set_registered({**self._registered, PoolName.DRAFT: StagedPool(memory, staging)})

    def _set_registered(self, pools: dict[PoolName, HostPool | StagedPool | PlanPool]) -> None:
        self._registered = pools
        self.plan_pools = {n: p if isinstance(p, PlanPool) else PlanPool(p.name, p.layout)
                           for n, p in pools.items()}
        self.staged = {n: p for n, p in pools.items() if isinstance(p, StagedPool)}
        self.specs = tuple(sorted((pp.spec(n) for n, pp in self.plan_pools.items()),
                                  key=lambda s: s.role.value))

    def close(self) -> None:
        """Unmap every pool of this client and forget its registrations."""
        for pool in self._mapped.values():
            pool.close()
        self._mapped.clear()
        self._set_registered({})


def check_kv_kind(what: str, kind: str, is_mla_model: bool) -> None:
    """``ValueError`` unless ``what`` of ``kind`` can be the KV pool of a rank whose config
    says ``is_mla_model`` (vLLM's pools serve MHA)."""
    want = "mla" if is_mla_model else "mha"
    if kind != want and not (kind == "vllm" and want == "mha"):
        raise ValueError(f"{what} is {kind.upper()} but the config says "
                         f"is_mla_model={is_mla_model}")
