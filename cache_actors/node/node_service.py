"""What one node's cache does, without Ray: pools, store calls, counting, group queries.

``NodeService`` owns the node's shared host pools (``NodePools``) and its Mooncake client
(``NodeStore``), serves data calls (exists, put, get, group hits) from the Ray actor
(``cache_actors.node.node_actor``, a thin shell over it) and from its local channel
(``cache_actors.node.channel_server``: same code, ~0.1 ms instead of a ~1 ms Ray call), and
counts every outcome once (``NodeMetrics``). Store errors come back as per-object codes;
a bad request raises ``ValueError`` for that call only and the service keeps serving; in
standalone mode a data call raises a retryable ``NodeUnavailableError`` while the node's
``mooncake_client`` is down (``StoreUnavailableError``) or when the caller's pool
mappings are older than the node's pools (``StalePoolsError``, also for a call during
which the pools were allocated anew: a put's objects stored by it are removed, since
their bytes may have come from released memory).

Owners (``controllers.ownership``). Every call names its caller's owner claim: pool
calls and Ray-route data calls as their last argument, channel connections once, when
they open (``verify`` checks a claim: a tenant's carries a call proof of an owner session
the rank opened with ``challenge`` and ``open_session``, good once). Pool calls
on another owner's pool are refused with ``ValueError`` naming the owner; data calls
fail the objects of pools not the caller's, keys outside the caller's key prefix, and
tenants' keys for a caller without a key prefix, with ``NOT_OWNED`` each, after the
batch passed every input check and before any byte moves; a group query of another
deployment is refused. A caller without a claim (None) reaches only pools without an
owner, and group queries of deployments no claim named on this node.
Per-tenant quotas: ``NodePools``.

It also answers the existence queries of every TP/PP group whose home node it is
(``cache_actors.node.group_queries``): one answer shared by the ranks that ask the same (for
at most ``group_window_s``), only the objects that can change the answer looked up, pages
the store confirmed within ``confirm_ttl_s`` not asked again (Mooncake leases what it
reports present; ``controllers.confirmed_pages``), concurrent queries batched into one
``batch_is_exist``. Confirmations are dropped when the store restarts or fails a lookup,
and when told (``forget_confirmations``: a node left).

Threads and locks: which thread calls which method, and which lock guards which state,
is ``docs/internals.md``, *Threads of a node actor and what each lock guards* (the
one copy of that contract).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING

from raykv.cache_actors.data_ops import DATA_OP_ARGS, DEADLINE_OPS, DataOp
from raykv.cache_actors.errors import (
    NodeUnavailableError,
)
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.node.channel_server import ChannelServer
from raykv.cache_actors.node.deployment_clear import DeploymentClear
from raykv.cache_actors.node.deployment_copies import DeploymentCopies
from raykv.cache_actors.node.engine_watch import reap_every
from raykv.cache_actors.node.group_queries import Done, GroupQueries
from raykv.cache_actors.node.l2_pools import L2Pools
from raykv.cache_actors.node.load_estimates import LoadEstimates
from raykv.cache_actors.node.node_pools import NodePools
from raykv.cache_actors.node.node_stats import node_stats
from raykv.cache_actors.node.node_store import NodeStore
from raykv.cache_actors.node.owner_masks import (
    check_group_claim,
    merged,
    outside,
)
from raykv.cache_actors.node.residency_log import ResidencyLog
from raykv.cache_actors.node.residency_query import ResidencyQuery
from raykv.cache_actors.node.store_mover import StoreMover
from raykv.cache_actors.node.ticket_desk import TicketDesk
from raykv.cache_actors.node.touch_journal import TouchJournal
from raykv.cache_actors.node.transfer_merger import TransferMerger
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.shared_memory import shm_path
from raykv.cache_actors.tickets import TicketRef
from raykv.controllers.deployments import Deployment, PoolQuery
from raykv.controllers.naming import CHANNEL_SOCKET
from raykv.controllers.node_records import NodeStats, WarmupStats
from raykv.controllers.node_settings import DEFAULTS
from raykv.controllers.object_batch import ObjectBatch, check_object_keys
from raykv.controllers.owner_keys import Challenge, SessionRequest
from raykv.controllers.ownership import Owner, OwnerClaim, for_call
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import NOT_OWNED

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_metrics import NodeMetrics

log = logging.getLogger(__name__)

DATA_THREADS = 4
ENGINE_REAP_S = 5.0
"""Seconds between two looks at the processes of engine-owned pools."""
ENGINE_GRACE_S = 30.0
"""Seconds an engine pool stays mapped after its process was seen gone (its last store
calls end first)."""


class NodeService:
    """Serves the ranks of one node (see the module docstring for the contract).

    ``prefix``: of every shared file of this node; ``fetch_deployment(id)``: the
    controller's current copy of a deployment (``ValueError`` if it does not know it);
    ``segment_size``: the bytes this node contributes to the store (reported only);
    ``tenant_quotas``: tenant -> bytes its pools here may hold (None: the pools without
    a tenant together); ``tenant_digests``: tenant -> its tenant digest, bound first;
    ``bound_tenants_only``: no other tenant is bound (``OwnerBindings``);
    ``merge_max_inflight``, ``merge_max_objects``: the store calls' merging
    (``NodeSettings``)."""

    def __init__(self, node_id: str, prefix: str, store: NodeStore, metrics: NodeMetrics,
                 fetch_deployment: Callable[[str], Deployment], *, segment_size: int,
                 group_window_s: float, confirm_ttl_s: float,
                 l2_eviction: str = DEFAULTS.l2_eviction,
                 tenant_quotas: Mapping[str, int] | None = None,
                 tenant_digests: Mapping[str, str] | None = None,
                 bound_tenants_only: bool = False, l2_bytes: int = 0,
                 merge_max_inflight: int = DEFAULTS.merge_max_inflight,
                 merge_max_objects: int = DEFAULTS.merge_max_objects) -> None:
        self.node_id = node_id
        self._store = store
        self._metrics = metrics
        self._segment_size = segment_size
        self._started = time.time()
        self.executor = ThreadPoolExecutor(DATA_THREADS, thread_name_prefix="raykv-data")
        self.deployments = DeploymentCopies(fetch_deployment, metrics.record_deployment_fetch)
        self._pools = NodePools(prefix, store, metrics.pool_size, quotas=tenant_quotas,
                                digests=tenant_digests, bound_only=bound_tenants_only)
        self._pools.readopt()
        self.engines = self._pools.engine_watch  # the engines on this node (EngineWatch)
        self.loads = LoadEstimates(store.backend)  # load_runs' estimates
        self._tickets = TicketDesk(outlived_by_store=store.process is not None)
        self._groups = GroupQueries(self._group_lookup, group_window_s, confirm_ttl_s,
                                    on_store_call=metrics.record_group_store_call,
                                    on_query=metrics.record_group_query)
        # clear_objects(caller) -> objects removed: cache_actors.node.deployment_clear
        self.clear_objects = DeploymentClear(store, self.verify, node_id).clear
        store.supervise(self._reallocate)
        self.residency_log = ResidencyLog()  # what routers keep their view of this node by
        self.touches = TouchJournal()  # what this node stored and read lately: drain, warm-up
        self.mover = StoreMover(store, self._pools, TransferMerger(
            self.loads, max_inflight=merge_max_inflight, max_objects=merge_max_objects,
            on_call=metrics.record_merged_call), self._tickets, metrics,
            self.residency_log, self.touches)  # every put and get, L2's included
        # the node's L2 cache (cache_actors.node.l2_pools): its ops are data ops
        self.l2 = L2Pools(self._pools, self.mover, l2_bytes=l2_bytes, eviction=l2_eviction,
                          log=self.residency_log, touches=self.touches)
        # what routers and raykv why ask of this node's tiers (on the actor's route threads)
        self.residency = ResidencyQuery(node_id, store, self.l2, self.mover.verify,
                                        self.residency_log, self.loads.costs)
        metrics.watch_l2(self.l2.counters)
        self._stop = threading.Event()
        reap_every(ENGINE_REAP_S, partial(self._pools.reap_engines, ENGINE_GRACE_S), self._stop)
        self._channel = ChannelServer(
            shm_path(prefix + CHANNEL_SOCKET),
            {DataOp.EXISTS: partial(self.exists, verified=True),
             DataOp.PUT: partial(self.put, verified=True),
             DataOp.GET: partial(self.get, verified=True),
             DataOp.L2_LOOKUP: partial(self.l2.lookup, verified=True),
             DataOp.L2_ACQUIRE: partial(self.l2.acquire, verified=True),
             DataOp.L2_RESERVE: partial(self.l2.reserve, verified=True),
             DataOp.L2_COMMIT: partial(self.l2.commit, verified=True)},
            arg_types=DATA_OP_ARGS, passthrough=(ValueError, NodeUnavailableError),
            async_handlers={DataOp.GROUP_EXISTS: partial(self.group_exists, verified=True)},
            deadline_ops=DEADLINE_OPS,
            bind=lambda claim: self.verify(for_call(claim, "channel")))

    # ----------------------------------------------------------------- pools
    def _reallocate(self) -> None:
        """The watcher's call after ``mooncake_client`` restarted (standalone)."""
        self._groups.forget()
        self.l2.reset()
        self._pools.reallocate()

    def challenge(self) -> Challenge:
        """A fresh challenge for ``open_session`` (``OwnerBindings.challenge``)."""
        return self._pools.owners.challenge()

    def open_session(self, claim: OwnerClaim, request: SessionRequest) -> str:
        """Open an owner session of a tenant's ``claim`` answering a challenge; its id
        (``OwnerBindings.open_session``; ``ValueError`` if refused)."""
        return self._pools.owners.open_session(claim, request)

    def verify(self, claim: OwnerClaim | None) -> OwnerClaim | None:
        """``StoreMover.verify``."""
        return self.mover.verify(claim)

    def _owner(self, claim: OwnerClaim | None) -> Owner | None:
        checked = self.verify(claim)
        return None if checked is None else checked.owner

    def create_pool(self, name: str, layout: PoolLayout,
                    process: ProcessIdentity | None = None,
                    claim: OwnerClaim | None = None) -> PoolHandle:
        """Create pool ``name`` of ``claim``'s owner (or attach it if it exists with the same
        layout and owner); with ``process`` (one engine process's pool) it is removed
        once that process exited (``NodePools.create``, the engine reaper).

        Raises ``ValueError`` if the claim is refused, another owner holds the name, a
        pool of that name exists with another layout or the pool does not fit in
        ``host_pool_bytes``, its tenant's quota or the shared memory (nothing is
        allocated then), and ``StoreUnavailableError`` while ``mooncake_client`` is down
        (standalone).
        """
        return self._pools.create(name, layout, process, self._owner(claim))

    def adopt_engine_pool(self, name: str, path: str, layout: PoolLayout,
                          inode: Sequence[int], claim: OwnerClaim | None = None
                          ) -> PoolHandle:
        """Serve an engine's own memfd ``path`` (``/proc/<pid>/fd/<fd>``, ``inode`` its
        ``(st_dev, st_ino)`` as the engine sees it) as pool ``name`` of ``claim``'s owner with
        no copy (``NodePools.adopt_engine``)."""
        return self._pools.adopt_engine(name, path, layout, inode, self._owner(claim))

    def get_pool(self, name: str, claim: OwnerClaim | None = None) -> PoolHandle:
        """The handle of pool ``name`` of ``claim``'s owner; ``ValueError`` if this node has no
        such pool or it is another owner's."""
        return self._pools.handle(name, self.node_id[:12], self._owner(claim))

    def list_pools(self) -> list[PoolHandle]:
        """Every pool's handle, whoever owns it (what ``stats`` shows too; mapping one
        needs this node's shared memory)."""
        return [p.handle for p in self._pools.settled().pools.values()]

    def destroy_pool(self, name: str, claim: OwnerClaim | None = None) -> bool:
        """Remove pool ``name`` of ``claim``'s owner: later data calls naming it fail with
        ``ValueError``, the calls in flight on it end first (``NodePools.destroy``),
        then it is unregistered and released; False if there was none, ``ValueError``
        if it is another owner's."""
        removed = self._pools.destroy(name, self._owner(claim))
        self.l2.forget(name)
        return removed

    # ------------------------------------------------------------------ data
    def exists(self, keys: list[str], claim: OwnerClaim | None = None, *,
               verified: bool = False) -> list[int]:
        """1 / 0 / negative error per key (``NOT_OWNED`` for a key outside the
        caller's key prefix); ``ValueError`` for keys that are not a list of non-empty
        strings of at most ``MAX_BATCH_OBJECTS`` (``check_object_keys``) or a refused
        claim. ``claim``: the owner claim, checked here (a tenant's call proof is good
        once) unless ``verified`` (the channel: checked when its connection opened)."""
        keys = check_object_keys(keys)
        claim = claim if verified else self.verify(claim)
        out = outside(keys, claim)
        t = time.perf_counter()
        if out is None:
            codes = self._store_exists(keys)
        else:
            asked = [k for k, no in zip(keys, out, strict=True) if not no]
            codes = merged(self._store_exists(asked) if asked else [], out, NOT_OWNED)
        self._metrics.record_exists(time.perf_counter() - t, codes,
                                    None if claim is None else claim.owner)
        return codes

    def put(self, batch: ObjectBatch, ticket: TicketRef | None = None,
            deadline: float | None = None, claim: OwnerClaim | None = None, *,
            verified: bool = False) -> list[int]:
        """Put-if-absent every object from its pool: 0 stored, ``ALREADY_PRESENT`` (1),
        negative error (``NOT_OWNED``: not the caller's pool or key prefix). ``ticket``:
        the rank's (``cache_actors.tickets``; None: none), the store call touches the
        pages only while it holds it. ``deadline`` (``time.monotonic()`` seconds, default
        ``WAIT_S`` from now; ``ValueError`` unless ``check_deadline`` accepts it):
        ``DeadlineExceededError`` if the call reached this actor after it, still waits
        for the store then, or its ticket does not start (the rank gave up on it).
        ``claim``, ``verified``: as for ``exists``."""
        return self.mover.move("put", batch, deadline, claim, ticket, verified)

    def get(self, batch: ObjectBatch, ticket: TicketRef | None = None,
            deadline: float | None = None, claim: OwnerClaim | None = None, *,
            verified: bool = False) -> list[int]:
        """Read every object into its pool; bytes read / negative error per object.
        ``ticket``, ``deadline``, ``claim`` and ``verified`` as for ``put``."""
        return self.mover.move("get", batch, deadline, claim, ticket, verified)

    def _store_exists(self, keys: list[str]) -> list[int]:
        """1 / 0 / negative per key; ``NodeUnavailableError`` while the store is down."""
        epoch = self._store.before_call()
        return self._store.after_call(epoch, self._store.backend.exists(list(keys)))

    def _group_lookup(self, keys: list[str]) -> list[int]:
        """The store lookup of group queries: a store outage also drops every
        confirmation (the objects may be gone when it is back)."""
        try:
            return self._store_exists(keys)
        except NodeUnavailableError:
            self._groups.forget()
            raise

    def group_exists(self, reply: Done, deployment_id: str, version: int,
                     rank: tuple[int, int], engine: str, keys: list[str],
                     queries: list[PoolQuery], claim: OwnerClaim | None = None, *,
                     verified: bool = False) -> None:
        """The group hit of ``deployment_id`` for page ``keys``, asked by ``rank`` (tp, pp)
        of ``engine`` (``engine_id``, "" if none): one answer for an engine's ranks asking
        the same (``cache_actors.node.group_queries``). Never blocks: ``reply(result,
        None)`` or ``reply(None, error)`` once answered (``ValueError`` for an unknown
        deployment, ``DeadlineExceededError`` if the controller did not hand it over in
        time); ``ValueError`` raised here for bad keys or a pool the deployment did not
        register. A deployment not known here at ``version`` is fetched from the
        controller on ``executor`` first. Both routes call it: the channel's I/O thread
        and the Ray actor, which waits for the reply at most ``WAIT_S``. ``claim``: the
        owner claim; a caller of another deployment is refused (``ValueError``), so is a
        caller without a claim once a claim of the deployment was bound here;
        ``verified`` as for ``exists``."""
        claim = claim if verified else self.verify(claim)
        check_group_claim(deployment_id, claim, self._pools.owners.claimed)
        dep = self.deployments.known(deployment_id, version)
        if dep is not None:
            self.loads.submit(self._groups, dep, keys, queries, rank, reply, engine)
            return

        def fetch_then_submit() -> None:
            try:
                dep = self.deployments.get(deployment_id, version)
                self.loads.submit(self._groups, dep, keys, queries, rank, reply, engine)
            except Exception as e:  # unknown deployment or pool: the caller's error
                reply(None, e)
        self.executor.submit(fetch_then_submit)

    # --------------------------------------------------------------- control
    def forget_confirmations(self) -> None:
        """Check every object of later group queries at the store again (call when
        objects may have left it before their lease ran out: a node left, a forced remove)."""
        self._groups.forget()

    @property
    def channel_path(self) -> str:
        """The Unix socket of the local channel (for ranks on this node)."""
        return self._channel.path

    def health(self) -> dict:
        """Store connectivity, pool count (0 while re-allocating), own ``segment``; no lock."""
        return {"node_id": self.node_id, "store_healthy": self._store.healthy(),
                "mode": self._store.mode, "pools": len(self._pools.table.pools),
                "pid": os.getpid(), "segment": self._store.backend.own_segment}

    def stats(self, warnings: list[str], warmup: WarmupStats) -> NodeStats:
        """Counters since start (``node_stats`` says what each entry holds), with the
        actor's ``warnings`` and ``warmup``."""
        return node_stats(self._pools.settled(), self._pools.limits, self._store.stats(),
                          self._metrics, node_id=self.node_id,
                          uptime_s=time.time() - self._started,
                          segment_size=self._segment_size,
                          confirmed_pages=len(self._groups.confirmed), l2=self.l2.stats(),
                          warnings=warnings, residency=self.residency.stats(),
                          warmup=warmup, l2_evictions=self.l2.evictions.stats(),
                          loads=self.loads.stats())

    def shutdown(self, remove_pools: bool = True) -> None:
        """Stop for good: close the channel and the Mooncake client (standalone: stop
        ``mooncake_client`` too); with ``remove_pools`` also remove every pool."""
        self._stop.set()
        self._channel.close()
        self.l2.close()
        self._pools.close(remove_pools)
        self._tickets.close()
        self._store.close()
        self._metrics.close()
        self.executor.shutdown(wait=False)

