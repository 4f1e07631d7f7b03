"""The keys a node's L2 evicted lately, and when (pure: no Ray, no Mooncake).

``raykv why`` tells "evicted from this node's L2" from "never saved" by this record:
each key an L2 pool's eviction took (``L2Index`` tells its ``on_change(key, False)``,
``l2_pools.told`` records it here) with the wall-clock time (``time.time()`` seconds)
it left. It keeps the ``capacity`` most recent evictions (a bounded LRU: a key evicted
again moves to the newest end; the oldest are forgotten), so "no record" means "not
evicted lately", not "never evicted". Keys only, no bytes. A pool dropped as a whole
(its engine left) is no eviction and is not recorded.

Threads: any; ``_lock`` guards the entries, and ``record`` runs under ``L2Pools``' lock
(so it only touches a dict).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from raykv.controllers.node_records import L2EvictionStats

EVICTIONS_KEPT = 100_000
"""Evicted keys a node remembers (about 15 MB of keys)."""


class L2Evictions:
    """The ``capacity`` most recent L2 evictions of one node; ``count``: every eviction
    recorded since start (what ``raykv status`` shows)."""

    def __init__(self, capacity: int = EVICTIONS_KEPT) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._keys: OrderedDict[str, float] = OrderedDict()  # oldest first
        self.count = 0

    def record(self, key: str, now: float) -> None:
        """``key`` was evicted at ``now`` (wall-clock seconds)."""
        with self._lock:
            self._keys.pop(key, None)
            self._keys[key] = now
            self.count += 1
            if len(self._keys) > self._capacity:
                self._keys.popitem(last=False)

    def of(self, keys: Sequence[str]) -> dict[str, float]:
        """When each of ``keys`` this record holds was last evicted."""
        with self._lock:
            return {k: t for k in keys if (t := self._keys.get(k)) is not None}

    def stats(self) -> L2EvictionStats:
        """``evictions`` recorded since start, ``kept`` now."""
        with self._lock:
            return L2EvictionStats(evictions=self.count, kept=len(self._keys))
