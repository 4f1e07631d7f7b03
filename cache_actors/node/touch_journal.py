"""Which store objects a node wrote or read lately, and when (pure: no Ray, no Mooncake).

The node actor notes every object its store calls stored or found (``NodeService._move``):
a put that stored it or found it present, a get that read it; and every page its L2
served (``L2Pools.acquire``: a page kept hot in L2 never reaches the store again).
Each entry keeps the object's size, the wall-clock time of its last touch
(``time.time()`` seconds: the drain and the warm-up compare touches of several nodes)
and how many touches it had. The journal keeps the ``capacity`` most recently touched
objects; older ones are forgotten, so what it answers is a bounded view of what is hot,
not a list of what is stored.

A drain orders the objects a leaving node alone holds by these touches, merged over
every node (``hottest``); a warm-up takes the hottest keys of a deployment
(``recent`` with its key prefix).

Threads: any; ``_lock`` guards the entries and is never held while calling out.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import islice

JOURNAL_KEYS = 65536
"""Objects a node's journal keeps (about 10 MB of keys)."""
MAX_ANSWER = 16384
"""Entries one ``recent`` or ``of`` answer holds at most (a Ray call's worth)."""


@dataclass(frozen=True)
class Touch:
    """One object's last touch: ``last`` (wall-clock seconds), ``hits`` (touches
    counted), ``size`` (bytes)."""

    last: float
    hits: int
    size: int

    def merged(self, other: Touch) -> Touch:
        """This object as two nodes saw it: the later touch, the touches summed."""
        return Touch(max(self.last, other.last), self.hits + other.hits,
                     max(self.size, other.size))


class TouchJournal:
    """The ``capacity`` most recently touched objects of one node."""

    def __init__(self, capacity: int = JOURNAL_KEYS) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, Touch] = OrderedDict()  # oldest first

    def touched(self, keys: Sequence[str], sizes: Sequence[int], now: float) -> None:
        """``keys`` (of ``sizes`` bytes) were stored or read at ``now``."""
        with self._lock:
            for key, size in zip(keys, sizes, strict=True):
                old = self._entries.pop(key, None)
                self._entries[key] = Touch(now, 1 if old is None else old.hits + 1, size)
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)

    def moved(self, op: str, keys: Sequence[str], sizes: Sequence[int],
              codes: Sequence[int], now: float) -> None:
        """A store call ``op`` ("put" / "get") over ``keys`` ended with ``codes``: an
        object stored or already present (code >= 0), or read (code > 0), was touched."""
        touched = [i for i, c in enumerate(codes) if (c >= 0 if op == "put" else c > 0)]
        if touched:
            self.touched([keys[i] for i in touched], [sizes[i] for i in touched], now)

    def served(self, keys: Sequence[str], size: int) -> None:
        """``keys`` (of ``size`` bytes each) were served from L2 now (wall clock)."""
        if keys:
            self.touched(keys, [size] * len(keys), time.time())

    def forget(self, keys: Iterable[str]) -> None:
        """``keys`` left the store (removed on purpose)."""
        with self._lock:
            for key in keys:
                self._entries.pop(key, None)

    def recent(self, limit: int = MAX_ANSWER, prefix: str = "") -> list[tuple[str, Touch]]:
        """Up to ``min(limit, MAX_ANSWER)`` entries whose key starts with ``prefix``,
        most recently touched first."""
        limit = max(0, min(limit, MAX_ANSWER))
        with self._lock:
            newest = list(reversed(self._entries.items()))
        return list(islice(((k, t) for k, t in newest if k.startswith(prefix)), limit))

    def entries(self) -> list[tuple[str, Touch]]:
        """Every entry, most recently touched first (at most ``capacity``: a drain's)."""
        with self._lock:
            return list(reversed(self._entries.items()))

    def of(self, keys: Sequence[str]) -> dict[str, Touch]:
        """The touches of those of the first ``MAX_ANSWER`` ``keys`` this journal has."""
        with self._lock:
            return {k: t for k in keys[:MAX_ANSWER] if (t := self._entries.get(k)) is not None}

    def answer(self, keys: Sequence[str] | None, prefix: str = "",
               limit: int = MAX_ANSWER) -> dict[str, Touch]:
        """What a peer asks: ``of(keys)``, or (``keys`` None) ``recent(limit, prefix)``."""
        return self.of(keys) if keys is not None else dict(self.recent(limit, prefix))


def hottest(views: Iterable[dict[str, Touch]]) -> list[tuple[str, Touch]]:
    """The objects of several nodes' views, each once (``Touch.merged``), the most
    recently touched first, more touches first among equals."""
    merged: dict[str, Touch] = {}
    for view in views:
        for key, touch in view.items():
            seen = merged.get(key)
            merged[key] = touch if seen is None else seen.merged(touch)
    return sorted(merged.items(), key=lambda kt: (-kt[1].last, -kt[1].hits, kt[0]))
