"""Which ready page of an L2 pool goes first when a page is needed: the eviction
policies of ``L2Index`` (pure: no Ray, no Mooncake, no torch).

An *eviction order* keeps the ready pages of one pool (``add`` when a page becomes
ready, ``used`` when it is looked up or read) and picks a victim (``take``) among the
pages a caller says are evictable (``L2Index``: neither held, leased nor dirty); a page
it skips as not evictable stays (``s3fifo``'s small FIFO: goes round again). Policies
(``L2_EVICTIONS``: ``NodeSettings.l2_eviction``):

- ``lru``: the least recently used page goes first (``L2Index``'s own default).
- ``s3fifo`` (S3-FIFO, Yang et al., SOSP'23; the node's default): a new page enters a
  small FIFO (a tenth of the pages); one never used there leaves the pool (its key is
  kept in a ghost queue of as many keys as the pool has pages), one used moves to the
  main FIFO; a key that comes back while in the ghost queue enters the main FIFO at
  once. The main FIFO gives each page with uses left another turn (one use fewer: at
  most 3 kept) before its unused head goes. One-time blocks leave early, reused ones
  stay.
- ``slru`` (segmented LRU): a new page enters a probation LRU; a page used there moves
  to a protected LRU of at most four fifths of the pages, whose least recently used
  page falls back to probation's most recent end when it is over. Victims come from
  probation first (least recently used first), then from protected.

A lookup and the read after it are two uses (``L2Index.lease``, ``acquire``). Every
method runs under ``L2Index``'s caller's lock; ``take`` looks each page over a bounded
number of times (at most four per page: ``s3fifo``'s turns), never blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from raykv.controllers.node_settings import L2_EVICTIONS

Evictable = Callable[[int], bool]
"""Whether a page may be evicted now (``L2Index``: not held, leased or dirty)."""


class LRUOrder:
    """``lru`` (see the module docstring) over the ready pages."""

    def __init__(self, pages: int) -> None:
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first

    def add(self, page: int, key: str) -> None:
        """``page`` became ready with ``key``: the most recently used."""
        self._lru[page] = None

    def used(self, page: int) -> None:
        """``page`` (ready) was looked up or read."""
        self._lru.move_to_end(page)

    def take(self, evictable: Evictable) -> int | None:
        """The least recently used evictable page, removed from the order; None if none."""
        for p in self._lru:
            if evictable(p):
                del self._lru[p]
                return p
        return None

    def hottest(self) -> Iterator[int]:
        """The ready pages, most recently used first."""
        return reversed(self._lru)


class S3FIFOOrder:
    """``s3fifo`` (see the module docstring) over the ready pages of a pool of
    ``pages``."""

    MAX_USES = 3

    def __init__(self, pages: int) -> None:
        self._small_max = max(1, pages // 10)
        self._small: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[int, None] = OrderedDict()
        self._uses: dict[int, int] = {}
        self._key: dict[int, str] = {}
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._ghost_max = pages

    def add(self, page: int, key: str) -> None:
        """``page`` became ready with ``key``: into main if ``key`` is a ghost, else small."""
        self._uses[page], self._key[page] = 0, key
        if key in self._ghost:
            del self._ghost[key]
            self._main[page] = None
        else:
            self._small[page] = None

    def used(self, page: int) -> None:
        """``page`` (ready) was looked up or read: one use more (at most ``MAX_USES``)."""
        self._uses[page] = min(self._uses[page] + 1, self.MAX_USES)

    def take(self, evictable: Evictable) -> int | None:
        """A victim (small's first unused evictable page while small is over its share or
        main has none, else main's), removed from the order; None if no page is
        evictable."""
        if len(self._small) >= self._small_max or not self._main:
            p = self._from_small(evictable)
            if p is not None:
                return p
        p = self._from_main(evictable)
        return p if p is not None else self._from_small(evictable)

    def _from_small(self, evictable: Evictable) -> int | None:
        for _ in range(len(self._small)):
            p = next(iter(self._small))
            if self._uses[p]:
                del self._small[p]
                self._uses[p] = 0
                self._main[p] = None
            elif not evictable(p):
                self._small.move_to_end(p)
            else:
                del self._small[p]
                key = self._forget(p)
                self._ghost[key] = None
                if len(self._ghost) > self._ghost_max:
                    self._ghost.popitem(last=False)
                return p
        return None

    def _from_main(self, evictable: Evictable) -> int | None:
        for _ in range((self.MAX_USES + 1) * len(self._main)):
            p = next(iter(self._main))
            self._main.move_to_end(p)
            if self._uses[p]:
                self._uses[p] -= 1
            elif evictable(p):
                del self._main[p]
                self._forget(p)
                return p
        return None

    def _forget(self, page: int) -> str:
        del self._uses[page]
        return self._key.pop(page)

    def hottest(self) -> Iterator[int]:
        """The ready pages: main's newest first, then small's."""
        yield from reversed(self._main)
        yield from reversed(self._small)


class SLRUOrder:
    """``slru`` (see the module docstring) over the ready pages of a pool of ``pages``."""

    def __init__(self, pages: int) -> None:
        self._protected_max = max(1, pages * 4 // 5)
        self._probation: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._protected: OrderedDict[int, None] = OrderedDict()

    def add(self, page: int, key: str) -> None:
        """``page`` became ready: probation's most recent."""
        self._probation[page] = None

    def used(self, page: int) -> None:
        """``page`` (ready) was looked up or read: protected's most recent (protected's
        least recent back to probation when it is over its share)."""
        if page in self._protected:
            self._protected.move_to_end(page)
            return
        del self._probation[page]
        self._protected[page] = None
        if len(self._protected) > self._protected_max:
            old, _ = self._protected.popitem(last=False)
            self._probation[old] = None

    def take(self, evictable: Evictable) -> int | None:
        """Probation's least recently used evictable page, else protected's; removed
        from the order; None if none."""
        for lru in (self._probation, self._protected):
            for p in lru:
                if evictable(p):
                    del lru[p]
                    return p
        return None

    def hottest(self) -> Iterator[int]:
        """The ready pages: protected's most recent first, then probation's."""
        yield from reversed(self._protected)
        yield from reversed(self._probation)


EvictionOrder = LRUOrder | S3FIFOOrder | SLRUOrder
_ORDERS = dict(zip(L2_EVICTIONS, (S3FIFOOrder, LRUOrder, SLRUOrder), strict=True))


def check_eviction(name: object) -> str:
    """``name`` if it names a policy of ``L2_EVICTIONS``, else ``ValueError``."""
    if name not in L2_EVICTIONS:
        raise ValueError(f"L2 eviction must be one of {L2_EVICTIONS}, got {name!r}")
    return name


def eviction_order(name: str, pages: int) -> EvictionOrder:
    """A new, empty eviction order of policy ``name`` for a pool of ``pages`` pages."""
    return _ORDERS[check_eviction(name)](pages)
