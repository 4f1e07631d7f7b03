"""The node actor: the Ray shell of a ``NodeService``.

One per Ray node, named ``node_actor_name(node_id)`` in the ``raykv`` namespace, created
only through ``node_actor_class``, which sets every Ray option it runs under. It is async
with four concurrency groups, each its own event loop, none of which ever blocks:
``control`` (health, channel_path, copy_deployment, forget_confirmations) answers at
once whatever the others do (``copy_deployment`` on a thread of its own); ``pools``
(pool management, stats, shutdown) runs each call on a thread of its own executor
(``POOL_THREADS``: creating a pool reserves its memory, destroying one drains its
calls, up to 30 s); ``data`` calls (exists, put, get, group hits) run on the
service's executor; ``route`` calls (residency, residency_changes, locate: what routers ask,
``cache_actors.node.residency_query``) on ``ROUTE_THREADS`` threads of their own, never
queued behind a transfer. Everything else (what each call does, which threads
run what, which lock guards which state) is ``cache_actors.node.node_service``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.mooncake_wheels import environment_warning
from raykv.cache_actors.node.backlog_metrics import BacklogMetrics
from raykv.cache_actors.node.l2_warmup import L2Warmup, ask_peers
from raykv.cache_actors.node.node_memory import node_memory_bytes
from raykv.cache_actors.node.node_metrics import NodeMetrics
from raykv.cache_actors.node.node_service import DATA_THREADS, NodeService
from raykv.cache_actors.node.node_store import NodeStore
from raykv.cache_actors.node.segment_drain import node_drain
from raykv.cache_actors.node.store_mover import WAIT_S
from raykv.cache_actors.node.tier_metrics import LinkMetrics, TierMetrics
from raykv.cache_actors.node.touch_journal import MAX_ANSWER, Touch
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.tickets import TicketRef
from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolQuery
from raykv.controllers.miss_reasons import NodeFacts
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name, node_shm_prefix
from raykv.controllers.node_records import NodeStats
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.owner_keys import Challenge, SessionRequest
from raykv.controllers.ownership import OwnerClaim, for_call
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.residency import Residency, ResidencyChanges
from raykv.controllers.tenant_quotas import untenanted_bound

log = logging.getLogger(__name__)

POOL_THREADS = 8
"""Pool calls (and stats) running at once; more wait in Ray's queue of the ``pools``
group, never in front of ``health``."""
ROUTE_THREADS = 2
"""Residency and locate queries running at once."""
ROUTE_WAIT_S = 0.05
"""Default of how long a residency query may wait for a thread, in seconds: a router
waits a few ms, an answer later than this is never used."""


class NodeCacheActor:
    """Serves the ranks of one node; each method is the ``NodeService`` method of the same
    name (data ops: ``DataOp``; the drain's: ``SegmentDrain``'s), whose docstring states its
    contract. Pool calls and data calls take the caller's ``OwnerClaim`` last (None: a
    caller without one), each bound here to the call it came with (``ownership.for_call``:
    a tenant's call proof is good for that method and those arguments only). Runs only as
    ``node_actor_class``. Arguments: ``NodeSettings.actor_kwargs()``, all given, each the
    ``NodeSettings`` field of its name (whose docstring says what it means)."""

    def __init__(
        self,
        node_id: str,
        *,
        cluster_tag: str,
        master_address: str,
        metadata_server: str,
        global_segment_size: int,
        local_buffer_size: int,
        protocol: str,
        rdma_devices: str,
        local_hostname: str | None,
        standalone: bool,
        host_pool_bytes: int,
        group_window_s: float,
        confirm_ttl_s: float,
        tenant_quotas: dict[str, int],
        tenant_digests: dict[str, str],
        bound_tenants_only: bool,
        untenanted_pool_bytes: int | None,
        l2_bytes: int, l2_warm_bytes: int, l2_warm_s: float, l2_eviction: str,
        placement: str,
        disk_dir: str, disk_bytes: int, seal_key: str,
        merge_max_inflight: int, merge_max_objects: int,
    ) -> None:
        # Both Mooncake wheels in this node's environment: said at start and in stats.
        self._warnings = [w for w in (environment_warning(),) if w]
        for w in self._warnings:
            log.warning("raykv node actor on %s: %s", node_id[:8], w)
        prefix = node_shm_prefix(cluster_tag, node_id)
        store = NodeStore.open(
            prefix, standalone=standalone,
            host=local_hostname or ray.util.get_node_ip_address(),
            master_address=master_address, metadata_server=metadata_server,
            segment_size=global_segment_size, local_buffer_size=local_buffer_size,
            protocol=protocol, rdma_devices=rdma_devices, host_pool_bytes=host_pool_bytes,
            placement=placement, disk_dir=disk_dir, disk_bytes=disk_bytes,
            seal_key=seal_key)
        self._namespace = ray.get_runtime_context().namespace
        fetch_deployment = partial(controller_copy, self._namespace)
        self._pool_calls = ThreadPoolExecutor(POOL_THREADS, thread_name_prefix="raykv-pools")
        self._service = NodeService(
            node_id, prefix, store, metrics := NodeMetrics(node_id), fetch_deployment,
            segment_size=global_segment_size, group_window_s=group_window_s,
            confirm_ttl_s=confirm_ttl_s, tenant_quotas={**tenant_quotas, None: untenanted_bound(
                untenanted_pool_bytes, standalone, node_memory_bytes())},
            tenant_digests=tenant_digests, bound_tenants_only=bound_tenants_only,
            l2_bytes=l2_bytes, l2_eviction=l2_eviction,
            merge_max_inflight=merge_max_inflight, merge_max_objects=merge_max_objects)
        watch_metrics(metrics, node_id, store, self._service)
        self._service.loads.start(  # measures gets, probes links (load_runs' estimates)
            partial(peer_segments, node_id, self._namespace, {}))
        self._route = ThreadPoolExecutor(ROUTE_THREADS, thread_name_prefix="raykv-route")
        self._drain = node_drain(store.backend, self._service, metrics, self._namespace)
        self._warmup = L2Warmup(self._service.l2, ask_peers, fetch_deployment,
                                metrics.record_warmed, l2_warm_bytes, l2_warm_s)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._service.executor, fn,
                                                                *args)

    async def _pooled(self, fn, *args):
        """``fn(*args)`` on a thread of the ``pools`` group's executor."""
        return await asyncio.get_running_loop().run_in_executor(self._pool_calls, fn, *args)

    # ----------------------------------------------------------------- pools
    @ray.method(concurrency_group="pools")
    async def create_pool(self, name: str, layout: PoolLayout,
                          process: ProcessIdentity | None = None,
                          claim: OwnerClaim | None = None) -> PoolHandle:
        return await self._pooled(self._service.create_pool, name, layout, process,
                                  for_call(claim, "create_pool", name, layout, process))

    @ray.method(concurrency_group="pools")
    async def adopt_engine_pool(self, name: str, path: str, layout: PoolLayout,
                                inode: tuple[int, int], claim: OwnerClaim | None = None
                                ) -> PoolHandle:
        return await self._pooled(self._service.adopt_engine_pool, name, path, layout,
                                  inode, for_call(claim, "adopt_engine_pool", name, path,
                                                  layout, inode))

    @ray.method(concurrency_group="pools")
    async def get_pool(self, name: str, claim: OwnerClaim | None = None) -> PoolHandle:
        return await self._pooled(self._service.get_pool, name,
                                  for_call(claim, "get_pool", name))

    @ray.method(concurrency_group="pools")
    async def list_pools(self) -> list[PoolHandle]:
        return await self._pooled(self._service.list_pools)

    @ray.method(concurrency_group="pools")
    async def destroy_pool(self, name: str, claim: OwnerClaim | None = None) -> bool:
        return await self._pooled(self._service.destroy_pool, name,
                                  for_call(claim, "destroy_pool", name))

    @ray.method(concurrency_group="pools")
    async def l2_open(self, rank: tuple[int, int], layout: PoolLayout, pages: int,
                      share: int = 1, claim: OwnerClaim | None = None) -> PoolHandle | None:
        claim = for_call(claim, "l2_open", rank, layout, pages, share)
        handle = await self._pooled(self._service.l2.open, rank, layout, pages, claim, share)
        return self._warmup.opened(handle, rank, claim)  # a new pool: warmed off this call

    # ---------------------------------------------------------------- owners
    @ray.method(concurrency_group="data")
    async def challenge(self) -> Challenge:
        return self._service.challenge()

    @ray.method(concurrency_group="data")
    async def open_session(self, claim: OwnerClaim, request: SessionRequest) -> str:
        return self._service.open_session(claim, request)

    # ------------------------------------------------------------------ data
    @ray.method(concurrency_group="data")
    async def exists(self, keys: list[str], claim: OwnerClaim | None = None) -> list[int]:
        return await self._run(self._service.exists, keys, for_call(claim, "exists", keys))

    @ray.method(concurrency_group="data")
    async def put(self, batch: ObjectBatch, ticket: TicketRef | None = None,
                  deadline: float | None = None, claim: OwnerClaim | None = None
                  ) -> list[int]:
        """``deadline``: the rank's (``time.monotonic()`` seconds of this host, which the
        rank shares: its pools are this node's shared memory)."""
        return await self._run(self._service.put, batch, ticket, deadline,
                               for_call(claim, "put", batch))

    @ray.method(concurrency_group="data")
    async def get(self, batch: ObjectBatch, ticket: TicketRef | None = None,
                  deadline: float | None = None, claim: OwnerClaim | None = None
                  ) -> list[int]:
        return await self._run(self._service.get, batch, ticket, deadline,
                               for_call(claim, "get", batch))

    @ray.method(concurrency_group="data")
    async def l2_lookup(self, keys: list[str], per_page: int,
                        claim: OwnerClaim | None = None) -> int:
        return await self._run(self._service.l2.lookup, keys, per_page,
                               for_call(claim, "l2_lookup", keys, per_page))

    @ray.method(concurrency_group="data")
    async def l2_acquire(self, holder: tuple[int, int], pool: str, keys: list[str],
                         fill: bool, claim: OwnerClaim | None = None,
                         deadline: float | None = None) -> list[int]:
        """``deadline``: as ``put``'s; the L2 ops change nothing past it."""
        return await self._run(partial(self._service.l2.acquire, deadline=deadline),
                               holder, pool, keys, fill,
                               for_call(claim, "l2_acquire", holder, pool, keys, fill))

    @ray.method(concurrency_group="data")
    async def l2_reserve(self, holder: tuple[int, int], pool: str, keys: list[str],
                         claim: OwnerClaim | None = None,
                         deadline: float | None = None) -> list[int]:
        return await self._run(partial(self._service.l2.reserve, deadline=deadline),
                               holder, pool, keys,
                               for_call(claim, "l2_reserve", holder, pool, keys))

    @ray.method(concurrency_group="data")
    async def l2_commit(self, holder: tuple[int, int], pool: str, keys: list[str],
                        pages: list[int], ok: list[bool], claim: OwnerClaim | None = None,
                        deadline: float | None = None) -> int:
        return await self._run(partial(self._service.l2.commit, deadline=deadline),
                               holder, pool, keys, pages, ok,
                               for_call(claim, "l2_commit", holder, pool, keys, pages, ok))

    @ray.method(concurrency_group="data")
    async def group_exists(self, deployment_id: str, version: int, rank: tuple[int, int],
                           engine: str, keys: list[str], queries: list[PoolQuery],
                           claim: OwnerClaim | None = None) -> PoolTransferResult:
        """Waits for the service's reply at most ``WAIT_S`` (then
        ``DeadlineExceededError``), on the event loop: no thread is held meanwhile."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future = loop.create_future()

        def settle(result: PoolTransferResult | None, error: BaseException | None) -> None:
            if answer.done():  # cancelled, or past its wait
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)

        def reply(result: PoolTransferResult | None, error: BaseException | None) -> None:
            loop.call_soon_threadsafe(settle, result, error)
        self._service.group_exists(reply, deployment_id, version, rank, engine, keys, queries,
                                   for_call(claim, "group_exists", deployment_id, version,
                                            rank, engine, keys, queries))
        try:
            return await asyncio.wait_for(answer, WAIT_S)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the group query was not answered within {WAIT_S:g} s (the store lookup "
                "in flight did not end)") from None

    # ---------------------------------------------------------------- routing
    @ray.method(concurrency_group="route")
    async def residency(self, keys: list[str], per_page: int,
                        claim: OwnerClaim | None = None,
                        within_s: float = ROUTE_WAIT_S) -> Residency:
        """``ResidencyQuery.residency``; not run unless a thread takes it within ``within_s``."""
        return await self._routed(self._service.residency.residency, within_s, keys, per_page,
                                  for_call(claim, "residency", keys, per_page))

    @ray.method(concurrency_group="route")
    async def residency_changes(self, since: tuple[str, int] | None,
                                claim: OwnerClaim | None = None,
                                within_s: float = ROUTE_WAIT_S) -> ResidencyChanges:
        """``ResidencyQuery.changes``; not run unless a thread takes it within ``within_s``."""
        return await self._routed(self._service.residency.changes, within_s, since,
                                  for_call(claim, "residency_changes", since))

    async def _routed(self, query, within_s: float, *args):
        """``query(*args, deadline)`` on a route thread; the deadline is ``within_s``
        (at most ``WAIT_S``) from now."""
        deadline = time.monotonic() + min(max(float(within_s), 0.0), WAIT_S)
        return await asyncio.get_running_loop().run_in_executor(
            self._route, query, *args, deadline)

    @ray.method(concurrency_group="route")
    async def locate(self, keys: list[str], claim: OwnerClaim | None = None
                     ) -> list[list[str]]:
        return await asyncio.get_running_loop().run_in_executor(
            self._route, self._service.residency.locate, keys, for_call(claim, "locate", keys))

    @ray.method(concurrency_group="route")
    async def why(self, keys: list[str], store: bool, claim: OwnerClaim | None = None) -> NodeFacts:
        return await self._routed(self._service.residency.why.facts, WAIT_S, keys, store, claim)

    @ray.method(concurrency_group="route")
    async def touches(self, keys: list[str] | None = None, prefix: str = "",
                      limit: int = MAX_ANSWER) -> dict[str, Touch]:
        """``TouchJournal.answer``: ``keys``' entries, or the ``limit`` latest of ``prefix``."""
        return self._service.touches.answer(keys, prefix, limit)

    # --------------------------------------------------------------- control
    @ray.method(concurrency_group="control")
    async def engines(self, attach: ProcessIdentity | None = None) -> int:
        """Live ranks on this node (``EngineWatch.alive``), ``attach`` (one) counted."""
        if attach is not None:
            self._service.engines.attach(attach)
        return self._service.engines.alive()

    @ray.method(concurrency_group="control")
    async def clear_objects(self, claim: OwnerClaim | None = None) -> int:
        """Off the event loop: it waits out the store's leases (seconds)."""
        return await asyncio.to_thread(self._service.clear_objects,
                                       for_call(claim, "clear_objects"))

    @ray.method(concurrency_group="control")
    async def copy_deployment(self, deployment_id: str, version: int) -> None:
        """Off the event loop (a controller call): ``DeploymentCopies.get``, so the
        group's first query here finds the copy (a rank asks at its registration)."""
        await asyncio.to_thread(self._service.deployments.get, deployment_id, version)

    @ray.method(concurrency_group="control")
    async def forget_confirmations(self) -> None:
        self._service.forget_confirmations()

    @ray.method(concurrency_group="control")
    async def channel_path(self) -> str:
        return self._service.channel_path

    @ray.method(concurrency_group="control")
    async def health(self) -> dict:
        return self._service.health() | {"draining": self._drain.draining}

    @ray.method(concurrency_group="pools")
    async def drain(self, deadline_s: float, room_bytes: int | None = None,
                    reason: str = "operator") -> dict:
        return await self._pooled(self._drain.run, deadline_s, room_bytes, reason)

    @ray.method(concurrency_group="control")
    async def drain_status(self) -> dict | None:
        return self._drain.status()

    @ray.method(concurrency_group="control")
    async def undrain(self) -> None:
        self._drain.undo()

    @ray.method(concurrency_group="pools")
    async def stats(self) -> NodeStats:
        """``NodeService.stats`` with this actor's warnings and warm-ups."""
        return await self._pooled(self._service.stats, self._warnings, self._warmup.stats())

    @ray.method(concurrency_group="pools")
    async def shutdown(self, remove_pools: bool = True) -> None:
        self._warmup.close()
        await self._pooled(self._service.loads.close)
        await self._pooled(self._service.shutdown, remove_pools)
        self._route.shutdown(wait=False)


def controller_copy(namespace: str, deployment_id: str) -> Deployment:
    """The controller's copy of a deployment (``ValueError`` if it does not know it;
    ``TimeoutError`` if the controller does not answer within ``WAIT_S``). Runs on a
    thread of the async node actor: waits on the future, not with ``ray.get``."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    try:
        return controller.deployment.remote(deployment_id).future().result(WAIT_S)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise ValueError(str(e.cause)) from None
        raise


def watch_metrics(metrics: NodeMetrics, node_id: str, store: NodeStore,
                  service: NodeService) -> None:
    """Export the node's tier, write-behind and link gauges with its metrics."""
    metrics.watch(TierMetrics(node_id, store.backend.tier_stats).export)
    metrics.watch(BacklogMetrics(node_id, service.l2.counters).export)
    metrics.watch(LinkMetrics(node_id, service.loads.stats).export)


PEERS_ASKED = 8
"""Node actors ``peer_segments`` asks for their segment per call, at most."""


def peer_segments(node_id: str, namespace: str, asked: dict[str, str],
                  wait_s: float = 5.0) -> tuple[list[str], bool]:
    """The segments of the other node actors of the controller's node list (their
    ``health``'s ``segment``), and whether every node of the list told its own: each
    node asked once (``asked``: node id -> its segment, "" unknown, kept by the caller;
    nodes gone from the list dropped), at most ``PEERS_ASKED`` a call, answers not in
    within ``wait_s`` left for the next call. Runs on the load estimates' thread (waits
    on futures)."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    nodes: dict[str, str] = controller.nodes.remote().future().result(wait_s)
    for gone in set(asked) - set(nodes):
        del asked[gone]
    todo = [n for n in nodes if n != node_id and n not in asked][:PEERS_ASKED]
    futures = {}
    for node in todo:
        try:
            futures[node] = ray.get_actor(nodes[node], namespace=namespace
                                          ).health.remote().future()
        except ValueError:  # gone since the list was made
            continue
    end = time.monotonic() + wait_s
    for node, future in futures.items():
        try:
            asked[node] = future.result(max(0.0, end - time.monotonic()))["segment"] or ""
        except Exception as e:  # too slow or gone: asked again next time
            log.debug("node %s did not say its segment: %s", node[:8], e)
    told = all(n in asked for n in nodes if n != node_id)
    return [s for s in asked.values() if s], told


def node_actor_class(node_id: str, namespace: str, env: dict[str, str]):
    """``NodeCacheActor`` as the Ray actor of ``node_id``, with every Ray option it runs
    under: its concurrency groups, named, detached, hard-pinned to its node, zero CPUs,
    restarted by Ray whenever it dies, ``.remote(...)`` returning the existing actor if
    it is already there; ``env``: its environment variables."""
    return ray.remote(
        concurrency_groups={"control": 2, "pools": POOL_THREADS, "data": DATA_THREADS,
                            "route": ROUTE_THREADS},
        name=node_actor_name(node_id), namespace=namespace, lifetime="detached",
        get_if_exists=True, max_restarts=-1, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        runtime_env={"env_vars": env})(NodeCacheActor)
