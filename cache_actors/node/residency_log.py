"""A node's log of residency changes, read by routers to keep a view of the node
(pure: no Ray, no Mooncake).

Each change says that one object key of one owner came into or left one tier of this
node (``controllers.residency.Change``): ``l2`` when a page becomes ready (a commit) or
stops being ready (evicted, its pool dropped); ``segment`` when this node put the object
with its own segment preferred (leaving it is not seen: Mooncake evicts and expires
objects without telling, so a router keeps such keys in a bounded view of its own).
Changes are numbered from 1 in the order recorded; the log keeps the last ``capacity``.
A router asks for the changes after the last number it read (``since``); one that fell
behind (changes it has not read are no longer kept), that asks a number this log never
gave, or that asks another incarnation's log is told to start again: from the node's L2
as it is now, the segment puts the log still keeps (``kept``), and this log from the
current number on (``ResidencyQuery.changes``).

Bounds: one call looks at ``SCAN`` entries at most (``since`` answers where it stopped;
the router asks on from there), and looks at them off ``_lock``: under it, it only
copies them out. Anyone may ask (a caller without a claim too), so a query never holds
up ``record``, which an L2 commit calls under ``L2Pools``' lock.

Threads: any; ``_lock`` guards the entries and is never held while calling out. L2's
changes are recorded under ``L2Pools``' lock, so a snapshot of L2 taken under that lock
and ``last`` read under it agree.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable, Sequence
from itertools import islice

from raykv.controllers.ownership import Owner, OwnerClaim
from raykv.controllers.residency import MAX_CHANGES, Change

LOG_CHANGES = 65536
"""Changes a node keeps for routers (about 10 MB of keys): a router that polls every
0.1 s falls behind only past ~650 000 changes a second."""
SCAN = MAX_CHANGES
"""Entries one ``since`` or ``kept`` call looks at, at most."""


class ResidencyLog:
    """The last ``capacity`` residency changes of one node, for routers (see the module
    docstring). ``incarnation``: this log's name (new per node actor)."""

    def __init__(self, capacity: int = LOG_CHANGES) -> None:
        if capacity < 1:
            raise ValueError(f"a residency log keeps at least one change, got {capacity}")
        self.incarnation = uuid.uuid4().hex[:12]
        self._lock = threading.Lock()
        self._entries: deque[tuple[Owner | None, str, str, bool]] = deque(maxlen=capacity)
        self._last = 0  # number of the last change recorded

    @property
    def last(self) -> int:
        """The number of the last change recorded (0: none yet)."""
        with self._lock:
            return self._last

    def record(self, owner: Owner | None, tier: str, keys: Iterable[str], held: bool) -> None:
        """``keys`` of ``owner`` came into (``held``) or left ``tier``."""
        with self._lock:
            for k in keys:
                self._entries.append((owner, tier, k, held))
                self._last += 1

    def stored(self, keys: Sequence[str], codes: Sequence[int], claim: OwnerClaim | None
               ) -> None:
        """A put of ``claim`` with this node's own segment preferred ended with
        ``codes``: the keys stored (0) came onto the segment."""
        owner = None if claim is None else claim.owner
        self.record(owner, "segment", (k for k, c in zip(keys, codes, strict=True) if c == 0),
                    True)

    def kept(self, tier: str, owner: Owner | None, prefix: str, limit: int) -> list[Change]:
        """The keys of ``owner`` starting with ``prefix`` whose last change of ``tier``
        among the last ``SCAN`` kept says they came in, each once, the most recent
        ``limit``, oldest first."""
        with self._lock:  # copied out, looked at off the lock
            recent = list(islice(reversed(self._entries), SCAN))
        seen: set[str] = set()
        out: list[Change] = []
        for o, t, key, held in recent:
            if len(out) >= limit:
                break
            if t != tier or o != owner or key in seen or not key.startswith(prefix):
                continue
            seen.add(key)
            if held:
                out.append((tier, key, True))
        out.reverse()
        return out

    def since(self, seq: int, owner: Owner | None, prefix: str,
              limit: int = MAX_CHANGES) -> tuple[list[Change], int] | None:
        """The changes numbered after ``seq`` of ``owner`` with keys starting with
        ``prefix`` (at most ``limit``, oldest first; of the next ``SCAN`` changes at
        most) and the number to ask from next; None when the log cannot answer that
        (``seq`` older than what it keeps, or never given): the caller starts again."""
        with self._lock:  # copied out, looked at off the lock
            first = self._last - len(self._entries) + 1  # number of the oldest kept
            if type(seq) is not int or seq < first - 1 or seq > self._last:
                return None
            start = seq - first + 1
            after = list(islice(self._entries, start, start + SCAN))
        out: list[Change] = []
        n = seq
        for o, tier, key, held in after:
            if len(out) >= limit:
                break
            n += 1
            if o == owner and key.startswith(prefix):
                out.append((tier, key, held))
        return out, n
