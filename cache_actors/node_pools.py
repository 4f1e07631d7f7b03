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
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

from raykv.cache_actors.engine_memory import map_engine_pool
from raykv.cache_actors.errors import StalePoolsError
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node_store import NodeStore
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.shared_memory import SHM_DIR, shm_path
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout, check_pool_name

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolTable:
    """One generation of a node's pools (read-only; see the module docstring)."""

    epoch: int
    pools: Mapping[str, HostPool] = field(default_factory=lambda: MappingProxyType({}))

    def replaced(self, name: str, pool: HostPool | None) -> PoolTable:
        """A table of the same epoch with ``pool`` as ``name`` (None: without ``name``)."""
        pools = {n: p for n, p in self.pools.items() if n != name}
        if pool is not None:
            pools[name] = pool
        return PoolTable(self.epoch, MappingProxyType(pools))

    def pointers(self, batch: ObjectBatch) -> list[int]:
        """Pointers in this process for every object of ``batch``. ``StalePoolsError``
        if the batch's offsets were taken from another generation's handles,
        ``ValueError`` for a bad batch or an object outside its pool."""
        if batch.epoch != self.epoch:
            raise StalePoolsError(
                f"this node's pools were allocated anew (epoch {batch.epoch} -> "
                f"{self.epoch}); L2 contents were lost: re-map and retry")
        batch.check()
        pools = {}
        for name in set(batch.pools):
            pool = self.pools.get(name)
            if pool is None:
                raise ValueError(f"the batch names pool {name!r}, which this node does not "
                                 "have")
            pool.check()  # an engine's memfd that shrank: refused, never a SIGBUS
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


class NodePools:
    """Creates, re-adopts, re-allocates and removes the pools of one node, registers
    each with the node's Mooncake client, keeps a ``<prefix><name>.json`` file per pool
    (what a restarted actor re-adopts) and tells ``sized(name, nbytes)`` each pool's size.

    Concurrency: ``table`` may be read by any thread without a lock (one snapshot per
    read). ``_lock`` serialises every change (create, destroy, reallocate, close) and
    ``settled``, so control reads never see the empty table of a re-allocation under way.
    """

    def __init__(self, prefix: str, store: NodeStore,
                 sized: Callable[[str, int], None]) -> None:
        self._prefix = prefix
        self._store = store
        self._sized = sized
        self._lock = threading.Lock()
        self.table = PoolTable(store.memory.epoch)
        self._engines: dict[str, ProcessIdentity] = {}  # pools of one engine process
        self._exited: dict[str, float] = {}  # engine pool -> when its process was seen gone

    def _meta_path(self, name: str) -> str:
        return shm_path(self._prefix + name + ".json")

    def _register(self, pool: HostPool) -> HostPool:
        """Register ``pool`` with Mooncake; on failure give its memory back."""
        try:
            self._store.backend.register(pool.base_ptr, pool.nbytes)
        except Exception:
            self._store.memory.release(pool)
            raise
        self._sized(pool.name, pool.nbytes)
        return pool

    def settled(self) -> PoolTable:
        """The table once no change is under way (waits for one that is)."""
        with self._lock:
            return self.table

    def readopt(self) -> None:
        """At start: map and register again the pools this node had before a restart."""
        pattern = os.path.join(SHM_DIR, glob.escape(self._prefix) + "*.json")
        with self._lock:
            for meta in sorted(glob.glob(pattern)):
                with open(meta) as f:
                    raw = json.load(f)
                handle = PoolHandle(raw["name"], raw["path"], PoolLayout(**raw["layout"]))
                try:
                    pool = self._register(self._store.memory.readopt(handle))
                except (FileNotFoundError, ValueError) as e:
                    log.warning("pool %s could not be re-adopted: %s", handle.name, e)
                    continue
                self.table = self.table.replaced(pool.name, pool)

    def create(self, name: str, layout: PoolLayout,
               owner: ProcessIdentity | None = None) -> PoolHandle:
        """Pool ``name`` (made now unless it exists with the same layout). ``ValueError``
        for another layout, a bad name, a pool over the budget or one the shared memory
        cannot hold (nothing allocated), ``StoreUnavailableError`` while
        ``mooncake_client`` is down (standalone). ``owner``: the one process the new pool
        serves (an engine's staging pool); ``reap_engines`` removes the pool once that
        process exited, if this machine shows it now (else it is kept: a process of
        another pid namespace or machine cannot be watched). Pools without an owner (L2
        shared by many ranks) outlive every rank."""
        check_pool_name(name)
        with self._lock:
            existing = self.table.pools.get(name)
            if existing is not None:
                if existing.handle.layout != layout:
                    raise ValueError(f"pool {name!r} exists on this node with another "
                                     f"layout: {existing.handle.layout} (asked for {layout})")
                return existing.handle
            self._store.check()
            pool = self._register(self._store.memory.create(name, layout))
            self.table = self.table.replaced(name, pool)
            if owner is not None and owner.alive():
                self._engines[name] = owner
            with open(self._meta_path(name), "w") as f:
                json.dump({"name": name, "path": pool.handle.path,
                           "layout": asdict(layout)}, f)
            os.chmod(self._meta_path(name), 0o600)
            return pool.handle

    def adopt_engine(self, name: str, path: str, layout: PoolLayout,
                     inode: Sequence[int]) -> PoolHandle:
        """An engine's own memfd ``path`` served as pool ``name`` with no copy
        (``engine_memory.map_engine_pool`` checks it, ``inode`` = the engine's
        ``(st_dev, st_ino)`` of it); the same handle again if it is already served. No
        metadata file: a restarted actor does not re-adopt it (the engine registers it
        again). ``ValueError`` for anything that is not such a memfd, a name taken by
        another pool, or a pool over the budget."""
        with self._lock:
            known = self.table.pools.get(name)
            if known is not None:
                if known.handle == PoolHandle(name, path, layout):
                    return known.handle
                raise ValueError(f"pool {name!r} exists on this node as another pool")
            budget = self._store.memory.budget
            budget.reserve(name, layout.nbytes)  # released with the pool
            try:
                pool, process = map_engine_pool(name, path, layout, self._store.mode,
                                                tuple(inode))
            except BaseException:
                budget.release(layout.nbytes)
                raise
            pool = self._register(pool)
            self.table = self.table.replaced(name, pool)
            self._engines[name] = process
            return pool.handle

    def reap_engines(self, grace_s: float) -> list[str]:
        """Destroy the pools of one engine process (adopted memfds, and pools created
        with an ``owner``: SGLang staging pools, vLLM pools) whose process exited at
        least ``grace_s`` seconds ago (seen gone by an earlier call that long before: a
        store call the engine started before it died may still be moving its pages, and
        the pool's memory must stay mapped until it ends). An engine that dies without
        closing its backend would otherwise keep its host pools alive in this node.
        Returns the names."""
        now = time.monotonic()
        with self._lock:
            for name, process in self._engines.items():
                if not process.alive():
                    self._exited.setdefault(name, now)
            due = [n for n, t in self._exited.items() if now - t >= grace_s]
        for name in due:
            log.warning("pool %s: the engine process it served exited; the pool is removed",
                        name)
            self.destroy(name)
        return due

    def handle(self, name: str, node: str) -> PoolHandle:
        """The handle of pool ``name``; ``ValueError`` naming ``node`` if there is none."""
        pools = self.settled().pools
        if name not in pools:
            raise ValueError(f"no pool named {name!r} on node {node}; pools here: "
                             f"{sorted(pools)}")
        return pools[name].handle

    def destroy(self, name: str) -> bool:
        """Unregister and remove pool ``name``; False if there was none."""
        with self._lock:
            pool = self.table.pools.get(name)
            if pool is None:
                return False
            self.table = self.table.replaced(name, None)
            self._engines.pop(name, None)
            self._exited.pop(name, None)
            self._store.backend.unregister(pool.base_ptr)
            self._store.memory.release(pool)
            with contextlib.suppress(FileNotFoundError):  # engine pools have none
                os.unlink(self._meta_path(name))
        self._sized(name, 0)
        return True

    def reallocate(self) -> None:
        """Standalone, after ``mooncake_client`` restarted: every pool anew, same names and
        layouts, in a new epoch (the new process does not know the old buffers). A pool
        that cannot be allocated again is logged and comes back when the actor restarts."""
        with self._lock:
            old = self.table
            memory = self._store.memory
            memory.renew()
            self.table = PoolTable(memory.epoch)  # every old handle is stale from here on
            fresh = {}
            for name, pool in old.pools.items():
                memory.release(pool)
                try:
                    fresh[name] = self._register(memory.create(name, pool.handle.layout))
                except Exception:
                    log.exception("pool %s could not be allocated again; it is back when "
                                  "the actor restarts", name)
            self.table = PoolTable(memory.epoch, MappingProxyType(fresh))

    def close(self, remove: bool) -> None:
        """Unregister and unmap every pool (the actor stops for good); with ``remove``
        also delete their shared-memory and metadata files."""
        with self._lock:
            old, self.table = self.table, PoolTable(self.table.epoch)
            self._engines.clear()
            self._exited.clear()
            for name, pool in old.pools.items():
                self._store.backend.unregister(pool.base_ptr)
                self._store.memory.release(pool, remove=remove)
                if remove and os.path.exists(self._meta_path(name)):
                    os.unlink(self._meta_path(name))
