"""One group hit query, resolved with as few object checks as possible (pure logic).

The answer is the one ``deployments.group_hits`` gives from a check of every object of
every rank and pool; this module reaches it by checking only what can change it:

1. **One all-pages segment** (rank 0's KV, or the replicated KV): every page not already
   confirmed (``ConfirmedPages``). Its first missing page bounds the hit.
2. **The other all-pages segments** (every rank's KV, extra pools with policy
   ``all_pages``): only pages below that bound. ``K``, the first page missing in any
   all-pages segment, bounds the hit: no prefix longer than ``K`` is restorable.
3. **Trailing pools** (Mamba, SWA), every rank: only pages below ``K``. A miss on page
   0 (``K = 0``) needs nothing after step 1.
4. The intersection of restorable prefix lengths ``0..K``, vectorised over segments.

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

from controllers.confirmed_pages import ConfirmedPages
from controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult
from controllers.deployments import Deployment, PoolQuery, group_template
from controllers.hit_resolution import pool_hit_pages, trailing_masks


@dataclass(frozen=True)
class Segment:
    """One family of object names: ``prefix + hash + s`` for each ``s`` in ``suffixes``;
    ``window`` is 0 for all-pages pools, else the trailing window in pages."""

    key: tuple[str, tuple[str, ...]]
    window: int

    @property
    def suffixes(self) -> tuple[str, ...]:
        return self.key[1]


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
        return ("layout", *(s.key for s in self.segments))

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
        key = (prefix, suffixes)
        segments.setdefault(key, Segment(key, window))
    return GroupLayout(prefix, tuple(segments.values()), tuple(extra.values()))


class GroupSearch:
    """The staged check of one query (see the module docstring). ``wanted`` holds the
    object names the next store check must cover (empty once ``result`` is set); feed
    the store's codes for exactly those names, in that order, to ``feed``."""

    def __init__(self, layout: GroupLayout, hashes: Sequence[str],
                 confirmed: ConfirmedPages, now: float) -> None:
        self.layout = layout
        self.hashes = list(hashes)
        self.result: PoolTransferResult | None = None
        self.wanted: list[str] = []
        n = len(self.hashes)
        whole = confirmed.until(layout.key, self.hashes, now)
        if (whole > now).all():  # every object of every page confirmed
            self.result = layout.hit(n, list(range(n + 1)))
            return
        self._confirmed = confirmed
        segs = layout.segments
        self._windows = np.array([s.window for s in segs], dtype=np.int64)
        self._until = np.vstack([confirmed.until(s.key, self.hashes, now) for s in segs])
        np.maximum(self._until, whole[None, :], out=self._until)
        self.present = self._until > now
        self._asked: list[tuple[int, np.ndarray]] = []
        self._fed = False
        self._stage = 0
        self._advance()

    def _ask(self, rows: np.ndarray, pages: int) -> bool:
        """Name the unknown pages ``< pages`` of segments ``rows``; True if any."""
        self._asked, names = [], []
        for s in rows:
            missing = np.flatnonzero(~self.present[s, :pages])
            if missing.size:
                seg = self.layout.segments[s]
                p, hashes = self.layout.prefix, self.hashes
                names += [f"{p}{hashes[i]}{x}" for i in missing.tolist() for x in seg.suffixes]
                self._asked.append((s, missing))
        self.wanted = names
        return bool(names)

    def _bound(self, rows: np.ndarray) -> int:
        """The first page missing (or not checked) in any of segments ``rows``."""
        full = self.present[rows]
        return int(np.where(full.all(axis=1), full.shape[1], full.argmin(axis=1)).min())

    def _advance(self) -> None:
        every = np.flatnonzero(self._windows == 0)
        steps = (lambda: (every[:1], len(self.hashes)),
                 lambda: (every[1:], self._bound(every[:1])),
                 lambda: (np.flatnonzero(self._windows > 0), self._bound(every)))
        while self._stage < len(steps):
            rows, pages = steps[self._stage]()
            self._stage += 1
            if pages and self._ask(rows, pages):
                return
        self.wanted = []
        self.result = self._resolve(self._bound(every))
        if self._fed:  # pages now confirmed whole: one lookup next time
            whole = np.flatnonzero(self.present.all(axis=0))
            self._confirmed.record(self.layout.key, [self.hashes[p] for p in whole.tolist()],
                                   self._until[:, whole].min(axis=0).tolist())

    def feed(self, codes: Sequence[int], since: float) -> None:
        """Take the store's codes (1 = exists) for ``wanted``, from a check that started
        at ``since`` (monotonic seconds); confirm the pages found whole; go on."""
        ok = np.fromiter(codes, dtype=np.int64, count=len(self.wanted)) == 1
        until = since + self._confirmed.ttl_s
        self._fed = True
        i = 0
        for s, pages in self._asked:
            seg = self.layout.segments[s]
            per = len(seg.suffixes)
            whole = ok[i:i + pages.size * per].reshape(pages.size, per).all(axis=1)
            i += pages.size * per
            found = pages[whole]
            self.present[s, found] = True
            self._until[s, found] = until
            self._confirmed.confirm(seg.key, [self.hashes[p] for p in found.tolist()], since)
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
