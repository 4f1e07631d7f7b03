"""The per-node cache actor: owns the node's shared host pools and its Mooncake client.

One per Ray node, named ``node_actor_name(node_id)`` in the ``raykv`` namespace. It is
async with two concurrency groups: ``control`` (health, stats, pool management) keeps
answering while ``data`` calls (exists, put, get, group hits) run; blocking Mooncake
calls run on a thread pool, never on the event loop. Ranks on the same node send their
data calls over the actor's local channel instead (``cache_actors.local_channel``,
served by the actor's own threads, ~0.1 ms instead of a ~1 ms Ray call); both routes
run the same code (group queries: started in the channel's I/O thread, answered by
the thread that completes their check). Store errors come back as per-object codes; a
bad request raises ``ValueError`` for that call only and the actor keeps serving.

The actor also answers the existence queries of every TP/PP group whose home node it
is (``controllers.group_queries``): one answer shared by the ranks that ask the same
(for at most ``group_window_s``), only the objects that can change the answer checked,
pages the store confirmed within ``confirm_ttl_s`` not asked again (Mooncake leases
what it reports present; ``controllers.confirmed_pages``), concurrent queries batched
into one ``batch_is_exist``. Confirmations are dropped when the store restarts or
fails a check, and when told (``forget_confirmations``: a node left).

``standalone`` selects the Mooncake mode (see ``cache_actors.node_store``); in it, a data
call raises a retryable ``NodeUnavailableError`` while the node's ``mooncake_client`` is
down or when the caller's pool mappings are older than the node's pools.
"""

from __future__ import annotations

import asyncio
import glob
import json
import logging
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import ray
from ray.util import metrics
from raykv.cache_actors.engine_memory import map_engine_pool
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.local_channel import ChannelServer
from raykv.cache_actors.mooncake_codes import ALREADY_PRESENT
from raykv.cache_actors.node_store import NodeStore
from raykv.cache_actors.object_batch import ObjectBatch
from raykv.cache_actors.shared_segment import SHM_DIR, segment_path
from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolQuery
from raykv.controllers.group_queries import GroupQueries
from raykv.controllers.naming import CONTROLLER_NAME
from raykv.controllers.pool_layout import PoolLayout, check_pool_name

log = logging.getLogger(__name__)

DATA_THREADS = 4


def cluster_prefix(cluster_tag: str) -> str:
    """Prefix of every shared segment of one raykv cluster."""
    return f"raykv.{cluster_tag}."


def segment_prefix(cluster_tag: str, node_id: str) -> str:
    """Prefix of every shared segment of one node actor of one raykv cluster."""
    return f"{cluster_prefix(cluster_tag)}{node_id[:16]}."


class NodeMetrics:
    """Ray metrics of one node actor (exported with the ``node`` tag)."""

    def __init__(self, node_id: str) -> None:
        tags = {"node": node_id[:12]}
        self.objects = metrics.Counter(
            "raykv_objects", "Objects moved or refused, by op, pool and outcome",
            tag_keys=("node", "op", "pool", "outcome"))
        self.bytes = metrics.Counter("raykv_bytes", "Bytes moved, by op and pool",
                                     tag_keys=("node", "op", "pool"))
        self.latency = metrics.Histogram(
            "raykv_call_seconds", "Store call latency in the node actor, by op",
            boundaries=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0],
            tag_keys=("node", "op"))
        self.pool_bytes = metrics.Gauge("raykv_pool_bytes", "Bytes of each shared host pool",
                                        tag_keys=("node", "pool"))
        self.group_queries = metrics.Counter(
            "raykv_group_queries", "Group existence queries answered here, by how: "
            "recent / inflight (shared by the ranks of a group), confirmed (from confirmed "
            "pages alone) or checked (own store check)",
            tag_keys=("node", "answer"))
        for m in (self.objects, self.bytes, self.latency, self.pool_bytes, self.group_queries):
            m.set_default_tags(tags)

    def record(self, op: str, outcomes: Counter, nbytes: Counter, seconds: float) -> None:
        for (pool, outcome), n in outcomes.items():
            self.objects.inc(n, tags={"op": op, "pool": pool, "outcome": outcome})
        for pool, n in nbytes.items():
            if n:
                self.bytes.inc(n, tags={"op": op, "pool": pool})
        self.latency.observe(seconds, tags={"op": op})


@ray.remote(concurrency_groups={"control": 2, "data": DATA_THREADS})
class NodeCacheActor:
    """Serves the ranks of one node. See the module docstring for the contract."""

    def __init__(
        self,
        node_id: str,
        cluster_tag: str,
        master_address: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int = 16 << 20,
        protocol: str = "tcp",
        rdma_devices: str = "",
        local_hostname: str | None = None,
        standalone: bool = False,
        host_pool_bytes: int = 0,
        *,
        group_window_s: float = 2.0,
        confirm_ttl_s: float = 2.0,
    ) -> None:
        self.node_id = node_id
        self._prefix = segment_prefix(cluster_tag, node_id)
        self._store = NodeStore.open(
            self._prefix, standalone=standalone,
            host=local_hostname or ray.util.get_node_ip_address(),
            master_address=master_address, metadata_server=metadata_server,
            segment_size=global_segment_size, local_buffer_size=local_buffer_size,
            protocol=protocol, rdma_devices=rdma_devices, host_pool_bytes=host_pool_bytes)
        self._backend = self._store.backend
        self._memory = self._store.memory
        self._segment_size = global_segment_size
        self._pools: dict[str, HostPool] = {}
        self._pool_lock = threading.Lock()
        self._executor = ThreadPoolExecutor(DATA_THREADS, thread_name_prefix="raykv-data")
        self._counts: Counter[str] = Counter()
        self._pool_counts: dict[str, Counter[str]] = {}
        self._count_lock = threading.Lock()
        self._metrics = NodeMetrics(node_id)
        self._started = time.time()
        self._readopt_pools()
        self._store.supervise(self._reallocate)
        self._groups = GroupQueries(
            self._group_check, group_window_s, confirm_ttl_s,
            on_check=lambda s: self._metrics.latency.observe(s, tags={"op": "group_exists"}),
            on_query=lambda how: self._metrics.group_queries.inc(tags={"answer": how}))
        self._deployments: dict[str, Deployment] = {}
        self._namespace = ray.get_runtime_context().namespace
        self._channel = ChannelServer(
            segment_path(self._prefix + "sock"),
            {"exists": self._exists, "put": self._put, "get": self._get},
            passthrough=(ValueError, NodeUnavailableError),
            async_handlers={"group_exists": self._group_submit})

    # ----------------------------------------------------------------- pools
    def _meta_path(self, name: str) -> str:
        return segment_path(self._prefix + name + ".json")

    def _readopt_pools(self) -> None:
        """After a restart, map and register again the pools this node already had."""
        for meta in sorted(glob.glob(os.path.join(SHM_DIR, glob.escape(self._prefix) + "*.json"))):
            with open(meta) as f:
                raw = json.load(f)
            handle = PoolHandle(raw["name"], raw["segment"], PoolLayout(**raw["layout"]))
            try:
                self._adopt(self._memory.readopt(handle))
            except (FileNotFoundError, ValueError) as e:
                log.warning("pool %s could not be re-adopted: %s", handle.name, e)

    def _adopt(self, pool: HostPool) -> None:
        """Register ``pool`` with Mooncake and serve it; on failure give its memory back."""
        try:
            self._backend.register(pool.base_ptr, pool.nbytes)
        except Exception:
            self._memory.release(pool)
            raise
        self._pools[pool.name] = pool
        self._metrics.pool_bytes.set(pool.nbytes, tags={"pool": pool.name})

    def _reallocate(self) -> None:
        """Standalone, after ``mooncake_client`` restarted: every pool anew, same names and
        layouts, in a new epoch (their old buffers are unknown to the new process)."""
        self._groups.forget()
        with self._pool_lock:
            self._memory.renew()
            for name, old in list(self._pools.items()):
                del self._pools[name]
                self._memory.release(old)
                try:
                    self._adopt(self._memory.create(name, old.handle.layout))
                except Exception:
                    log.exception("pool %s could not be allocated again; it is back when "
                                  "the actor restarts", name)

    @ray.method(concurrency_group="control")
    async def create_pool(self, name: str, layout: PoolLayout) -> PoolHandle:
        """Create pool ``name`` (or return it if it exists with the same layout).

        Raises ``ValueError`` if a pool of that name exists with another layout or the
        pool does not fit in ``host_pool_bytes`` (nothing is allocated then), and
        ``StoreUnavailableError`` while ``mooncake_client`` is down (standalone).
        """
        check_pool_name(name)
        if name in self._pools:
            existing = self._pools[name].handle
            if existing.layout != layout:
                raise ValueError(f"pool {name!r} exists on this node with another layout: "
                                 f"{existing.layout} (asked for {layout})")
            return existing
        self._store.check()
        with self._pool_lock:
            pool = self._memory.create(name, layout)
            self._adopt(pool)
        handle = pool.handle
        with open(self._meta_path(name), "w") as f:
            json.dump({"name": name, "segment": handle.segment, "layout": asdict(layout)}, f)
        os.chmod(self._meta_path(name), 0o600)
        return handle

    @ray.method(concurrency_group="control")
    async def adopt_engine_pool(self, name: str, path: str, layout: PoolLayout,
                                probe: list[tuple[int, int]] = ()) -> PoolHandle:
        """Serve an engine's own memfd ``path`` (``/proc/<pid>/fd/<fd>``) as pool
        ``name`` with no copy (``cache_actors.engine_memory``); the same handle again if
        it is already served. ``ValueError`` for anything that is not such a memfd."""
        known = self._pools.get(name)
        if known is not None and known.handle == PoolHandle(name, path, layout):
            return known.handle
        if known is not None:
            raise ValueError(f"pool {name!r} exists on this node as another pool")
        with self._pool_lock:
            self._memory.budget.reserve(name, layout.nbytes)  # released with the pool
            try:
                pool = map_engine_pool(name, path, layout, self._store.mode, probe)
            except BaseException:
                self._memory.budget.release(layout.nbytes)
                raise
            self._adopt(pool)
        return pool.handle

    @ray.method(concurrency_group="control")
    async def get_pool(self, name: str) -> PoolHandle:
        """The handle of pool ``name``; ``ValueError`` if this node has no such pool."""
        if name not in self._pools:
            raise ValueError(f"no pool named {name!r} on node {self.node_id[:12]}; "
                             f"pools here: {sorted(self._pools)}")
        return self._pools[name].handle

    @ray.method(concurrency_group="control")
    async def list_pools(self) -> list[PoolHandle]:
        return [p.handle for p in self._pools.values()]

    @ray.method(concurrency_group="control")
    async def destroy_pool(self, name: str) -> bool:
        """Unregister and remove pool ``name``; False if there was none."""
        with self._pool_lock:
            pool = self._pools.pop(name, None)
            if pool is None:
                return False
            self._backend.unregister(pool.base_ptr)
            self._memory.release(pool)
        if os.path.exists(self._meta_path(name)):  # engine pools have none
            os.unlink(self._meta_path(name))
        self._metrics.pool_bytes.set(0, tags={"pool": name})
        return True

    # ------------------------------------------------------------------ data
    def _pointers(self, batch: ObjectBatch) -> list[int]:
        """Pointers in this process for every object; ``ValueError`` for a bad location."""
        batch.check()
        pools = {}
        for name in set(batch.pools):
            pool = self._pools.get(name)
            if pool is None:
                raise ValueError(f"the batch names pool {name!r}, which this node does not "
                                 "have")
            pools[name] = (pool.base_ptr, pool.nbytes)
        ptrs = []
        for key, name, off, size in zip(batch.keys, batch.pools, batch.offsets, batch.sizes,
                                        strict=True):
            base, nbytes = pools[name]
            if not key:
                raise ValueError("empty object key")
            if size <= 0 or off < 0 or off + size > nbytes:
                raise ValueError(f"object {key!r}: {size} bytes at offset {off} do not lie "
                                 f"inside pool {name!r} of {nbytes} bytes")
            ptrs.append(base + off)
        return ptrs

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _count(self, op: str, batch: ObjectBatch, codes: list[int], seconds: float,
                moved) -> None:
        """Count per node and per pool: objects whose bytes ``moved``, objects already
        present (put), errors by code; export them as Ray metrics."""
        outcomes: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[str] = Counter()
        for code, size, pool in zip(codes, batch.sizes, batch.pools, strict=True):
            if moved(code):
                outcome = "ok"
                nbytes[pool] += size
            elif code == ALREADY_PRESENT:
                outcome = "present"
            else:
                outcome = f"error_{code}"
            outcomes[(pool, outcome)] += 1
        with self._count_lock:
            for (pool, outcome), n in outcomes.items():
                self._pool_counts.setdefault(pool, Counter())[f"{op}_{outcome}"] += n
                name = {"ok": f"{op}_objects", "present": f"{op}_present"}.get(
                    outcome, f"{op}_{outcome}")
                self._counts[name] += n
            self._counts[f"{op}_bytes"] += sum(nbytes.values())
        self._metrics.record(op, outcomes, nbytes, seconds)

    def _checked_exists(self, keys: list[str]) -> list[int]:
        """1 / 0 / negative per key; ``NodeUnavailableError`` while the store is down."""
        epoch = self._store.check()
        return self._store.check_codes(epoch, self._backend.exists(list(keys)))

    def _group_check(self, keys: list[str]) -> list[int]:
        """The store check of group queries: a store outage also drops every
        confirmation (the objects may be gone when it is back)."""
        try:
            return self._checked_exists(keys)
        except NodeUnavailableError:
            self._groups.forget()
            raise

    def _exists(self, keys: list[str]) -> list[int]:
        t = time.perf_counter()
        codes = self._checked_exists(keys)
        with self._count_lock:
            self._counts["exists_calls"] += 1
        self._metrics.latency.observe(time.perf_counter() - t, tags={"op": "exists"})
        return codes

    def _put(self, batch: ObjectBatch) -> list[int]:
        return self._move("put", batch, lambda c: c == 0)

    def _get(self, batch: ObjectBatch) -> list[int]:
        return self._move("get", batch, lambda c: c > 0)

    def _move(self, op: str, batch: ObjectBatch, moved) -> list[int]:
        """Run the backend's ``op`` ("put" / "get") on every object of ``batch`` after
        the store and location checks; count outcomes (``moved(code)``: bytes moved)."""
        epoch = self._store.check(batch.epoch)
        ptrs = self._pointers(batch)
        t = time.perf_counter()
        codes = self._store.check_codes(
            epoch, getattr(self._backend, op)(batch.keys, ptrs, batch.sizes))
        self._count(op, batch, codes, time.perf_counter() - t, moved)
        return codes

    def _known(self, deployment_id: str, version: int) -> Deployment | None:
        """The copy here of the deployment, if it is at ``version`` or later."""
        dep = self._deployments.get(deployment_id)
        return dep if dep is not None and dep.version >= version else None

    def _deployment(self, deployment_id: str, version: int) -> Deployment:
        """The deployment at ``version`` or later, from the controller when the copy here
        is missing or older; ``ValueError`` if the controller does not know it."""
        dep = self._known(deployment_id, version)
        if dep is None:
            controller = ray.get_actor(CONTROLLER_NAME, namespace=self._namespace)
            try:
                # A thread of an async actor: wait on the future, not with ray.get.
                dep = controller.deployment.remote(deployment_id).future().result()
            except ray.exceptions.RayTaskError as e:
                if isinstance(e.cause, ValueError):
                    raise ValueError(str(e.cause)) from None
                raise
            self._deployments[deployment_id] = dep
        return dep

    def _group_exists(self, deployment_id: str, version: int, rank: tuple[int, int],
                      keys: list[str], queries: list[PoolQuery]) -> PoolTransferResult:
        dep = self._deployment(deployment_id, version)
        return self._groups.ask(dep, keys, queries, tuple(rank))

    def _group_submit(self, reply, deployment_id: str, version: int, rank: tuple[int, int],
                      keys: list[str], queries: list[PoolQuery]) -> None:
        """The channel's group query, started in its I/O thread: answered by
        ``reply(result, error)`` once the group's check is done. A deployment not known
        here at ``version`` is fetched from the controller on the data pool first (a
        Ray call must not block the I/O thread)."""
        dep = self._known(deployment_id, version)
        if dep is not None:
            self._groups.submit(dep, keys, queries, tuple(rank), reply)
            return

        def fetch_then_submit() -> None:
            try:
                dep = self._deployment(deployment_id, version)
                self._groups.submit(dep, keys, queries, tuple(rank), reply)
            except Exception as e:  # unknown deployment or pool: the caller's error
                reply(None, e)
        self._executor.submit(fetch_then_submit)

    @ray.method(concurrency_group="data")
    async def batch_is_exist(self, keys: list[str]) -> list[int]:
        """1 / 0 / negative error per key."""
        return await self._run(self._exists, keys)

    @ray.method(concurrency_group="data")
    async def batch_put(self, batch: ObjectBatch) -> list[int]:
        """Put-if-absent every object from its pool: 0 stored, ``ALREADY_PRESENT`` (1),
        negative error."""
        return await self._run(self._put, batch)

    @ray.method(concurrency_group="data")
    async def batch_get(self, batch: ObjectBatch) -> list[int]:
        """Read every object into its pool; bytes read / negative error per object."""
        return await self._run(self._get, batch)

    @ray.method(concurrency_group="data")
    async def group_exists(self, deployment_id: str, version: int, rank: tuple[int, int],
                           keys: list[str], queries: list[PoolQuery]) -> PoolTransferResult:
        """The hit of the whole TP/PP group of ``deployment_id`` (whose home node this
        is) for page ``keys``, asked by ``rank`` (tp, pp): every rank of the group asking
        about the same keys and pools gets the identical answer (see
        ``controllers.group_queries``). ``ValueError`` for an unregistered deployment or
        a pool it did not register."""
        return await self._run(self._group_exists, deployment_id, version, rank, keys,
                               queries)

    # --------------------------------------------------------------- control
    @ray.method(concurrency_group="control")
    async def forget_confirmations(self) -> None:
        """Check every object of later group queries at the store again (call when
        objects may have left it without their lease running out: a node left, a forced
        remove)."""
        self._groups.forget()

    @ray.method(concurrency_group="control")
    async def channel_path(self) -> str:
        """The Unix socket of this actor's local channel (for ranks on this node)."""
        return self._channel.path

    @ray.method(concurrency_group="control")
    async def health(self) -> dict:
        """Answers while data calls run: store connectivity and the pool count."""
        return {"node_id": self.node_id, "store_healthy": self._store.healthy(),
                "mode": self._store.mode, "pools": len(self._pools), "pid": os.getpid()}

    @ray.method(concurrency_group="control")
    async def stats(self) -> dict:
        """Counters since start: objects and bytes put/got, errors by Mooncake code; per
        pool its kind, bytes, pages and object counters (``put_ok``, ``put_present``,
        ``get_ok``, ``get_error_-704``...); group queries answered here (``recent``,
        ``inflight``: shared; ``confirmed``: from confirmations alone; ``checked``: own store
        check; ``store_calls``) and ``confirmed_pages`` held; the mode,
        ``host_pool_bytes`` (budget, 0: none) and ``host_pool_used`` (bytes of live pools,
        each counted once), and in standalone mode the ``mooncake_client`` process (pid,
        port, adopted, restarts, alive)."""
        return {
            **self._store.stats(),
            "node_id": self.node_id,
            "uptime_s": time.time() - self._started,
            "global_segment_size": self._segment_size,
            "pools": {n: {"kind": p.handle.layout.kind, "bytes": p.nbytes,
                          "pages": p.handle.layout.num_pages,
                          "counters": dict(self._pool_counts.get(n, {}))}
                      for n, p in self._pools.items()},
            "counters": dict(self._counts),
            "group_queries": asdict(self._groups.stats),
            "confirmed_pages": len(self._groups.confirmed),
        }

    @ray.method(concurrency_group="control")
    async def shutdown(self, remove_pools: bool = True) -> None:
        """Stop for good: close the channel and the Mooncake client (standalone: stop
        ``mooncake_client`` too); with ``remove_pools`` also remove every pool."""
        self._channel.close()
        for name in list(self._pools):
            pool = self._pools.pop(name)
            self._backend.unregister(pool.base_ptr)
            self._memory.release(pool, remove=remove_pools)
            if remove_pools and os.path.exists(self._meta_path(name)):
                os.unlink(self._meta_path(name))
        self._store.close()
        self._executor.shutdown(wait=False)
