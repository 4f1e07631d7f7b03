"""A node's L2 cache: shared host pools the node actor keeps as a cache of objects, one
per deployment and rank (one vLLM block of that TP rank per page), shared by every
engine of the deployment on the node.

``L2Pools`` is the node actor's side: it makes the pools (``open``, within the node's
``l2_bytes`` and, as any pool, ``host_pool_bytes``; shrunk to what is left of the
tenant's quota, refused below one page), keeps one
``L2Index`` per pool (``cache_actors.node.l2_index``: keys, LRU, holds, leases, dirty
pages) under one lock, answers the four L2 data ops (``lookup``, ``acquire``,
``reserve``, ``commit``: ``DataOp``), reads objects from L3 into pages (``acquire``
with ``fill``) and puts committed pages to L3 behind the writer's back (write-behind:
``cache_actors.node.write_behind``, on one thread of its own, failed puts retried). The
ranks copy between their engine's memory and the pages they were given; the node never
copies a byte, and Mooncake moves pages with no copy.

Rules (the failure model's, for L2):

- A page a rank was given is its own until the rank's next L2 op on that pool (or its
  process exits): ``release`` first, on every ``acquire`` and ``reserve``. A rank that
  gave up on a call (deadline) never touches the pages it named; a page being written
  becomes ready only by its writer's ``commit``, so bytes a writer may not have written
  in full are never read. An op changes the index only before its caller's deadline
  (checked under the lock: ``in_time``), so an op the rank gave up on never releases,
  reserves or commits after the rank's next op (which would free pages that op is
  copying, or publish a page it is writing); a fill whose store call ends past the
  reader's deadline makes its pages ready but holds none of them for the reader (which
  would pin them, unknown to it, past its next op).
- An L3 read into L2 (fill) writes pages reserved by the node itself, never by the rank
  that asked: a rank that gave up on it frees nothing the store call still writes.
- Failures are per object: a key without a page (L2 full of held, leased or dirty pages)
  is ``FULL``; a key L3 does not hold is not filled; a failed write-behind put is
  retried (a bounded number of times, its page kept in L2 meanwhile); one that failed
  every time leaves the page in L2 (right bytes, evictable) and is counted
  (``l3_put_failed``) and logged: a hole in L3's chain, which costs hits, never bytes.
- A restarted node actor starts with every L2 pool empty: its pools get a name of this
  incarnation, and ``open`` removes the caller's pools of earlier incarnations (ranks
  that still map one keep their mapping; nobody is given its pages again). The same
  when the node's pool memory is allocated anew (``reset``). A pool name is never used
  for two pools: a pool removed (``destroy_pool``, then ``forget``) and opened again is
  new memory under a new name, so an op or a write-behind put naming the old pool fails
  and never touches the new memory.

Holders are what ranks say they are (a thread's ``(thread id, start ticks)``, checked to
be two ints naming no holder of the node's own: ``check_holder``): a rank may only name
pools of its own owner, so a rank that lies harms its own deployment alone.

Threads: the data ops run on the caller's thread (channel connection, Ray data group);
``open`` on a pool thread; the write-behind on ``raykv-l2-flush`` (``WriteBehind``).
``_lock`` guards the indexes and the pool table of L2 (and the write-behind's
counters); store calls run outside it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from raykv.cache_actors.errors import DeadlineExceededError, UnknownPoolError
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.node.l2_evictions import L2Evictions
from raykv.cache_actors.node.l2_index import Holder, L2Index, check_holder
from raykv.cache_actors.node.node_pools import quota_left
from raykv.cache_actors.node.residency_log import ResidencyLog
from raykv.cache_actors.node.touch_journal import TouchJournal
from raykv.cache_actors.node.write_behind import ATTEMPTS, PUT_WAIT_S, WriteBehind
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.tickets import check_deadline
from raykv.controllers.node_records import L2Stats
from raykv.controllers.node_settings import DEFAULTS
from raykv.controllers.object_batch import ObjectBatch, check_object_keys
from raykv.controllers.ownership import TENANT_KEYS, Owner, OwnerClaim
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.result_codes import FULL

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_pools import NodePools
    from raykv.cache_actors.node.store_mover import StoreMover

log = logging.getLogger(__name__)

LEASE_S = 10.0
"""How long a scheduler's ``lookup`` keeps the pages it found from eviction, in seconds:
longer than a request usually waits between its lookup and its load (the same or the
next scheduler step), short enough that pages of requests never loaded come back soon.
Every lookup of a waiting request renews it; one that ran out costs a miss (L3 or
recompute), never wrong bytes."""
FILL_WAIT_S = PUT_WAIT_S
"""Deadline of an L3 read into L2 whose caller gave none, in seconds."""

Move = Callable[[str, ObjectBatch, float, OwnerClaim | None], list[int]]
"""``move(op, batch, deadline, caller)`` (``StoreMover.move``): the node's ``put`` or
``get`` of a batch (the caller already verified), one code per object."""


@dataclass
class _L2Pool:
    handle: PoolHandle
    owner: Owner | None
    index: L2Index

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def layout(self) -> PoolLayout:
        return self.handle.layout

    @property
    def epoch(self) -> int:
        return self.handle.epoch

    def offsets(self, pages: Sequence[int]) -> list[int]:
        return self.layout.object_offsets([p * self.layout.page_size for p in pages])


class L2Pools:
    """The L2 pools of one node (see the module docstring): made and removed among the
    node's ``pools`` as any pool (quotas, budget), their store calls and callers' claims
    through the node's ``mover`` (``StoreMover``: a fill's get, the write-behind's put,
    a claim checked); ``l2_bytes``: the most bytes of this node's L2 pools together (0:
    no L2); ``eviction``: their ``NodeSettings.l2_eviction``; ``flush_attempts``: puts per
    object of the write-behind at most (1: no retry); ``log`` / ``touches``: the node's
    residency log, told each key that becomes or stops being ready, and touch journal,
    told each page an acquire serves (None: its own; ``raykv why`` reads it and
    ``evictions``, its pools' ``L2Evictions``)."""

    def __init__(self, pools: NodePools, mover: StoreMover, *, l2_bytes: int,
                 eviction: str = DEFAULTS.l2_eviction, lease_s: float = LEASE_S,
                 flush_attempts: int = ATTEMPTS, clock: Callable[[], float] = time.monotonic,
                 log: ResidencyLog | None = None, touches: TouchJournal | None = None) -> None:
        self._node_pools, self._mover = pools, mover
        self.l2_bytes, self._log = l2_bytes, log or ResidencyLog()
        self._index = partial(L2Index, lease_s=lease_s, clock=clock, eviction=eviction)
        self.evictions, self.touches = L2Evictions(), touches or TouchJournal()
        self._incarnation = uuid.uuid4().hex[:8]
        self._made = itertools.count(1)  # serial of the pools made (under _open_lock)
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # one open at a time (pool creation is slow)
        self._pools: dict[str, _L2Pool] = {}
        self._fills = itertools.count(1)  # serial of the node's own fill holders
        self.counts = dict.fromkeys(("filled", "fill_failed", "warmed", "warm_failed"), 0)
        self.write_behind = WriteBehind(partial(put_pages, mover.move), flushed_pages,
                                        self._served,
                                        self._lock, attempts=flush_attempts)

    # ---------------------------------------------------------------- control
    def open(self, rank: tuple[int, int], layout: PoolLayout, pages: int,
             claim: OwnerClaim | None, share: int = 1) -> PoolHandle | None:
        """The L2 pool of ``claim``'s deployment and ``rank`` (tp, pp) on this node, of
        ``layout``'s page geometry: the existing one (another engine made it), else a
        new one of at most ``pages`` pages, as many as fit in what is left of
        ``l2_bytes`` (None if not one page), in a ``share``-th of it (one per rank of
        the group) and in the tenant's quota. ``ValueError`` for a caller without an
        owner claim, a layout with more than one object per page, a bad ``share``,
        another layout than the existing pool's, or what pool creation refuses (tenant
        quota with less than one page left, budget)."""
        claim = self._mover.verify(claim)
        if claim is None:
            raise ValueError("an L2 pool belongs to a deployment: open it with an owner claim")
        if layout.objects_per_page != 1 or pages < 1 or type(share) is not int or share < 1:
            raise ValueError(f"an L2 pool holds one object per page, at least one page, in a "
                             f"share >= 1 of the node (got {layout.objects_per_page} objects, "
                             f"{pages} pages, share {share!r})")
        family = l2_family(claim.deployment_id, rank)
        with self._open_lock:
            with self._lock:
                pool = next((p for n, p in self._pools.items() if n.startswith(family)),
                            None)
            if pool is not None:
                if pool.layout.buffers != layout.buffers or\
                        pool.layout.page_size != layout.page_size:
                    raise ValueError(f"L2 pool {pool.name} holds pages of "
                                     f"{pool.layout.buffers}, not {layout.buffers}")
                return pool.handle
            for old in list(self._node_pools.table.pools):  # an earlier incarnation's: gone
                if old.startswith(family):
                    self._node_pools.destroy(old, claim.owner)
            # a name never given before, even to a pool of this family removed since
            name = f"{family}{self._incarnation}-{next(self._made)}"
            page_bytes = layout.object_bytes
            with self._lock:
                used = sum(p.layout.nbytes for p in self._pools.values())
            fits = min(pages, min(self.l2_bytes - used, self.l2_bytes // share) // page_bytes)
            if fits < 1:
                return None
            left = quota_left(self._node_pools, claim.owner)
            if left is not None:  # the tenant's quota (under one page: create refuses)
                fits = max(1, min(fits, left // page_bytes))
            sized = PoolLayout(layout.kind, layout.page_size, fits * layout.page_size,
                               layout.buffers, layout.order)
            handle = self._node_pools.create(name, sized, None, claim.owner)
            index = self._index(fits, on_change=told(self._log, claim.owner, self.evictions))
            with self._lock:
                self._pools[name] = _L2Pool(handle, claim.owner, index)
            log.info("L2 pool %s: %d pages of %d bytes", name, fits, page_bytes)
            return handle

    def reset(self) -> None:
        """The node's pool memory is about to be allocated anew (standalone: its client
        restarted): every L2 pool is forgotten, the next ones are of a new incarnation,
        so no rank is given a page of memory it does not map (ops on old pools fail)."""
        with self._lock:
            for pool in self._pools.values():
                dropped(self._log, pool)
            self._pools.clear()
            self._incarnation = uuid.uuid4().hex[:8]

    def forget(self, name: str) -> None:
        """Pool ``name`` left the node: it is no L2 pool any more."""
        with self._lock:
            if (pool := self._pools.pop(name, None)) is not None:
                dropped(self._log, pool)

    # ------------------------------------------------------------------- data
    def lookup(self, keys: list[str], per_page: int, claim: OwnerClaim | None = None, *,
               verified: bool = False) -> int:
        """How many leading pages of ``keys`` (``per_page`` consecutive keys each: one
        per TP rank) every key is ready in an L2 pool of the caller's owner; their
        pages are leased for ``LEASE_S``. ``ValueError`` for bad keys or keys outside
        the caller's key prefix."""
        owner = self._checked(keys, claim, verified)
        if per_page < 1 or len(keys) % per_page:
            raise ValueError(f"{len(keys)} keys are no whole number of pages of {per_page}")
        with self._lock:
            indexes = [p.index for p in self._pools.values() if p.owner == owner]
            n = 0
            for i in range(0, len(keys), per_page):
                if not all(any(x.lease(k) for x in indexes) for k in keys[i:i + per_page]):
                    break
                n += 1
        return n

    def resident(self, keys: Sequence[str], owner: Owner | None) -> list[bool]:
        """Per key, whether it is ready in an L2 pool of ``owner``; nothing leased or
        touched (a router's look; the caller checked the keys against its claim)."""
        with self._lock:
            indexes = [p.index for p in self._pools.values() if p.owner == owner]
            return [any(x.page_of(k) is not None for x in indexes) for k in keys]

    def ready_keys(self, owner: Owner | None, prefix: str, limit: int) -> tuple[list[str], int]:
        """The keys starting with ``prefix`` ready in ``owner``'s L2 pools (most
        recently used first in each pool, at most ``limit``) and the number of the last
        change of the residency log they include: read together, under the lock the
        log's L2 changes are recorded under."""
        with self._lock:
            keys: list[str] = []
            for p in self._pools.values():
                if p.owner == owner:
                    keys += [k for k in p.index.ready_keys(limit - len(keys))
                             if k.startswith(prefix)]
            return keys, self._log.last

    def acquire(self, holder: Holder, pool: str, keys: list[str], fill: bool,
                claim: OwnerClaim | None = None, *, deadline: float | None = None,
                verified: bool = False) -> list[int]:
        """Pages of the leading ``keys`` for ``holder`` to read, held until its next op
        on ``pool`` (its earlier pages released first); with ``fill``, keys L2 does not
        hold after the leading ready ones are read from L3 into pages first (within
        ``deadline``, ``time.monotonic()`` seconds). Stops at the first key it has no
        page for. ``ValueError`` for a holder that names no thread (``check_holder``);
        ``DeadlineExceededError`` past ``deadline``, nothing changed (``in_time``)."""
        holder = check_holder(holder)
        entry = self._entry(pool, keys, claim, verified)
        with self._lock:
            in_time(deadline)
            entry.index.release(holder)
            pages = entry.index.acquire(holder, keys)
        self.touches.served(keys[:len(pages)], entry.layout.object_bytes)
        if not fill or len(pages) == len(keys):
            return pages
        return pages + self._fill(entry, holder, keys[len(pages):], claim, deadline)[0]

    def warm(self, pool: str, keys: list[str], claim: OwnerClaim | None,
             deadline: float) -> tuple[int, int, int]:
        """A warm-up's ``_fill`` of the ``keys`` pool ``pool`` lacks (``claim``: its
        opener's claim; ``cache_actors.node.l2_warmup``): (pages read, leading ``keys``
        the pool holds now, its free pages left); (0, 0, 0) for a pool gone."""
        with self._lock:
            entry = self._pools.get(pool)
            missing = [k for k in keys if entry and entry.index.page_of(k) is None]
        made = self._fill(entry, None, missing, claim, deadline)[1] if missing else 0
        with self._lock:
            held = [bool(entry and entry.index.page_of(k) is not None) for k in keys]
            return made, (held + [False]).index(False), entry.index.free if entry else 0

    def reserve(self, holder: Holder, pool: str, keys: list[str],
                claim: OwnerClaim | None = None, *, deadline: float | None = None,
                verified: bool = False) -> list[int]:
        """Per key a page for ``holder`` to write (its earlier pages released first),
        ``PRESENT``, ``WRITING`` or ``FULL`` (``L2Index.reserve``); holders whose process
        is gone are released when pages run short. Past ``deadline``: as ``acquire``."""
        holder = check_holder(holder)
        entry = self._entry(pool, keys, claim, verified)
        with self._lock:
            in_time(deadline)
            entry.index.release(holder)
            pages = entry.index.reserve(holder, keys)
            if FULL in pages and reap_gone(entry.index):
                short = [k for k, p in zip(keys, pages, strict=True) if p == FULL]
                again = iter(entry.index.reserve(holder, short))
                pages = [next(again) if p == FULL else p for p in pages]
        return pages

    def commit(self, holder: Holder, pool: str, keys: list[str], pages: list[int],
               ok: list[bool], claim: OwnerClaim | None = None, *,
               deadline: float | None = None, verified: bool = False) -> int:
        """``holder`` wrote ``keys`` into ``pages`` (``ok``: in full): those become
        ready and are queued for the write-behind put to L3; the others free. Returns
        how many became ready. Past ``deadline``: as ``acquire``."""
        holder = check_holder(holder)
        entry = self._entry(pool, keys, claim, verified)
        if len(pages) != len(keys) or len(ok) != len(keys):
            raise ValueError(f"a commit of {len(keys)} keys names {len(pages)} pages and "
                             f"{len(ok)} outcomes")
        with self._lock:
            in_time(deadline)
            owned = [p for p, k in zip(pages, keys, strict=True)
                     if type(p) is int and 0 <= p < entry.index.pages
                     and entry.index.key_of(p) == k]
            if len(owned) != len(pages):
                raise ValueError("a commit names pages that do not hold its keys")
            made = entry.index.commit(holder, pages, ok, dirty=True)
            if made:  # under the lock that guards the write-behind's counters
                by_page = dict(zip(pages, keys, strict=True))
                self.write_behind.submit((entry, claim), [by_page[p] for p in made], made)
        return len(made)

    # ----------------------------------------------------------------- status
    def stats(self) -> L2Stats:
        """Per L2 pool its ``L2Index.stats``; the node's fills (``filled``,
        ``fill_failed``; the warm-up's ``warmed``, ``warm_failed``: objects) and its
        write-behind's counts in objects (``WriteBehind.named_counts``); ``l2_bytes``
        and ``used``."""
        counts, _ = self.counters()
        with self._lock:
            pools = {n: p.index.stats() for n, p in self._pools.items()}
            used = sum(p.layout.nbytes for p in self._pools.values())
        return L2Stats(l2_bytes=self.l2_bytes, used=used, pools=pools, **counts)

    def counters(self) -> tuple[dict[str, int], dict[str, tuple[Owner, dict[str, int]]]]:
        """The node's counts of ``stats`` and, per L2 pool, its owner and its index's
        ``counts`` (each but ``l3_put_pending`` only grows while its pool lives); no page
        is looked at (the Ray metrics' exporter reads them: ``NodeMetrics.watch_l2``)."""
        with self._lock:
            counts = dict(self.counts) | self.write_behind.named_counts()
            return counts, {n: (p.owner, dict(p.index.counts)) for n, p in self._pools.items()}

    def close(self) -> None:
        """End the write-behind thread (retries not yet due are dropped)."""
        self.write_behind.close()

    # ---------------------------------------------------------------- helpers
    def _checked(self, keys: list[str], claim: OwnerClaim | None,
                 verified: bool) -> Owner | None:
        keys = check_object_keys(keys)
        claim = claim if verified else self._mover.verify(claim)
        prefix = claim.key_prefix if claim is not None else ""
        if prefix and not all(k.startswith(prefix) for k in keys):
            raise ValueError("L2 keys outside the caller's key prefix")
        if not prefix and any(k.startswith(TENANT_KEYS) for k in keys):
            raise ValueError("a tenant's L2 keys need the tenant's claim")
        return None if claim is None else claim.owner

    def _entry(self, pool: str, keys: list[str], claim: OwnerClaim | None,
               verified: bool) -> _L2Pool:
        owner = self._checked(keys, claim, verified)
        with self._lock:
            entry = self._pools.get(pool)
        if entry is None or entry.owner != owner:
            raise UnknownPoolError(f"{pool!r} is no L2 pool of the caller's on this node "
                                   "(the node actor may have restarted: open L2 again)")
        return entry

    def _fill(self, entry: _L2Pool, reader: Holder | None, keys: list[str],
              claim: OwnerClaim | None, deadline: float | None) -> tuple[list[int], int]:
        """Read the leading ``keys`` from L3 into pages the node reserves under a
        holder of its own (``reader`` None, a warm-up: free pages only, none evicted);
        those read in full become ready (clean), held by ``reader``. (The pages of the
        leading run read, how many were read.) A store call that ended past ``deadline``
        (the reader gave up, and may have made its next op) holds nothing for the
        reader: its pages become ready unheld, and ``DeadlineExceededError``."""
        with self._lock:
            filler = (-1, next(self._fills))
            pages = entry.index.reserve(filler, keys, evict=reader is not None)
        run = next((i for i, p in enumerate(pages) if p < 0), len(pages))
        if run < len(pages):  # only a leading run is any use to the reader
            with self._lock:
                entry.index.commit(filler, pages[run:], [False] * (len(pages) - run),
                                   dirty=False)
        pages, keys = pages[:run], keys[:run]
        ok = read_pages(self._mover.move, entry, keys, pages, deadline, claim) if run else []
        good = (ok + [False]).index(False)
        if reader is None:  # a warm-up keeps the leading pages read: the others are no use
            ok = [i < good for i in range(run)]
        kind, failed = ("filled", "fill_failed") if reader else ("warmed", "warm_failed")
        with self._lock:  # past the reader's deadline: ready, but held by nobody
            late = reader is not None and deadline is not None and\
                time.monotonic() >= deadline
            made = entry.index.commit(filler, pages, ok, dirty=False,
                                      reader=None if late else reader)
            self.counts[kind] += len(made)
            self.counts[failed] += run - len(made)
        if late:
            raise DeadlineExceededError("an L2 fill ended after its reader's deadline: its "
                                        "pages are in L2, none is held for the reader")
        return pages[:good], len(made)

    def _served(self, target: tuple[_L2Pool, OwnerClaim | None]) -> bool:
        """Whether the pool is still one of this node's L2 pools (not forgotten/reset)."""
        with self._lock:
            return self._pools.get(target[0].name) is target[0]


def reap_gone(index: L2Index) -> bool:
    """Release the holders of ``index`` whose process is gone (under ``L2Pools``'
    lock); whether any was."""
    gone = [h for h in index.holders() if h[0] >= 0 and not ProcessIdentity(*h).alive()]
    for h in gone:
        index.release(h)
    return bool(gone)


def in_time(deadline: float | None) -> None:
    """``DeadlineExceededError`` if ``deadline`` (``time.monotonic()`` seconds of this
    host, which the rank shares; None: none) has passed: its caller stopped waiting, and
    may already have made its next op (under ``_lock``, before any change). ``ValueError``
    for a deadline that is no finite number or lies too far ahead (``check_deadline``:
    the Ray route checks no argument types)."""
    if deadline is not None and time.monotonic() >= check_deadline(deadline):
        raise DeadlineExceededError("an L2 op reached the pool after its caller's deadline; "
                                    "it changed nothing")


def read_pages(move: Move, entry: _L2Pool, keys: list[str], pages: list[int],
               deadline: float | None, claim: OwnerClaim | None) -> list[bool]:
    """A fill's store call (with the node's ``move``): ``keys`` read from L3 into
    ``pages`` of ``entry`` (``deadline`` None: ``FILL_WAIT_S``); per object whether it
    was read in full (a failed call: none was, the pages free again)."""
    try:
        codes = move("get", pages_batch(entry, keys, pages),
                     deadline or time.monotonic() + FILL_WAIT_S, claim)
    except Exception as e:
        log.debug("L2 fill of %d objects failed: %s", len(keys), e)
        return [False] * len(keys)
    return [c == entry.layout.object_bytes for c in codes]


def told(log: ResidencyLog, owner: Owner | None,
         evictions: L2Evictions) -> Callable[[str, bool], None]:
    """An index's ``on_change`` for a pool of ``owner``: into the residency ``log``, and
    a key that stopped being ready (the index tells only evictions so) into
    ``evictions``."""
    def change(key: str, ready: bool) -> None:
        log.record(owner, "l2", (key,), ready)
        if not ready:
            evictions.record(key, time.time())
    return change


def dropped(log: ResidencyLog, pool: _L2Pool) -> None:
    """``pool`` is no L2 pool any more (under ``L2Pools``' lock): its keys left L2."""
    log.record(pool.owner, "l2", pool.index.ready_keys(pool.index.pages), False)


def put_pages(move: Move, target: tuple[_L2Pool, OwnerClaim | None], keys: list[str],
              pages: list[int], deadline: float) -> list[bool]:
    """The write-behind's store call (``write_behind.Put``, with the node's ``move``):
    ``pages`` of the pool put to L3 for the committing caller; per object whether L3
    holds it."""
    entry, claim = target
    return [c in (0, 1) for c in move("put", pages_batch(entry, keys, pages), deadline,
                                      claim)]


def pages_batch(entry: _L2Pool, keys: list[str], pages: list[int]) -> ObjectBatch:
    """The store batch of ``pages`` of L2 pool ``entry`` holding ``keys``."""
    batch = ObjectBatch(epoch=entry.epoch)
    batch.extend(keys, entry.name, entry.offsets(pages), [entry.layout.object_bytes] * len(keys))
    return batch


def flushed_pages(target: tuple[_L2Pool, OwnerClaim | None], keys: list[str],
                  pages: list[int]) -> None:
    """The write-behind of ``pages`` ended (under ``L2Pools``' lock): they may be
    evicted."""
    target[0].index.flushed(pages, keys)


def l2_family(deployment_id: str, rank: tuple[int, int]) -> str:
    """The start of the names of a deployment's L2 pools of ``rank`` (tp, pp) on a node
    (the node actor's incarnation and the pool's serial follow)."""
    digest = hashlib.sha256(deployment_id.encode()).hexdigest()[:16]
    return f"l2-{digest}-{int(rank[0])}-{int(rank[1])}-"
