"""The index of one L2 pool: which object each page holds, and who may touch it (pure:
no Ray, no Mooncake, no torch; the clock is passed in).

An L2 pool is a node's shared host pool used as a cache of objects (one vLLM block of one
TP rank per page). ``L2Index`` maps each object key to the page that holds it and keeps
the rules that make a page's bytes right for whoever reads them:

- A page is *free*, *writing* (reserved by one holder, which copies the object in) or
  *ready* (holds the object of its key). Only ``commit`` makes a page ready, and only the
  holder that reserved it; ``release`` of a holder turns its writing pages back to free,
  never ready, so a write that did not end (the holder gave up, its commit failed) is
  never read.
- A *holder* is one thread of a rank process (``(thread id, start ticks)``: ``Holder``),
  doing one transfer at a time:
  ``acquire`` gives it ready pages to read and ``reserve`` free pages to write; both are
  *held* until the holder's next ``release`` (the node releases a holder's pages before
  its next transfer, and those of holders whose process is gone). A held page is never
  evicted or handed to another writer, whatever time passes: a holder that was told
  a page is its own may copy as long as it takes, and holds at most one transfer's pages.
- A *lease* (``lookup``) keeps a ready page from eviction for ``lease_s`` seconds: from a
  scheduler's lookup until the worker's ``acquire``. A lease that ran out only makes the
  page evictable: the later ``acquire`` finds the key gone (a miss), or finds it still
  there; never another object's bytes, since ``acquire`` checks the key itself.
- A *dirty* page holds an object not yet in L3 (its write-behind put has not ended); it
  is not evicted until ``flushed``.
- Eviction takes a ready page that is neither held, leased nor dirty, the one the pool's
  eviction order picks (``eviction_order``: ``lru``, the least recently used, unless
  told; the node's is ``NodeSettings.l2_eviction``); ``reserve`` never evicts anything
  else, so when every page is held, leased or dirty it answers ``FULL`` for that key
  (the caller stores it another way or drops it).
- ``reserve`` answers ``PRESENT`` only for a ready key; for a key another holder is still
  writing it answers ``WRITING``: that write may yet fail or be abandoned (then the key
  is in L2 nowhere), so the caller must not count the key stored in L2 (nor publish it
  so); it stores it another way or drops it, as for ``FULL``.

A page becoming ready (``commit``) or stopping being ready (evicted) is told to
``on_change(key, ready)`` when given (the node's residency log, for routers).

Every method runs under the caller's lock (``L2Pools``); none blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from raykv.cache_actors.node.eviction_order import eviction_order
from raykv.controllers.node_records import L2PoolStats
from raykv.controllers.result_codes import FULL, PRESENT, WRITING

Holder = tuple[int, int]
"""One rank thread: ``(thread id, start ticks)`` (``ProcessIdentity``; a process's main
thread is the process itself)."""


@dataclass
class _Page:
    key: str | None = None
    writer: Holder | None = None  # set while writing
    readers: set[Holder] = field(default_factory=set)
    lease_until: float = 0.0
    dirty: bool = False

    @property
    def ready(self) -> bool:
        return self.key is not None and self.writer is None


class L2Index:
    """The pages of one L2 pool of ``pages`` pages (see the module docstring).
    ``lease_s``: how long a ``lookup`` keeps a page from eviction; ``clock``: seconds
    (``time.monotonic`` in the node actor); ``on_change``: see the module docstring;
    ``eviction``: the policy (``node_settings.L2_EVICTIONS``). Counters in ``counts``."""

    def __init__(self, pages: int, lease_s: float, clock: Callable[[], float],
                 on_change: Callable[[str, bool], None] | None = None,
                 eviction: str = "lru") -> None:
        if pages < 1:
            raise ValueError(f"an L2 pool needs at least one page, got {pages}")
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._clock = clock
        self._on_change = on_change
        self._pages = [_Page() for _ in range(pages)]
        self._free = list(range(pages - 1, -1, -1))  # popped from the end: page 0 first
        self._keys: dict[str, int] = {}  # key -> page, writing or ready
        self._order = eviction_order(eviction, pages)  # the ready pages
        self._held: dict[Holder, set[int]] = {}
        self.counts = {"hits": 0, "misses": 0, "written": 0, "evicted": 0, "full": 0,
                       "flushed": 0, "aborted": 0}

    @property
    def pages(self) -> int:
        return len(self._pages)

    @property
    def free(self) -> int:
        """Pages holding nothing (taken without evicting a ready page)."""
        return len(self._free)

    def page_of(self, key: str) -> int | None:
        """The page holding ``key``, ready; None if it is not ready here."""
        p = self._keys.get(key)
        return p if p is not None and self._pages[p].ready else None

    def key_of(self, page: int) -> str | None:
        """The key page ``page`` holds or is being written with (None: free)."""
        return self._pages[page].key

    def lease(self, key: str) -> bool:
        """Whether ``key`` is ready here; if so its page is leased for ``lease_s`` from
        now (kept from eviction) and used (its eviction order told)."""
        p = self.page_of(key)
        if p is None:
            return False
        page = self._pages[p]
        page.lease_until = max(page.lease_until, self._clock() + self.lease_s)
        self._order.used(p)
        return True

    def lookup(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` are ready (each leased, as ``lease``)."""
        n = 0
        while n < len(keys) and self.lease(keys[n]):
            n += 1
        return n

    def acquire(self, holder: Holder, keys: Sequence[str]) -> list[int]:
        """The pages of the leading ready ``keys`` (up to the first that is not), held
        by ``holder`` for reading until its ``release``; counted as hits (the rest of
        ``keys`` as misses)."""
        out: list[int] = []
        for k in keys:
            p = self.page_of(k)
            if p is None:
                break
            self._pages[p].readers.add(holder)
            self._held.setdefault(holder, set()).add(p)
            self._order.used(p)
            out.append(p)
        self.counts["hits"] += len(out)
        self.counts["misses"] += len(keys) - len(out)
        return out

    def reserve(self, holder: Holder, keys: Sequence[str], evict: bool = True) -> list[int]:
        """Per key: a page reserved for ``holder`` to write it (held until its
        ``commit`` or ``release``), ``PRESENT`` if the key is ready here, ``WRITING`` if
        another write of it is under way, ``FULL`` if no page is free or evictable
        (without ``evict``: no page is free; no ready page is evicted then).
        ``ValueError`` for a key given twice. Once no page was found, the later keys are
        ``FULL`` (or ``PRESENT``, ``WRITING``) without another look: the pages are
        looked over at most once per call, never once per key (this runs under the
        node's one L2 lock)."""
        if len(set(keys)) != len(keys):
            raise ValueError("an L2 reservation names a key twice")
        out = []
        full = False
        for k in keys:
            if k in self._keys:
                out.append(PRESENT if self._pages[self._keys[k]].ready else WRITING)
                continue
            p = None if full or not (evict or self._free) else self._take()
            if p is None:
                full = True
                self.counts["full"] += 1
                out.append(FULL)
                continue
            page = self._pages[p]
            page.key, page.writer = k, holder
            self._keys[k] = p
            self._held.setdefault(holder, set()).add(p)
            out.append(p)
        return out

    def commit(self, holder: Holder, pages: Sequence[int], ok: Sequence[bool], *,
               dirty: bool, reader: Holder | None = None) -> list[int]:
        """End ``holder``'s writes of ``pages``: those ``ok`` become ready (``dirty``:
        not yet in L3), the others free; with ``reader`` the ready ones are held by
        ``reader`` for reading (until its ``release``). Pages not being written by
        ``holder`` (released meanwhile) are skipped. Returns the pages made ready, in
        order."""
        made = []
        for p, good in zip(pages, ok, strict=True):
            page = self._pages[p] if 0 <= p < len(self._pages) else None
            if page is None or page.writer != holder:
                continue
            if not good:
                self._drop_writer(p)
                self.counts["aborted"] += 1
                continue
            page.writer, page.dirty = None, dirty
            self._order.add(p, page.key)
            self._unhold(holder, p)
            if reader is not None:
                page.readers.add(reader)
                self._held.setdefault(reader, set()).add(p)
            self.counts["written"] += 1
            made.append(p)
            if self._on_change is not None:
                self._on_change(page.key, True)
        return made

    def flushed(self, pages: Sequence[int], keys: Sequence[str]) -> None:
        """The write-behind of ``pages`` (holding ``keys``) ended: they may be evicted."""
        for p, k in zip(pages, keys, strict=True):
            page = self._pages[p]
            if page.key == k and page.dirty:
                page.dirty = False
                self.counts["flushed"] += 1

    def release(self, holder: Holder) -> None:
        """Drop every page ``holder`` holds: its reads end, its unfinished writes are
        abandoned (free again, never ready)."""
        for p in self._held.pop(holder, ()):
            page = self._pages[p]
            page.readers.discard(holder)
            if page.writer == holder:
                self._drop_writer(p, unhold=False)
                self.counts["aborted"] += 1

    def ready_keys(self, limit: int) -> list[str]:
        """The keys of ready pages, the hottest first (``lru``: most recently used
        first), at most ``limit``."""
        out = []
        for p in self._order.hottest():
            if len(out) >= limit:
                break
            out.append(self._pages[p].key)
        return out

    def holders(self) -> list[Holder]:
        """Every holder holding a page now."""
        return list(self._held)

    def stats(self) -> L2PoolStats:
        """``pages``, ``ready``, ``dirty``, ``held``, ``leased`` now, and ``counts``."""
        now = self._clock()
        ready = [p for p in self._pages if p.ready]
        return L2PoolStats(pages=len(self._pages), ready=len(ready),
                           dirty=sum(p.dirty for p in ready),
                           held=sum(bool(p.readers or p.writer) for p in self._pages),
                           leased=sum(p.lease_until > now for p in ready), **self.counts)

    # ---------------------------------------------------------------- helpers
    def _take(self) -> int | None:
        """A free page, else the evictable ready one the eviction order picks (evicted)."""
        if self._free:
            return self._free.pop()
        now = self._clock()
        pages = self._pages
        p = self._order.take(lambda p: not pages[p].readers and not pages[p].dirty
                             and pages[p].lease_until <= now)
        if p is None:
            return None
        page = pages[p]
        del self._keys[page.key]
        if self._on_change is not None:
            self._on_change(page.key, False)
        page.key, page.lease_until = None, 0.0
        self.counts["evicted"] += 1
        return p

    def _drop_writer(self, p: int, unhold: bool = True) -> None:
        page = self._pages[p]
        holder = page.writer
        del self._keys[page.key]
        page.key, page.writer, page.dirty = None, None, False
        page.readers.clear()
        self._free.append(p)
        if unhold and holder is not None:
            self._unhold(holder, p)

    def _unhold(self, holder: Holder, p: int) -> None:
        held = self._held.get(holder)
        if held is not None:
            held.discard(p)
            if not held:
                del self._held[holder]


def check_holder(holder: object) -> Holder:
    """``holder`` if it names a thread, ``(id > 0, start ticks >= 0)`` as two ``int``;
    else ``ValueError`` (the Ray route checks no argument types; ids below 1 are the
    node's own holders, ``L2Pools``' fills)."""
    if type(holder) is not tuple or len(holder) != 2 or \
            any(type(x) is not int for x in holder) or holder[0] < 1 or holder[1] < 0:
        raise ValueError(f"an L2 holder is (thread id > 0, start ticks >= 0), got {holder!r}")
    return holder
