"""``RayKVStore``: SGLang's ``HiCacheStorage`` on raykv (the package docstring tells how
SGLang loads it). The only module of the package that imports SGLang."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from raykv.cache_actors.errors import (
    CircuitOpenError,
    DeadlineExceededError,
    NodeUnavailableError,
    UnknownPoolError,
)
from raykv.cache_actors.rank.call_budget import Budget
from raykv.cache_actors.rank.client import CacheClient
from raykv.cache_actors.throttled_log import ThrottledLog
from raykv.controllers.contract import PoolName
from raykv.integrations.ray_join import join_ray
from raykv.integrations.sglang.config import SUPPORTED_POOLS, BackendOptions, storage_config
from raykv.integrations.sglang.hit_guard import HitGuard
from raykv.integrations.sglang.meters import BackendMeters
from raykv.integrations.sglang.serving import ServedPools
from raykv.integrations.sglang.transfers import (
    exists_queries,
    failed,
    results_for,
    to_raykv,
    value,
)
from raykv.integrations.token_metrics import TokenMetrics
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.mem_cache.hicache_storage import PoolName as SGPoolName
from sglang.srt.mem_cache.hicache_storage import PoolTransfer as SGPoolTransfer
from sglang.srt.mem_cache.hicache_storage import PoolTransferResult as SGPoolTransferResult

log = logging.getLogger("raykv.integrations.sglang")

WARN_EVERY_S = 10.0
"""At most one warning per failing call kind per this many seconds."""


class RayKVStore(HiCacheStorage):
    """SGLang ``HiCacheStorage`` on raykv (see the package docstring).

    Constructed by SGLang's factory as ``RayKVStore(storage_config, {})``. Extra-config
    keys read here (``config.CONFIG_KEYS``; any key neither raykv nor SGLang reads fails
    the attach, naming the valid ones): ``ray_address`` (default ``$RAY_ADDRESS``, else
    the cluster of the Ray node this process descends from, else ``auto``, as vLLM's
    connector), ``namespace`` (``ray_namespace`` is its alias), ``ray_auth_mode``,
    ``ray_node_id`` (serve through that node's actor instead of the one of the node Ray
    placed this process on), ``zero_copy`` (default true: share ``allocator: shm`` memfds),
    ``staging_pages`` (per pool and direction, default 256), ``extra_backend_tag`` (key
    tag, as in SGLang's MooncakeStore), ``timeout_s`` (the deadline of each call to raykv,
    default 5 s: past it a lookup is a miss, a backup or a load fails for its pages, and
    SGLang keeps serving), ``tenant`` (its secret from ``$RAYKV_TENANT_SECRET`` of this
    process: keys no other tenant can find), ``model_revision`` (part of a tenant's key
    prefix), ``load_guard`` and ``prefill_tokens_per_s`` (``hit_guard``); the KV dtype and
    page size are checked through the registered pools (``config.STORAGE_KEYS``).

    Methods follow SGLang's ``HiCacheStorage``: registration, the v2 API, the v1 API,
    the legacy abstract API, then ``clear``, ``get_stats``, ``close`` and
    ``raykv_stats``. Every data method turns a failure into misses / failed pages with
    a rate-limited warning, never a raise.
    """

    def __init__(self, storage_config_: HiCacheStorageConfig, kwargs: Any = None) -> None:
        opts = BackendOptions.from_extra(storage_config_.extra_config)
        self.sglang_config = storage_config_
        self.config = storage_config(storage_config_)
        self._namespace = opts.namespace
        joined = join_ray(opts.ray_address, opts.namespace, opts.auth_mode)
        self._node_id = opts.node_id or joined
        self.client = CacheClient(self.config, node_id=self._node_id,
                                  namespace=self._namespace)
        # The node's Mooncake mode decides what zero-copy is possible.
        self._served = ServedPools(self.client, self.client.health()["mode"], opts,
                                   self.config.is_mla_model)
        self._pools = self._served.pools
        self._warn_log = ThrottledLog(log, WARN_EVERY_S)
        self._warned_legacy = False
        self._meters = BackendMeters(self.config.enable_storage_metrics)
        self.counters = self._meters.counters
        self._guard = HitGuard(opts.load_guard, opts.prefill_s_per_token)
        self._metrics = TokenMetrics.for_rank(self.counters, self.config)
        self.mem_pool_host = None
        self.registered_pools = {}
        if not opts.interface_v1:
            log.warning("raykv: \"interface_v1\" is not set in "
                        "--hicache-storage-backend-extra-config: SGLang will use its legacy "
                        "value API, which raykv does not serve (no hits, no backups)")

    # ----------------------------------------------------------- registration
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """The anchor (KV) host pool."""
        super().register_mem_pool_host(mem_pool_host)
        self._served.register(PoolName.KV, mem_pool_host)
        self._guard.page_tokens = mem_pool_host.page_size

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        """Any pool of the host pool group (KV again included). ``ValueError`` for a pool
        raykv does not serve (SGLang then fails the attach with that message)."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = SUPPORTED_POOLS.get(value(host_pool_name))
        if name is None:
            raise ValueError(f"raykv does not serve SGLang pool {value(host_pool_name)!r} "
                             f"(served: {sorted(SUPPORTED_POOLS)})")
        self._served.register(name, host_pool)
        if name is PoolName.KV:
            self._guard.page_tokens = host_pool.page_size

    def on_host_pools_registered(self) -> None:
        """Register the deployment with the controller now, so a conflict with the rest
        of the group (TP size, MLA flag, pool kinds) fails the attach."""
        if PoolName.KV not in self._pools:
            raise ValueError("raykv: no KV host pool was registered")
        self.client.register_deployment()

    # ------------------------------------------------------------------ v2 API
    def batch_exists_v2(self, keys: list[str], pool_transfers: list | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None):
        """The longest prefix KV and every pool of ``pool_transfers`` can restore, for
        the TP group (raykv's group query), cut by the load guard (``hit_guard``)."""
        if not keys:
            return SGPoolTransferResult(0, {}, [])
        try:
            self._ready()
            hit = self.client.group_exists(list(keys), exists_queries(pool_transfers))
            pages, _ = self._guard.guard(hit, len(keys), self.counters)
            return SGPoolTransferResult(
                pages,
                {SGPoolName(p.value): n for p, n in hit.extra_pool_hit_pages.items()},
                [p for p in hit.restorable_prefix_pages if p <= pages])
        except Exception as e:
            self._warn("batch_exists_v2", e)
            return SGPoolTransferResult(0, {}, [])

    def batch_get_v2(self, transfers: list, extra_info=None) -> dict:
        return self._v2(transfers, False, "batch_get_v2")

    def batch_set_v2(self, transfers: list, extra_info=None) -> dict:
        """Never raises: a failure reports every page of the call as not stored."""
        return self._v2(transfers, True, "batch_set_v2")

    def _v2(self, transfers, write: bool, what: str) -> dict:
        """Forward SGLang's ``transfers`` to the client one to one (staged pools go
        through their staging pools in rounds, inside the client)."""
        start = time.perf_counter()
        try:
            self._ready()
            forwarded, empty = to_raykv(transfers)
            out = ({} if not forwarded else self.client.batch_set_v2(forwarded) if write
                   else self.client.batch_get_v2(forwarded))
        except Exception as e:
            self._warn(what, e)
            return failed(transfers)
        result = results_for(out, empty, SGPoolName)
        # a copy of the served pools: close() may clear them meanwhile
        self._meters.record(write, out, dict(self._pools), time.perf_counter() - start)
        return result

    # ------------------------------------------------------------------ v1 API
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._kv_v1(keys, host_indices, write=False)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._kv_v1(keys, host_indices, write=True)

    def _kv_v1(self, keys, host_indices, write: bool) -> list[bool]:
        if not keys:
            return []
        t = SGPoolTransfer(name=SGPoolName.KV, host_indices=host_indices, keys=list(keys))
        out = self._v2([t], write, "batch_set_v1" if write else "batch_get_v1")
        return out.get(SGPoolName.KV, [False] * len(keys))

    # --------------------------------------------------- legacy abstract API
    # SGLang without "interface_v1" hands page *values* (tensors) to batch_set and
    # batch_get. raykv moves bytes only between registered pools and the store, never
    # through a call, so that path is refused: one warning, then False / misses, and
    # SGLang recomputes. The pointer form (target_locations = ints, one object each, as
    # MooncakeStore's) is served when every pointer lies inside one of SGLang's host
    # pools that raykv serves zero-copy (its own memory registered with the store); a
    # pointer into a staged pool is refused (a warning naming why): the store reads and
    # writes only raykv's copy of that pool. Keys carry their own suffixes, as in
    # MooncakeStore's pointer API; the model tag is added once (with a tenant, each
    # whole key is keyed first). set, get and exists name one object by the same key.
    def get(self, key, target_location=None, target_sizes=None):
        """One object into a pointer: True if read in full, else False; None for the
        value form (see above)."""
        if self._value_form("get", None, None if target_location is None
                            else [target_location]):
            return None
        return self._read([key], [target_location], [target_sizes]) == 1

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        """Legacy pointer API: the number of leading *pages* read in full, as
        MooncakeStore counts them (a KV page is ``kv_objects`` objects: K and V, or one
        for MLA; 0 on any failure); the value form returns ``[None] * len(keys)`` (see
        above)."""
        if self._value_form("batch_get", None, target_locations):
            return [None] * len(keys)
        return self._read(keys, target_locations, target_sizes) // self.kv_objects

    @property
    def kv_objects(self) -> int:
        """Objects per KV page (``batch_get`` counts pages of this many objects)."""
        return len(self.client.key_scheme.kv_keys(""))

    def _read(self, keys, target_locations, target_sizes) -> int:
        """Leading objects read in full into the pointers (0 on any failure)."""
        try:
            self._ready()
            ptrs = [self._served.pointer(p) for p in target_locations]
            return self.client.batch_get(list(keys), ptrs, target_sizes)
        except Exception as e:
            self._warn("batch_get", e)
            return 0

    def set(self, key, value=None, target_location=None, target_sizes=None) -> bool:
        """One object from a pointer (see ``batch_set``): True if it is in the store
        (put-if-absent: an existing object is left as it is)."""
        return self.batch_set([key], None if value is None else [value],
                              None if target_location is None else [target_location],
                              None if target_sizes is None else [target_sizes])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None) -> bool:
        """Legacy pointer API: True only if every object was stored; False for the value
        form (see above) and on any failure."""
        if self._value_form("batch_set", values, target_locations):
            return False
        try:
            self._ready()
            ptrs = [self._served.pointer(p) for p in target_locations]
            return self.client.batch_set(list(keys), ptrs, target_sizes)
        except Exception as e:
            self._warn("batch_set", e)
            return False

    def exists(self, key) -> bool:
        """Whether the object ``set(key, ...)`` stores is in the store (as MooncakeStore:
        one object, the key carrying its own suffix; a page's hit is ``batch_exists``)."""
        try:
            self._ready()
            return self.client.objects_exist([key])[0]
        except Exception as e:
            self._warn("exists", e)
            return False

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Leading pages whose KV objects exist for every TP rank (load guard's cut)."""
        if not keys:
            return 0
        try:
            self._ready()
            return self._guard.guard(self.client.group_exists(list(keys)), len(keys),
                                     self.counters)[0]
        except Exception as e:
            self._warn("batch_exists", e)
            return 0

    def _value_form(self, what: str, values, locations) -> bool:
        """Whether a legacy call is the value form (refused; warned once)."""
        if values is None and locations is not None and all(
                isinstance(p, int) for p in locations):
            return False
        if not self._warned_legacy:
            self._warned_legacy = True
            log.warning("raykv: SGLang called the legacy %s with page values; raykv "
                        "serves only the v1/v2 API: add \"interface_v1\": 1 to "
                        "--hicache-storage-backend-extra-config", what)
        return True

    # ----------------------------------------------------------------- misc
    def clear(self) -> None:
        """Remove this deployment's objects from the store, as SGLang's operator asks
        (``/hicache/storage-backend/clear``): every rank's, never another deployment's
        or tenant's (``CacheClient.clear_objects``); takes about one store lease (10 s
        by default) to wait out the leases on them. Raises if it could not (SGLang then
        logs the failure and keeps its own record of what the store holds): a
        deployment without a key prefix (no tenant, model name or tag), an unreachable
        node actor, a store error or the deadline."""
        try:
            self._ready()
            removed = self.client.clear_objects()
        except Exception as e:
            self.counters["clear_failures"] += 1
            log.warning("raykv: clear() failed, nothing more was removed: %s", e)
            raise
        self.counters["cleared_objects"] += removed
        log.info("raykv: clear() removed %d objects of this deployment", removed)

    def get_stats(self):
        """SGLang's ``StorageMetrics`` since the last call (with
        ``enable_storage_metrics``), else None."""
        if not self.config.enable_storage_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        return self._meters.drain_into(StorageMetrics())

    def close(self) -> None:
        """Drop this backend's pools from the node actor and close the client (from
        any thread; a second call does nothing more). A staging pool goes only once the
        staged transfer under way on it has ended, so close() may wait for one transfer
        per pool (its rounds' store calls, each within ``timeout_s``). Calls after
        close() fail their pages, never raise."""
        if self._metrics is not None:
            self._metrics.close()
        self._served.close()

    def raykv_stats(self) -> dict:
        """This backend's counters and how each pool is served."""
        counters = dict(self.counters)
        staged = self._served.staged_bytes()
        if staged:
            counters["staged_bytes"] = staged
        return {"counters": counters, "mode": self._served.mode,
                "pools": self._served.stats()}

    # ----------------------------------------------------------------- helpers
    def _warn(self, what: str, e: BaseException) -> None:
        """Count and (rate-limited) log a failed call. After an unavailable node actor
        (a restart) the zero-copy pools are adopted again before the next call; not after
        a deadline or while the rank's breaker is open (it opened on deadlines): the
        actor is slow or hung, not new, and adopting is a control call."""
        self.counters[f"{what}_failures"] += 1
        restarted = isinstance(e, NodeUnavailableError) and not isinstance(
            e, (DeadlineExceededError, CircuitOpenError))
        if restarted or isinstance(e, UnknownPoolError):
            self._served.mark_readopt()
        self._warn_log.warn(what, "raykv %s failed, reported as misses / failed pages: %s",
                            what, e)

    def _ready(self) -> None:
        """Adopt the zero-copy pools again if the node actor restarted, within one
        ``timeout_s`` (a budget: the control calls never hold SGLang's thread longer)."""
        if self._served.readopt:
            with Budget(self.client.config.timeout_s):
                self._served.readopt_all()
