"""One group hit query, resolved with as few object checks as possible (pure logic).

The answer is the one ``deployments.group_hits`` gives from a check of every object of
every rank and pool; this module reaches it by checking only what can change it:

1. **One all-pages segment** (rank 0's KV, or the replicated KV): every page not already
   confirmed (``ConfirmedPages``). Its first missing page bounds the hit; a miss on page
   0 needs nothing more.
2. **Every other segment** (the other ranks' KV, extra pools with policy ``all_pages``,
   trailing pools such as Mamba or SWA): only pages below that bound, in one store call.
3. The answer: ``K``, the first page missing in any all-pages segment, bounds the hit;
   the restorable prefix lengths are those ``0..K`` every trailing segment allows,
   vectorised over segments.

A cold full hit costs two store calls and checks each object once; a miss costs one
call over one segment. Checking the trailing pools in step 2 rather than after ``K`` is
known checks a few objects in vain only when ranks disagree (another rank's KV ends
before rank 0's), and saves a round trip on every hit.
A step whose objects are all confirmed needs no store call, so a prefix asked again
while its confirmations hold is answered from memory; a page confirmed whole (every
segment) is found with one lookup, and a query whose every page is, needs no arrays.
Objects are grouped in **segments**: one family ``prefix + page hash + suffix`` per rank
and pool (a replicated pool's segment is shared by the TP ranks, so nothing is named
twice), and a page of a segment counts as present when every object of it exists.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from controllers.confirmed_pages import ConfirmedPages, cover
from controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult
from controllers.deployments import Deployment, PoolQuery, group_template
from controllers.hit_resolution import pool_hit_pages, trailing_masks


@dataclass(frozen=True)
class Segment:
    """One family of object names: ``prefix + hash + s`` for each ``s`` in ``suffixes``;
    ``window`` is 0 for all-pages pools, else the trailing window in pages. ``key``
    names the family (a string: its hash is kept, so lookups by it are cheap)."""

    key: str
    suffixes: tuple[str, ...]
    window: int


@dataclass(frozen=True)
class GroupLayout:
    """The distinct segments of one deployment and queried pool set, and the queried
    extra pools (for ``extra_pool_hit_pages``). ``key`` names the set of every
    segment's objects (for confirmations of whole pages), made once per layout."""

    prefix: str
    segments: tuple[Segment, ...]
    extra: tuple[PoolQuery, ...]

    @functools.cached_property
    def key(self) -> tuple:
        return cover([s.key for s in self.segments])

    def hit(self, pages: int, lengths: list[int]) -> PoolTransferResult:
        """The result for a hit of ``pages`` pages and restorable ``lengths``."""
        per_pool = {q.name: pool_hit_pages(pages, q.policy, q.window) for q in self.extra}
        return PoolTransferResult(kv_hit_pages=pages, extra_pool_hit_pages=per_pool,
                                  restorable_prefix_pages=lengths)


def group_layout(dep: Deployment, queries: Sequence[PoolQuery]) -> GroupLayout:
    """Segments of every rank of ``dep`` for KV and ``queries``' pools. ``ValueError`` if
    a query names a pool the deployment did not register."""
    extra = {q.name: q for q in queries if q.name != PoolName.KV}
    prefix, template = group_template(dep, list(extra.values()))
    segments: dict[tuple, Segment] = {}
    for _rank, pool, _scope, suffixes in template:
        q = extra.get(pool)
        window = q.window if q is not None and q.policy == PoolHitPolicy.TRAILING_PAGES else 0
        key = "\0".join((prefix, *suffixes))
        segments.setdefault(key, Segment(key, suffixes, window))
    return GroupLayout(prefix, tuple(segments.values()), tuple(extra.values()))


class GroupSearch:
    """The staged check of one query (see the module docstring). ``wanted`` holds the
    object names the next store check must cover (empty once ``result`` is set); feed
    the store's codes for exactly those names, in that order, to ``feed``. Pages found
    whole are confirmed under the layout's cover key, other pages found per segment,
    once the answer is known."""

    def __init__(self, layout: GroupLayout, hashes: Sequence[str],
                 confirmed: ConfirmedPages, now: float) -> None:
        self.layout = layout
        self.hashes = list(hashes)
        self.result: PoolTransferResult | None = None
        self.wanted: list[str] = []
        n = len(self.hashes)
        (whole,) = confirmed.until((layout.key,), self.hashes, now)
        if min(whole, default=now + 1.0) > now:  # every object of every page confirmed
            self.result = layout.hit(n, list(range(n + 1)))
            return
        self._confirmed = confirmed
        segs = layout.segments
        self._windows = np.array([s.window for s in segs], dtype=np.int64)
        self._until = np.array(confirmed.until([s.key for s in segs], self.hashes, now),
                               dtype=np.float64).reshape(len(segs), n)
        np.maximum(self._until, np.array(whole)[None, :], out=self._until)
        self.present = self._until > now
        self._fresh = np.zeros_like(self.present)  # found by this search's store checks
        self._bases: list[str] | None = None  # prefix + hash per page, made when needed
        self._asked: list[tuple[int, np.ndarray]] = []
        self._since: float | None = None  # when this search's first store check began
        self._stage = 0
        self._advance()

    def _ask(self, rows: Sequence[int], pages: int) -> bool:
        """Name the unknown pages ``< pages`` of segments ``rows``, segment by segment
        and within one suffix by suffix; True if any."""
        self._asked, names = [], []
        if self._bases is None:
            p = self.layout.prefix
            self._bases = [p + h for h in self.hashes]
        for s in rows:
            missing = np.flatnonzero(~self.present[s, :pages])
            if missing.size:
                bases = (self._bases[:pages] if missing.size == pages
                         else [self._bases[i] for i in missing.tolist()])
                for x in self.layout.segments[s].suffixes:
                    names += [b + x for b in bases]
                self._asked.append((s, missing))
        self.wanted = names
        return bool(names)

    def _bound(self, rows: np.ndarray) -> int:
        """The first page missing (or not checked) in any of segments ``rows``."""
        full = self.present[rows]
        return int(np.where(full.all(axis=1), full.shape[1], full.argmin(axis=1)).min())

    def _advance(self) -> None:
        every = np.flatnonzero(self._windows == 0)
        if self._stage == 0:
            self._stage = 1
            if self._ask(every[:1].tolist(), len(self.hashes)):
                return
        if self._stage == 1:
            self._stage = 2
            bound = self._bound(every[:1])
            rest = [r for r in range(len(self._windows)) if r != every[0]]
            if bound and self._ask(rest, bound):
                return
        self.wanted = []
        self.result = self._resolve(self._bound(every))
        self._record()

    def _record(self) -> None:
        """Confirm what this search found: pages now whole (every segment) under the
        cover key, until their earliest confirmation; per segment, found pages that are
        not whole or whose segment stays confirmed longer than the page's cover."""
        fresh = self._fresh
        if not fresh.any():
            return
        earliest = self._until.min(axis=0)
        whole = self.present.all(axis=0)
        pages = np.flatnonzero(whole & fresh.any(axis=0))
        if pages.size:
            self._confirmed.record(self.layout.key, [self.hashes[p] for p in pages.tolist()],
                                   earliest[pages].tolist())
        fresh &= ~whole | (self._until > earliest)
        for s in np.flatnonzero(fresh.any(axis=1)).tolist():
            pages = np.flatnonzero(fresh[s])
            self._confirmed.record(self.layout.segments[s].key,
                                   [self.hashes[p] for p in pages.tolist()],
                                   self._until[s, pages].tolist())

    def feed(self, codes: Sequence[int], since: float) -> None:
        """Take the store's codes (1 = exists) for ``wanted``, from a check that started
        at ``since`` (monotonic seconds); go on. Everything this search finds counts as
        confirmed from its first check on, so one query's confirmations end together."""
        if self._since is None:
            self._since = since
        until = self._since + self._confirmed.ttl_s
        found = list(codes)
        if len(found) != len(self.wanted):
            raise ValueError(f"{len(found)} codes for {len(self.wanted)} objects")
        everything = found.count(1) == len(found)
        ok = None if everything else np.array(found, dtype=np.int64) == 1
        i = 0
        for s, asked in self._asked:
            per, pages = len(self.layout.segments[s].suffixes), asked
            if ok is not None:  # a page counts when every object of it exists
                pages = asked[ok[i:i + asked.size * per].reshape(per, asked.size).all(axis=0)]
            i += asked.size * per
            self.present[s, pages] = True
            self._fresh[s, pages] = True
            self._until[s, pages] = until
        self._advance()
    def _resolve(self, k: int) -> PoolTransferResult:
        """The answer once every page below ``k`` (the first page some all-pages segment
        lacks) is known: every length ``0..k`` that the trailing segments allow."""
        common = np.ones(k + 1, dtype=bool)
        trailing = self._windows > 0
        if trailing.any() and k:
            common &= trailing_masks(self.present[trailing, :k],
                                     self._windows[trailing]).all(axis=0)
        hits = np.flatnonzero(common).tolist()
        return self.layout.hit(hits[-1], hits)
