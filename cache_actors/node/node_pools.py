"""The shared host pools a node actor owns, published as one immutable table.

``PoolTable`` is one generation of the node's pools: its ``epoch`` (the ``PoolHandle.epoch``
of every pool in it) and the pools by name. A table is never changed once published;
``NodePools`` replaces ``NodePools.table`` whole, by one assignment, so a data call that
reads the attribute once holds a consistent generation for the whole call: its epoch and
its pools always belong together.

A data call resolves its batch against the one table it read: a batch whose epoch is not
that table's gets ``StalePoolsError`` (retryable: re-map), never a ``ValueError`` from a
table caught half-way through a re-allocation. When ``mooncake_client`` restarted
(standalone), ``reallocate`` first publishes an empty table of the new epoch (every old
handle is stale from then on), then releases the old pools and allocates them anew (the
budget holds one generation at a time), then publishes the full table of the new epoch.

Teardown never frees memory under a live pointer. A data call resolves its pointers from
one table, then counts itself in on the pools it uses (``enter``, under a small lock that
also checks those pools are still published) and out after its store call (``leave``).
A pool leaving (``destroy``: the destroy_pool API, an SGLang backend's close, the engine
reaper; ``close``: the actor stops; ``reallocate``: ``mooncake_client`` restarted) first
leaves the table, so new calls naming it fail (``ValueError``, or ``StalePoolsError``
after a re-allocation) before any byte moves, then waits up to ``drain_s`` seconds for
the calls in flight on it, and only then is unregistered and unmapped (embedded) or has
its pages given back (standalone). A pool whose calls outlive the wait (a stuck store
call) is *parked*: it stays mapped and registered, an error is logged, and it is released
when its last call leaves (``pool_flights``). So a store call never reads unmapped
memory (a crash) or memory given back (zeros stored under real keys and reported stored).

Changes hold no lock while they work (``pool_changes``): a pool is allocated,
registered, drained and released with its change marked begun, not under the pool lock,
so ``health``, the data path and changes of other pools never wait for it.

Restart: each pool has a record (``pool_records``) that a restarted actor re-adopts;
a record it cannot trust is logged and skipped, never stopping the actor.
In standalone mode the recorded path is never mapped (every pool gets fresh memory).

Owners (``controllers.ownership``). Each pool has an owner (a deployment and its tenant;
None: legacy), kept in the table beside the pool and in its record. Pool calls name
their caller's owner (already verified: ``OwnerBindings.verify``) and are refused with a
``ValueError`` naming the pool's owner unless it is theirs: a create of a name another
owner holds, adoption, lookup (``handle``), destroy. The node itself (the engine reaper,
``close``, re-allocation) acts as ``ANYONE``. A restarted actor binds the tenants' owner
keys its records hold again (``OwnerBindings.bind``). Quotas
(``controllers.tenant_quotas``): a tenant's pools here are summed from the table (no
second count to drift) and a create or adoption that would put it over its quota is
refused before anything is allocated; so is one that would take the pools without a
tenant over their bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import NoReturn

from raykv.cache_actors.errors import StalePoolsError, UnknownPoolError
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.engine_memory import map_engine_pool
from raykv.cache_actors.node.engine_watch import EngineWatch
from raykv.cache_actors.node.node_store import NodeStore
from raykv.cache_actors.node.pool_changes import PoolChanges
from raykv.cache_actors.node.pool_flights import PoolFlights
from raykv.cache_actors.node.pool_records import PoolRecords
from raykv.cache_actors.processes import ProcessIdentity
from raykv.controllers.node_records import TenantUse
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.ownership import Owner, OwnerBindings, check_access
from raykv.controllers.pool_layout import PoolLayout, check_pool_name
from raykv.controllers.tenant_quotas import check_fits, check_untenanted_fits

log = logging.getLogger(__name__)

DRAIN_S = 30.0
"""Seconds a leaving pool waits for the data calls in flight on it before it is parked
(kept mapped until they end) instead of released."""
CHANGE_S = 90.0
"""Seconds beyond ``drain_s`` a change of a pool waits for another change of the same
pool (or of every pool) to end: a drain, then an allocation and registration."""
ANYONE = object()
"""The caller of the node's own pool calls (engine reaper, shutdown): passes every owner
check."""


def _stale(old: int, new: int) -> StalePoolsError:
    """The error of a call whose pool handles are of epoch ``old``, the node's ``new``."""
    return StalePoolsError(f"this node's pools were allocated anew (epoch {old} -> {new}); "
                           "L2 contents were lost: re-map and retry")


@dataclass(frozen=True)
class PoolTable:
    """One generation of a node's pools and their owners (None: legacy; read-only; see
    the module docstring)."""

    epoch: int
    pools: Mapping[str, HostPool] = field(default_factory=lambda: MappingProxyType({}))
    owners: Mapping[str, Owner | None] = field(default_factory=lambda: MappingProxyType({}))

    def replaced(self, name: str, pool: HostPool | None,
                 owner: Owner | None = None) -> PoolTable:
        """A table of the same epoch with ``pool`` of ``owner`` as ``name`` (None:
        without ``name``)."""
        pools = {n: p for n, p in self.pools.items() if n != name}
        owners = {n: o for n, o in self.owners.items() if n != name}
        if pool is not None:
            pools[name] = pool
            owners[name] = owner
        return PoolTable(self.epoch, MappingProxyType(pools), MappingProxyType(owners))

    def use(self, tenant: str | None) -> int:
        """Bytes of the pools of ``tenant`` in this table (None: of the pools without a
        tenant, legacy ones included)."""
        owners = self.owners
        return sum(p.nbytes for n, p in self.pools.items()
                   if getattr(owners.get(n), "tenant", None) == tenant)

    def tenants(self, quotas: Mapping[str, int]) -> dict[str | None, TenantUse]:
        """Per tenant with pools here or a quota in ``quotas``: ``pool_bytes``, ``pools``
        and ``quota`` (bytes, None: none); pools without a tenant under the key ``None``
        (counted under no quota)."""
        out: dict[str | None, TenantUse] = {t: TenantUse(quota=q) for t, q in quotas.items()}
        for name, pool in self.pools.items():
            owner = self.owners.get(name)
            tenant = owner.tenant if owner is not None else None
            entry = out.setdefault(tenant, TenantUse(quota=quotas.get(tenant)))
            entry.pool_bytes += pool.nbytes
            entry.pools += 1
        return out

    def check_current(self, current: PoolTable, pools: tuple[HostPool, ...]) -> None:
        """Raise unless every pool of ``pools`` (resolved from this table) is still
        published in ``current``: ``StalePoolsError`` if ``current`` is of another epoch,
        ``ValueError`` if one was destroyed."""
        if current is self:
            return
        if current.epoch != self.epoch:
            raise _stale(self.epoch, current.epoch)
        for pool in pools:
            if current.pools.get(pool.name) is not pool:
                raise ValueError(f"pool {pool.name!r} was destroyed on this node while the "
                                 "call was being prepared")

    def resolve(self, batch: ObjectBatch) -> tuple[list[int], tuple[HostPool, ...]]:
        """Pointers in this process for every object of ``batch`` and the pools they lie
        in. ``StalePoolsError`` if the batch's offsets were taken from another
        generation's handles, ``ValueError`` for a bad batch (``ObjectBatch.check``) or
        an object outside its pool."""
        names = batch.check()
        if batch.epoch != self.epoch:
            raise _stale(batch.epoch, self.epoch)
        pools = {}
        used = []
        for name in names:
            pool = self.pools.get(name)
            if pool is None:
                raise UnknownPoolError(f"the batch names pool {name!r}, which this node "
                                       "does not have (never created, or destroyed)")
            pool.check()  # an engine's memfd that shrank: refused, never a SIGBUS
            pools[name] = (pool.base_ptr, pool.nbytes)
            used.append(pool)
        ptrs = []
        for key, name, off, size in zip(batch.keys, batch.pools, batch.offsets, batch.sizes,
                                        strict=True):
            base, nbytes = pools[name]
            if size <= 0 or off < 0 or off + size > nbytes:
                raise ValueError(f"object {key!r}: {size} bytes at offset {off} do not lie "
                                 f"inside pool {name!r} of {nbytes} bytes")
            ptrs.append(base + off)
        return ptrs, tuple(used)


def replaced_during(op: str, batch: ObjectBatch, codes: list[int], epoch: int, now: int,
                    remove: Callable[[list[str]], list[int]]) -> NoReturn:
    """A data call ``op`` of ``epoch`` ended in epoch ``now``: the pools were allocated
    anew while it ran (standalone: ``mooncake_client`` restarted), so its bytes may have
    moved from or into released, zero-filled memory. A put's objects stored by this
    call (code 0) are removed (``remove``: the store's), so that no zeros stay under
    real keys; then ``StalePoolsError`` (retryable) for the whole call, never a
    success. Re-allocation starts a new epoch before it releases any memory, so a call
    that ends still in its epoch read valid memory."""
    stored = [k for k, c in zip(batch.keys, codes, strict=True) if c == 0]
    if op == "put" and stored:
        failed = [k for k, c in zip(stored, remove(stored), strict=True) if c != 0]
        if failed:  # never the keys: a tenant's name its objects (docs/deploy.md)
            log.warning("%d objects put while the pools were replaced could not be "
                        "removed", len(failed))
    raise StalePoolsError(
        f"this node's pools were allocated anew during the {op} (epoch {epoch} -> {now}); "
        "its objects were not kept: re-map and retry")


class NodePools:
    """Creates, re-adopts, re-allocates and removes the pools of one node, registers
    each with the node's Mooncake client, keeps a ``<prefix><name>.json`` record per pool
    (what a restarted actor re-adopts) and tells ``sized(name, nbytes, owner)`` each
    pool's size (0: gone). ``owners``: the owner bindings of this node actor;
    ``quotas``: tenant -> bytes its pools here may hold, and under None what the pools
    without a tenant may hold together (``untenanted_bytes``; 0 or absent: no bound of
    their own; see the module docstring); ``limits``: both.

    Concurrency: ``table`` may be read by any thread without a lock (one snapshot per
    read). ``_lock`` guards the table's replacement, the engine processes and the
    changes under way (``PoolChanges``), never held across an allocation, a Mooncake
    (un)registration or a drain (they run with their change marked begun), so changes
    of different pools run side by side. ``_flights`` (``PoolFlights``): data calls in
    flight, drains; lock order ``_lock`` then ``_flights.lock``. ``drain_s``: how long
    a leaving pool waits for its calls (see the module docstring)."""

    def __init__(self, prefix: str, store: NodeStore,
                 sized: Callable[[str, int, Owner | None], None], *,
                 drain_s: float = DRAIN_S, quotas: Mapping[str, int] | None = None,
                 digests: Mapping[str, str] | None = None, bound_only: bool = False
                 ) -> None:
        self._store, self._sized, self._drain_s = store, sized, drain_s
        self._records = PoolRecords(prefix, store.mode)
        self.limits = MappingProxyType({t: n for t, n in (quotas or {}).items() if n})
        self.quotas = MappingProxyType({t: n for t, n in self.limits.items() if t is not None})
        self.untenanted_bytes = self.limits.get(None, 0)
        self.owners = OwnerBindings(keep=self._owns_pools, digests=digests,
                                    bound_only=bound_only)
        self._lock = threading.Lock()
        self._changes = PoolChanges(self._lock, drain_s + CHANGE_S)
        self.table = PoolTable(store.memory.epoch)
        self._engines = EngineWatch()  # pools of one engine process (under _lock)
        self.engine_watch = self._engines  # alive(), attach(): the reconciler asks
        self._flights = PoolFlights()

    def _register(self, pool: HostPool, owner: Owner | None) -> HostPool:
        """Register ``pool`` with Mooncake; on failure give its memory back."""
        try:
            self._store.backend.register(pool.base_ptr, pool.nbytes)
        except Exception:
            self._store.memory.release(pool)
            raise
        self._sized(pool.name, pool.nbytes, owner)
        return pool

    def _owns_pools(self, deployment: str) -> bool:
        """Whether ``deployment`` owns a pool here now (read without the lock)."""
        return any(o is not None and o.deployment_id == deployment
                   for o in self.table.owners.values())

    def _check_owner(self, name: str, caller: Owner | None | object, what: str) -> None:
        """With ``_lock`` held: ``ValueError`` unless ``caller`` may ``what`` pool
        ``name`` (which exists)."""
        if caller is not ANYONE:
            check_access(name, self.table.owners.get(name), caller, what)

    def _begin_new(self, name: str, owner: Owner | None, nbytes: int) -> None:
        """With ``_lock`` held and the change of ``name`` begun, ``name`` not in the
        table: ``ValueError`` if a pool of ``nbytes`` puts ``owner``'s tenant over its
        quota, or the pools without a tenant over ``untenanted_bytes`` (counting the
        pools being made), else count it as being made."""
        tenant = owner.tenant if owner is not None else None
        used = self.table.use(tenant) + self._changes.pending(tenant)
        if tenant is None:
            check_untenanted_fits(self.untenanted_bytes, name, nbytes, used)
        else:
            check_fits(self.quotas, tenant, name, nbytes, used)
        self._changes.reserve(name, owner, nbytes)

    def _publish(self, name: str, pool: HostPool, owner: Owner | None,
                 process: ProcessIdentity | None) -> None:
        with self._lock:
            self.table = self.table.replaced(name, pool, owner)
            if process is not None:
                self._engines.watch(name, process)

    def used(self, tenant: str | None) -> int:
        """Bytes of ``tenant``'s pools here (None: the pools without one), those being
        made included."""
        with self._lock:
            return self.table.use(tenant) + self._changes.pending(tenant)

    def tenants(self) -> dict[str | None, TenantUse]:
        """``PoolTable.tenants`` of the settled table under ``limits``."""
        return self.settled().tenants(self.limits)

    def settled(self) -> PoolTable:
        """The table once no re-allocation is under way (waits, without the lock, for
        one that is)."""
        with self._lock:
            self._changes.wait_whole()
            return self.table

    # ------------------------------------------------------ data calls in flight
    def enter(self, table: PoolTable, pools: tuple[HostPool, ...]) -> None:
        """Count a data call in on ``pools``, which it resolved from ``table``, before
        its store call; ``leave(pools)`` after it, always. Raises (nothing counted) if
        one of them left the table since: ``StalePoolsError`` after a re-allocation,
        ``ValueError`` after a destroy."""
        with self._flights.lock:
            table.check_current(self.table, pools)
            self._flights.count_in(pools)

    def leave(self, pools: tuple[HostPool, ...]) -> None:
        """Count a data call out of ``pools`` (see ``enter``); a parked pool whose last
        call this was is released now."""
        self._flights.count_out(pools)

    def _unregister_and_release(self, remove: bool = True) -> Callable[[HostPool], None]:
        def release(pool: HostPool) -> None:
            self._store.backend.unregister(pool.base_ptr)
            self._store.memory.release(pool, remove=remove)
        return release

    def readopt(self) -> None:
        """At start: map and register again the pools this node had before a restart;
        a record that cannot be trusted or used is logged and skipped (never raises for
        one: the actor must start)."""
        for record in self._records.trusted():
            handle = record.handle
            try:
                if record.owner is not None:  # its tenant's key is bound again
                    self.owners.bind(record.owner, record.owner_key)
                pool = self._register(self._store.memory.readopt(handle), record.owner)
            except Exception as e:  # noqa: BLE001 - one pool must not stop the actor
                log.warning("pool %s could not be re-adopted: %s", handle.name, e)
                continue
            # the reaper removes it once its engine process is gone
            self._publish(pool.name, pool, record.owner, record.process)

    # ---------------------------------------------------------------- changes
    def create(self, name: str, layout: PoolLayout, process: ProcessIdentity | None = None,
               owner: Owner | None = None) -> PoolHandle:
        """Pool ``name`` of ``owner`` (made now unless it exists with the same layout
        and owner: then it is attached). ``ValueError`` for a name another owner holds,
        another layout, a bad name, a pool over the budget or its tenant's quota or one
        the shared memory cannot hold (nothing allocated), ``StoreUnavailableError``
        while ``mooncake_client`` is down (standalone). ``process``: the one process the
        new pool serves (an engine's staging pool); ``reap_engines`` removes the pool
        once that process exited, if this machine shows it now (else it is kept: a
        process of another pid namespace or machine cannot be watched). Pools without a
        process (L2 shared by many ranks) outlive every rank. A create of a pool being
        made waits for that one (then attaches it); the memory is reserved and
        registered with no lock held."""
        check_pool_name(name)
        with self._changes.of(name):
            with self._lock:
                existing = self.table.pools.get(name)
                if existing is not None:
                    self._check_owner(name, owner, "create or attach")
                    if existing.handle.layout != layout:
                        raise ValueError(f"pool {name!r} exists on this node with another "
                                         f"layout: {existing.handle.layout} (asked for "
                                         f"{layout})")
                    return existing.handle
                self._begin_new(name, owner, layout.nbytes)
            self._store.before_call()
            pool = self._register(self._store.memory.create(name, layout), owner)
            watched = process if process is not None and process.alive() else None
            try:
                self._records.write(pool, watched, owner,
                                    self.owners.digest(owner.tenant if owner else None))
            except BaseException:
                self._unregister_and_release()(pool)
                self._sized(name, 0, owner)
                raise
            self._publish(name, pool, owner, watched)
            return pool.handle

    def adopt_engine(self, name: str, path: str, layout: PoolLayout,
                     inode: Sequence[int], owner: Owner | None = None) -> PoolHandle:
        """An engine's own memfd ``path`` served as pool ``name`` of ``owner`` with no
        copy (``engine_memory.map_engine_pool`` checks it, ``inode`` = the engine's
        ``(st_dev, st_ino)`` of it); the same handle again if it is already served. No
        metadata file: a restarted actor does not re-adopt it (the engine registers it
        again). ``ValueError`` for anything that is not such a memfd, a name another
        owner holds or taken by another pool, or a pool over the budget or its tenant's
        quota. Mapped and registered with no lock held."""
        with self._changes.of(name):
            with self._lock:
                known = self.table.pools.get(name)
                if known is not None:
                    self._check_owner(name, owner, "adopt engine memory as")
                    if known.handle != PoolHandle(name, path, layout):
                        raise ValueError(f"pool {name!r} exists on this node as another pool")
                    return known.handle
                self._begin_new(name, owner, layout.nbytes)
            budget = self._store.memory.budget
            budget.reserve(name, layout.nbytes)  # released with the pool
            try:
                pool, process = map_engine_pool(name, path, layout, self._store.mode,
                                                tuple(inode))
            except BaseException:
                budget.release(layout.nbytes)
                raise
            pool = self._register(pool, owner)
            self._publish(name, pool, owner, process)
            return pool.handle

    def reap_engines(self, grace_s: float) -> list[str]:
        """Destroy the pools of one engine process (adopted memfds, and pools created
        with an ``owner``: SGLang staging pools, vLLM pools) whose process exited at
        least ``grace_s`` seconds ago (seen gone by an earlier call that long before);
        ``destroy`` then also waits for the store calls still moving its pages. An engine
        that dies without closing its backend would otherwise keep its host pools alive
        in this node. Returns the names."""
        with self._lock:
            watched = self._engines.watched()
        due = self._engines.due(watched, time.monotonic(), grace_s)
        for name in due:
            log.warning("pool %s: the engine process it served exited; the pool is removed",
                        name)
            self.destroy(name, ANYONE)
        return due

    def handle(self, name: str, node: str, owner: Owner | None | object = ANYONE
               ) -> PoolHandle:
        """The handle of pool ``name`` for ``owner``; ``ValueError`` naming ``node`` if
        there is none, or naming its owner if it is not ``owner``'s."""
        table = self.settled()
        if name not in table.pools:
            visible = sorted(n for n in table.pools
                             if owner is ANYONE or table.owners.get(n) == owner)
            raise ValueError(f"no pool named {name!r} on node {node}; pools of this owner "
                             f"here: {visible}")
        if owner is not ANYONE:
            check_access(name, table.owners.get(name), owner, "attach")
        return table.pools[name].handle

    def destroy(self, name: str, owner: Owner | None | object = ANYONE) -> bool:
        """Remove pool ``name`` from the table (later calls naming it fail), wait for the
        data calls in flight on it (at most ``drain_s``; parked after that), then
        unregister and release it; False if there was none. ``ValueError`` naming its
        owner if it is not ``owner``'s (nothing removed). The drain holds no lock: only
        another change of ``name`` waits for it."""
        with self._changes.of(name):
            with self._lock:
                pool = self.table.pools.get(name)
                if pool is None:
                    return False
                self._check_owner(name, owner, "destroy")
                pool_owner = self.table.owners.get(name)
                with self._flights.lock:
                    self.table = self.table.replaced(name, None)
                self._engines.forget(name)
            self._records.remove(name)  # engine pools have none
            self._flights.drain([pool], self._unregister_and_release(), self._drain_s)
        self._sized(name, 0, pool_owner)
        return True

    def reallocate(self) -> None:
        """Standalone, after ``mooncake_client`` restarted: every pool anew, same names and
        layouts, in a new epoch (the new process does not know the old buffers). The old
        pools are released once the calls in flight on them ended (``drain_s``). A pool
        that cannot be allocated again is logged and comes back when the actor
        restarts. Control reads (``settled``) wait for it; no lock is held meanwhile."""
        memory = self._store.memory
        with self._lock:
            self._changes.begin_whole()
            old = self.table
            memory.renew()
            with self._flights.lock:
                self.table = PoolTable(memory.epoch)  # every old handle is stale from here
        try:
            self._flights.drain(list(old.pools.values()), memory.release, self._drain_s)
            fresh = {}
            for name, pool in old.pools.items():
                try:
                    fresh[name] = self._register(memory.create(name, pool.handle.layout),
                                                 old.owners.get(name))
                except Exception:
                    log.exception("pool %s could not be allocated again; it is back when "
                                  "the actor restarts", name)
            with self._lock:
                self.table = PoolTable(memory.epoch, MappingProxyType(fresh),
                                       MappingProxyType({n: o for n, o in old.owners.items()
                                                         if n in fresh}))
        finally:
            with self._lock:
                self._changes.end_whole()

    def close(self, remove: bool) -> None:
        """Unregister and unmap every pool (the actor stops for good), once the data calls
        in flight on them ended (at most ``drain_s``); with ``remove`` also delete their
        shared-memory and metadata files."""
        with self._lock:
            self._changes.begin_whole()
            with self._flights.lock:
                old, self.table = self.table, PoolTable(self.table.epoch)
            self._engines.clear()
        try:
            if remove:
                for name in old.pools:
                    self._records.remove(name)
            self._flights.drain(list(old.pools.values()),
                                self._unregister_and_release(remove), self._drain_s)
        finally:
            with self._lock:
                self._changes.end_whole()


def quota_left(pools: NodePools, owner: Owner | None) -> int | None:
    """Bytes ``owner``'s tenant (no tenant: the pools without one) may still add to
    ``pools``: its quota (their bound) less its pools and those being made, at least 0;
    None where no quota or bound applies."""
    tenant = owner.tenant if owner is not None else None
    if not (quota := pools.limits.get(tenant)):
        return None
    return max(0, quota - pools.used(tenant))
