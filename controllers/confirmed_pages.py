"""Pages the store confirmed present, remembered for less than Mooncake's lease (pure).

Mooncake's master grants a lease (``default_kv_lease_ttl``, 10 s in Mooncake 0.3.13) to
every object that ``batch_is_exist`` reports present, and neither eviction nor a
non-forced remove takes an object whose lease has not expired. So an object confirmed
at time ``t`` is still in the store until at least ``t + lease``, and a group query
asked again within ``ttl_s < lease`` need not ask the store about it again. What can
still take a confirmed object is outside that contract: a forced remove, a store
segment unmounted (its node left) or the master restarting; the node actor calls
``forget`` on each of those it sees, and ``ttl_s`` bounds the rest.

Granularity: one entry per (page hash, key). A key names a set of objects per page: a
family (one family ``prefix + hash + suffix`` for a fixed tuple of suffixes: one rank's
or the replicated copy's objects of one pool), or a whole group (every family),
so a page whose every object was confirmed is found with one table read. A group key is a
*cover* (``cover(family keys)``): its entry also stands for each of its families, so a
page confirmed whole needs that one entry, and a query over another set of pools still
finds the families they share. Entries are indexed by page hash first, so one read per
page finds every key of it, and a page never confirmed costs one failed read per
generation whatever the number of keys. An entry holds the time until which it can be
trusted; a cover entry takes the earliest of its families', so no entry outlives the
confirmation it came from. Memory is bounded by
time, not by a scan: entries go into the current generation; every ``ttl_s`` the
current generation becomes the previous one and the previous one is dropped, so
nothing older than ``2 x ttl_s`` is held.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence

FamilyKey = Hashable


def cover(keys: Sequence[FamilyKey]) -> frozenset:
    """The key of a set of families: an entry under it confirms each of ``keys``. (A
    frozenset keeps its hash, so a cover key costs no more to look up than a string.)"""
    return frozenset(keys)


def _covered(entry: dict[FamilyKey, float], key: FamilyKey) -> float:
    """Until when a cover in ``entry`` (one page's) confirms ``key``; 0 if none does."""
    return max((v for k, v in entry.items() if type(k) is frozenset and key in k),
               default=0.0)


class ConfirmedPages:
    """See the module docstring. ``ttl_s <= 0`` disables it (nothing is remembered).
    Thread-safe without a lock on the hot path: reads and inserts are single dict
    operations (two racing first inserts for one page may keep only one of them: a
    confirmation is lost, nothing false is recorded); a generation turn is taken under
    a lock."""

    def __init__(self, ttl_s: float, clock=time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._current: dict[str, dict[FamilyKey, float]] = {}
        self._previous: dict[str, dict[FamilyKey, float]] = {}
        self._turned = clock()

    @property
    def enabled(self) -> bool:
        return self.ttl_s > 0

    def _turn(self, now: float) -> None:
        if now - self._turned >= self.ttl_s:
            with self._lock:
                if now - self._turned >= self.ttl_s:
                    self._previous, self._current = self._current, {}
                    self._turned = now

    def until(self, keys: Sequence[FamilyKey], hashes: Sequence[str],
              now: float) -> list[list[float]]:
        """``out[k][p]``: until when (monotonic seconds) the objects of ``keys[k]`` for
        page ``hashes[p]`` are confirmed, directly or by a cover; 0 where never (or
        turned out). Compare with ``now``."""
        if not self.enabled:
            return [[0.0] * len(hashes) for _ in keys]
        self._turn(now)
        rows = [[0.0] * len(hashes) for _ in keys]
        for gen in (self._current, self._previous):
            entries = [gen.get(h) for h in hashes] if gen else []
            if entries.count(None) == len(entries):
                continue
            for k, key in enumerate(keys):
                rows[k] = [t or ((e.get(key) or _covered(e, key)) if e is not None else 0.0)
                           for t, e in zip(rows[k], entries, strict=True)]
        return rows

    def confirm(self, key: FamilyKey, hashes: Sequence[str], since: float) -> None:
        """Record that every object of ``key`` for ``hashes`` was reported present by a
        existence check that started at ``since`` (the lease began no earlier)."""
        self.record(key, hashes, [since + self.ttl_s] * len(hashes))

    def record(self, key: FamilyKey, hashes: Sequence[str], until: Sequence[float]) -> None:
        """Record per page of ``hashes`` the time ``until`` which ``key``'s objects are
        confirmed (each taken from confirmations made by ``confirm``)."""
        if not self.enabled:
            return
        cur = self._current
        for h, t in zip(hashes, until, strict=True):
            entry = cur.get(h)
            if entry is None:  # a racing insert may be lost: a confirmation, never a miss
                cur[h] = {key: t}
            else:
                entry[key] = t

    def forget(self) -> None:
        """Drop every confirmation (objects may have left the store)."""
        with self._lock:
            self._current, self._previous = {}, {}

    def __len__(self) -> int:
        """Entries held (both generations; expired ones included until they turn)."""
        return sum(len(e) for g in (self._current, self._previous) for e in g.values())
