"""``CacheClient``: what an inference rank (driver or any Ray actor) calls.

It talks to the cache actor of its own node. Pools are shared memory owned by that
actor and mapped here as torch tensors; calls carry keys and offsets, and the actor
moves the bytes between the pools and Mooncake. Every input is validated here, before
any byte moves, and bad input raises ``ValueError`` naming the problem.

Return conventions (SGLang HiCache): ``batch_exists`` -> leading pages whose objects all
exist; ``batch_set_v1`` / ``batch_get_v1`` -> one bool per page, True only if every
object of the page was stored / read in full; ``batch_set`` -> True if every object was
stored; ``batch_get`` -> number of leading objects read in full.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import ray
import torch

from cache_actors.host_pools import HostPool, PoolHandle, dtype_name, torch_dtype
from cache_actors.object_batch import ObjectBatch
from controllers.contract import StorageConfig
from controllers.keys import KeyPlan
from controllers.naming import NAMESPACE, node_actor_name
from controllers.pool_layout import PoolLayout, check_pool_name


class NodeUnavailableError(RuntimeError):
    """The node's cache actor is down or restarting. Retryable: call again later."""


def check_keys(keys: Sequence[str]) -> list[str]:
    """Return ``keys`` as a list; ``ValueError`` if empty, not strings, empty or repeated."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list of strings, got {type(keys).__name__}")
    if not keys:
        raise ValueError("keys is empty")
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise ValueError(f"key {i} is {k!r}: keys must be non-empty strings")
        if k in seen:
            raise ValueError(f"key {k!r} appears at positions {seen[k]} and {i}")
        seen[k] = i
    return list(keys)


class CacheClient:
    """A rank's handle on the raykv cache of its node.

    ``config`` carries the rank's place in its deployment (TP/PP rank, MLA, model name,
    ``extra_config["extra_backend_tag"]``), which decides the object keys.
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
                               "start raykv with clusters.start_local() first")
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
        self._kv: HostPool | None = None

    def _call(self, method: str, *args):
        try:
            return ray.get(getattr(self._actor, method).remote(*args))
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
            raise NodeUnavailableError(
                f"the raykv cache actor of node {self.node_id[:12]} is unavailable ({e}); "
                "it is restarted automatically: retry the call") from e

    # ----------------------------------------------------------------- pools
    def create_host_pool(
        self,
        kind: str,
        *,
        page_size: int,
        size: int,
        layer_num: int,
        head_num: int = 0,
        head_dim: int = 0,
        kv_cache_dim: int = 0,
        dtype: torch.dtype | str = torch.bfloat16,
        layout: str = "page_first",
        name: str | None = None,
    ) -> HostPool:
        """Create a shared host pool on this node and map it here.

        ``kind`` is ``"mha"`` (needs ``head_num``, ``head_dim``) or ``"mla"`` (needs
        ``kv_cache_dim``); ``size`` and ``page_size`` are token slots. With ``name`` of a
        pool that exists with the same shape, that pool is attached instead (how a
        restarted rank finds its pool again). Raises ``ValueError`` for a bad shape.
        """
        kind = str(kind).lower()
        spec = PoolLayout(kind=kind, page_size=page_size, size=size, layer_num=layer_num,
                          head_num=head_num if kind == "mha" else 0,
                          head_dim=head_dim if kind == "mha" else 0,
                          kv_cache_dim=kv_cache_dim if kind == "mla" else 0,
                          dtype=dtype_name(torch_dtype(dtype)),
                          itemsize=torch_dtype(dtype).itemsize, layout=layout)
        name = check_pool_name(name or f"{kind}-{uuid.uuid4().hex[:12]}")
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
            if mapped is self._kv:
                self._kv = None
            mapped.close()
        return self._call("destroy_pool", name)

    def _map(self, handle: PoolHandle) -> HostPool:
        pool = self._pools.get(handle.name)
        if pool is None or pool.handle != handle:
            pool = HostPool.attach(handle)
            pool.pin()
            self._pools[handle.name] = pool
        return pool

    def register_mem_pool_host(self, pool: HostPool) -> None:
        """Make ``pool`` this rank's KV pool for the v1 API.

        Raises ``ValueError`` if the pool was not mapped by this client or its kind does
        not match ``config.is_mla_model``.
        """
        if not isinstance(pool, HostPool) or self._pools.get(pool.name) is not pool:
            raise ValueError("register_mem_pool_host needs a pool returned by this client's "
                             "create_host_pool or attach_host_pool")
        want = "mla" if self.config.is_mla_model else "mha"
        if pool.handle.layout.kind != want:
            raise ValueError(f"pool {pool.name!r} is {pool.handle.layout.kind.upper()} but the "
                             f"config says is_mla_model={self.config.is_mla_model}")
        self._kv = pool

    def _kv_pool(self) -> HostPool:
        if self._kv is None:
            raise ValueError("no KV host pool is registered: call register_mem_pool_host(pool)")
        return self._kv

    # ------------------------------------------------------------ v1 (pages)
    def _kv_batch(self, keys: Sequence[str], host_indices) -> tuple[ObjectBatch, int]:
        keys = check_keys(keys)
        pool = self._kv_pool()
        layout = pool.handle.layout
        idx = host_indices.cpu().numpy() if isinstance(host_indices, torch.Tensor) \
            else host_indices
        offsets = layout.object_offsets(layout.page_starts(idx, len(keys)))
        batch = ObjectBatch()
        per_page = layout.objects_per_page
        for i, h in enumerate(keys):
            for j, obj in enumerate(self.plan.kv_keys(h)):
                batch.add(obj, pool.name, offsets[i * per_page + j], layout.object_bytes)
        return batch, per_page

    @staticmethod
    def _pages(codes: list[int], per_page: int, ok) -> list[bool]:
        return [all(ok(c) for c in codes[i:i + per_page]) for i in range(0, len(codes), per_page)]

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of leading pages whose KV objects all exist in the store."""
        keys = check_keys(keys)
        objs = [o for h in keys for o in self.plan.kv_keys(h)]
        codes = self._call("batch_is_exist", objs)
        per_page = len(objs) // len(keys)
        hits = self._pages(codes, per_page, lambda c: c == 1)
        return hits.index(False) if False in hits else len(hits)

    def batch_set_v1(self, keys: Sequence[str], host_indices) -> list[bool]:
        """Store the KV pages at ``host_indices`` under ``keys`` (put-if-absent).

        On an MLA model only TP rank 0 writes; other ranks validate and report success,
        as their pages are identical.
        """
        batch, per_page = self._kv_batch(keys, host_indices)
        if self.config.is_mla_model and not self.plan.writes_replicated:
            return [True] * (len(batch) // per_page)
        return self._pages(self._call("batch_put", batch), per_page, lambda c: c >= 0)

    def batch_get_v1(self, keys: Sequence[str], host_indices) -> list[bool]:
        """Read the KV pages under ``keys`` into the pool at ``host_indices``."""
        batch, per_page = self._kv_batch(keys, host_indices)
        codes = self._call("batch_get", batch)
        return self._pages([c == s for c, s in zip(codes, batch.sizes, strict=True)],
                           per_page, bool)

    # ---------------------------------------------------- legacy pointer API
    def _pointer_batch(self, keys, target_locations, target_sizes) -> ObjectBatch:
        keys = check_keys(keys)
        if target_locations is None or target_sizes is None:
            raise ValueError("target_locations and target_sizes are required (raykv moves "
                             "bytes only between shared pools and the store)")
        if not len(keys) == len(target_locations) == len(target_sizes):
            raise ValueError(f"{len(keys)} keys, {len(target_locations)} target_locations and "
                             f"{len(target_sizes)} target_sizes: lengths must match")
        batch = ObjectBatch()
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
        return all(c >= 0 for c in self._call("batch_put", batch))

    def batch_get(self, keys: Sequence[str], target_locations=None, target_sizes=None) -> int:
        """Read objects into the given pointers; the number of leading objects read in full."""
        batch = self._pointer_batch(keys, target_locations, target_sizes)
        codes = self._call("batch_get", batch)
        ok = [c == s for c, s in zip(codes, batch.sizes, strict=True)]
        return ok.index(False) if False in ok else len(ok)

    # --------------------------------------------------------------- control
    def health(self) -> dict:
        return self._call("health")

    def stats(self) -> dict:
        return self._call("stats")

    def close(self) -> None:
        """Unmap every pool of this client; the pools stay on the node."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._kv = None
