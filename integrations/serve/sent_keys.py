"""What the router sent where: the keys of the requests each replica was given lately
(pure: no Ray).

An engine keeps the blocks of the requests it ran in its own prefix cache until it
evicts them. The router cannot see that cache, but it knows what it sent there:
``RoutedKeys`` keeps, per replica, the ``capacity`` keys most recently routed to it
(least recently routed forgotten first; a key routed again is the newest), and
``pages(replica, keys)`` counts the leading pages of a request that were all routed to
that replica, the router's stand-in for the engine's own tier. It sees requests still
being computed too, so a request that shares a prefix with one in flight goes where
that prefix is being computed instead of computing it a second time elsewhere. It
overestimates by what the engine evicted before ``capacity`` keys were routed after it
(an engine that evicted a block loads it from the node's tiers or computes it: a stale
entry costs a hit, never bytes).

``RecentRoutes`` counts the requests each replica was sent among the last ``window``
routed: a request no tier tells replicas apart for (a new prefix) goes to the least
sent (``ranking.spread``), so the prefixes that later requests follow (a conversation,
a document) spread over the replicas instead of piling up where power of two choices
happened to send them.

Not thread-safe: one router's event loop calls them.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

SPREAD_WINDOW = 128
"""Routed requests over which the router counts what each replica was sent, for new
prefixes (``RecentRoutes``; here, not in the router, so pure code such as the simulator
reads the router's own figure)."""


class RoutedKeys:
    """Per replica (any hashable id), the last ``capacity`` keys routed there."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._by_replica: dict[object, OrderedDict[str, None]] = {}

    def routed(self, replica: object, keys: Sequence[str]) -> None:
        """``keys`` (a request's, in page order) were routed to ``replica``."""
        if not self.capacity or not keys:
            return
        held = self._by_replica.setdefault(replica, OrderedDict())
        for key in keys[-self.capacity:]:
            held[key] = None
            held.move_to_end(key)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def pages(self, replica: object, keys: Sequence[str], per_page: int) -> int:
        """Leading pages of ``keys`` (``per_page`` keys a page) whose every key was
        routed to ``replica`` and is still remembered."""
        held = self._by_replica.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n // per_page

    def keep_only(self, replicas: Iterable[object]) -> None:
        """Forget every replica not in ``replicas`` (gone from the deployment)."""
        keep = set(replicas)
        for replica in set(self._by_replica) - keep:
            del self._by_replica[replica]


class RecentRoutes:
    """How many of the last ``window`` routed requests each replica was sent."""

    def __init__(self, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._last: deque[object] = deque(maxlen=window)
        self._counts: Counter[object] = Counter()

    def routed(self, replica: object) -> None:
        """One request was routed to ``replica``."""
        if len(self._last) == self._last.maxlen:
            gone = self._last[0]
            self._counts[gone] -= 1
            if not self._counts[gone]:
                del self._counts[gone]
        self._last.append(replica)
        self._counts[replica] += 1

    def count(self, replica: object) -> int:
        """Requests among the last ``window`` routed to ``replica``."""
        return self._counts.get(replica, 0)

    def counts(self) -> dict[object, int]:
        """``count`` of every replica sent one of the last ``window`` requests."""
        return dict(self._counts)

    def keep_only(self, replicas: Iterable[object]) -> None:
        """Forget every replica not in ``replicas`` (gone from the deployment)."""
        keep = set(replicas)
        self._last = deque((r for r in self._last if r in keep), maxlen=self._last.maxlen)
        self._counts = Counter(self._last)
