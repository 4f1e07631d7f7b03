"""One group hit query, resolved with as few existence checks as possible (pure logic).

The answer is the one an existence check of every object of every rank and pool gives (the unit
tests' oracle, ``tests/unit/oracle.py``, computes it that simple way); this module
reaches it by looking up only what can change it:

1. **A probe**: page 0 of every all-pages family (every rank's KV, extra pools with
   policy ``all_pages``; a replicated pool once), unless already confirmed. If one
   lacks it, nothing is restorable and the query is answered: a miss costs a handful
   of objects, whatever the prompt's length.
2. **Everything else** not already confirmed, every family (trailing pools such as
   Mamba or SWA included), every page, in one store call.
3. The answer: ``K``, the first page missing in any all-pages family, bounds the hit;
   the restorable prefix lengths are those ``0..K`` every trailing family allows.

A search told to ``speculate`` (its caller expects a hit: most recent queries found
their first page) skips the probe: one round trip instead of two for a hit, every
object looked up in vain for a miss.

A step whose objects are all confirmed needs no store call, so a prefix asked again
while its confirmations hold is answered from memory; a page confirmed whole (every
family) is found with one existence check. Objects are grouped in **families**: one family
``prefix + page hash + suffix`` per rank and role (``controllers.families``; a
replicated pool's family is shared by the TP ranks, so nothing is named twice), and a
page of a family counts as present when every object of it exists.

Cost: a query runs in the node actor for every rank's request, so its bookkeeping is
kept to a few C-level operations per family: presence is a ``bytearray`` per family
(first missing page: ``find``; known pages: ``count``; pages whole in every family: one
integer AND over all rows; trailing windows: ``hit_resolution.trailing_ends``, a few
integer shifts), and store codes are scanned with ``list.count`` before any per-object
work.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from raykv.controllers.confirmed_pages import ConfirmedPages
from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.families import GroupFamilies
from raykv.controllers.hit_resolution import trailing_ends
from raykv.controllers.result_codes import EXISTS


def search(group: GroupFamilies, hashes: Sequence[str],
           exists: Callable[[list[str]], Sequence[int]]) -> PoolTransferResult:
    """The hit of ``hashes`` from ``exists`` (object names -> store codes, 1 = exists)
    alone, nothing confirmed or remembered: one call to ``exists`` naming every object."""
    s = GroupSearch(group, hashes, ConfirmedPages(0.0), 0.0, speculate=True)
    while s.result is None:
        s.feed(exists(s.wanted), 0.0)
    return s.result


def _bits(row: bytes | bytearray) -> int:
    """A row of 0/1 bytes as an integer (byte ``p`` of the row is byte ``p`` of it)."""
    return int.from_bytes(row, "little")


def _pages(bits: int, n: int) -> list[int]:
    """The pages whose byte is 1 in ``bits`` (a row made by ``_bits``) of ``n`` pages."""
    row = bits.to_bytes(n, "little")
    return [p for p in range(n) if row[p]] if bits else []


class GroupSearch:
    """The staged existence checks of one query (see the module docstring). ``wanted`` holds the
    object names the next existence check must cover (empty once ``result`` is set); feed
    the store's codes for exactly those names, in that order, to ``feed``. Pages found
    whole are confirmed under the group's cover key, other pages found per family,
    once the answer is known."""

    def __init__(self, group: GroupFamilies, hashes: Sequence[str],
                 confirmed: ConfirmedPages, now: float, speculate: bool = False) -> None:
        self.group = group
        self.hashes = list(hashes)
        self.result: PoolTransferResult | None = None
        self.wanted: list[str] = []
        # Once ``result`` is set: whether page 0 exists in every all-pages family (a
        # search that found it needed, or would have needed, step 2).
        self.first_page_present = False
        n = len(self.hashes)
        (whole,) = confirmed.until((group.key,), self.hashes, now)
        if min(whole, default=now + 1.0) > now:  # every object of every page confirmed
            self.result = group.hit(n, list(range(n + 1)))
            self.first_page_present = n > 0
            return
        self._confirmed = confirmed
        families = group.families
        self._until = confirmed.until([f.key for f in families], self.hashes, now)
        if max(whole, default=0.0) > now:
            self._until = [list(map(max, row, whole)) for row in self._until]
        self._present = [bytearray(t > now for t in row) if max(row, default=0.0) > now
                         else bytearray(n) for row in self._until]
        self._fresh = [bytearray(n) for _ in families]  # found by this search's existence checks
        self._all = [s for s, f in enumerate(families) if not f.window]  # all-pages rows
        self._bases: list[str] | None = None  # prefix + hash per page, made when needed
        self._asked: list[tuple[int, Sequence[int]]] = []
        self._since: float | None = None  # when this search's first existence check began
        self._speculate = speculate
        self._stage = 0
        self._advance()

    def _ask(self, rows: Sequence[int], pages: int) -> bool:
        """Name the unknown pages ``< pages`` of families ``rows``, family by family
        and within one suffix by suffix; True if any."""
        self._asked, names = [], []
        if self._bases is None:
            p = self.group.prefix
            self._bases = [p + h for h in self.hashes]
        for s in rows:
            row = self._present[s]
            known = row.count(1, 0, pages)
            if known == pages:
                continue
            if known:
                missing = [i for i in range(pages) if not row[i]]
                bases = [self._bases[i] for i in missing]
            else:
                missing, bases = range(pages), self._bases[:pages]
            for x in self.group.families[s].suffixes:
                names += [b + x for b in bases]
            self._asked.append((s, missing))
        self.wanted = names
        return bool(names)

    def _bound(self, rows: Sequence[int]) -> int:
        """The first page missing (or not looked up) in any of families ``rows``."""
        n = len(self.hashes)
        return min((p if p >= 0 else n for p in (self._present[s].find(0) for s in rows)),
                   default=n)

    def _advance(self) -> None:
        every, n = range(len(self._present)), len(self.hashes)
        if self._stage == 0:
            self._stage = 1
            if not self._speculate and self._ask(self._all, 1):
                return
        if self._stage == 1:
            self._stage = 2
            if (self._speculate or self._bound(self._all)) and self._ask(every, n):
                return
        self.wanted = []
        k = self._bound(self._all)
        self.first_page_present = k > 0
        self.result = self._resolve(k)
        if self._since is not None:
            self._record()

    def _record(self) -> None:
        """Confirm what this search found: pages now whole (every family) under the
        cover key, until their earliest confirmation; per family, found pages that are
        not whole or whose family stays confirmed longer than the page's cover."""
        n = len(self.hashes)
        fresh = [_bits(row) for row in self._fresh]
        if not any(fresh):
            return
        whole = -1
        for row in self._present:
            whole &= _bits(row)
        any_fresh = 0
        for f in fresh:
            any_fresh |= f
        # Without older confirmations every page known here was found by this search,
        # so all its confirmations end together.
        older = any(row != f for row, f in zip(self._present, self._fresh, strict=True))
        if older:
            earliest = list(map(min, *self._until)) if len(self._until) > 1 \
                else self._until[0]
        pages = _pages(whole & any_fresh, n)
        if pages:
            self._confirmed.record(
                self.group.key, [self.hashes[p] for p in pages],
                [earliest[p] for p in pages] if older
                else [self._since + self._confirmed.ttl_s] * len(pages))
        # Found pages of a whole page outlive its cover only where the page was whole
        # thanks to older confirmations.
        partial = _bits(b"\x01" * n) ^ whole
        for s, f in enumerate(fresh):
            until = self._until[s]
            if older:
                pages = [p for p in _pages(f, n)
                         if not (whole >> (8 * p)) & 1 or until[p] > earliest[p]]
            else:
                pages = _pages(f & partial, n)
            if pages:
                self._confirmed.record(self.group.families[s].key,
                                       [self.hashes[p] for p in pages],
                                       [until[p] for p in pages])

    def feed(self, codes: Sequence[int], since: float) -> None:
        """Take the store's codes (1 = exists) for ``wanted``, from an existence check that started
        at ``since`` (monotonic seconds); go on. Everything this search finds counts as
        confirmed from its first existence check on, so one query's confirmations end together."""
        found = list(codes)
        if len(found) != len(self.wanted):
            raise ValueError(f"{len(found)} codes for {len(self.wanted)} objects")
        if self._since is None:
            self._since = since
        until = self._since + self._confirmed.ttl_s
        hits = found.count(EXISTS)
        i = 0
        for s, missing in self._asked:
            m, per = len(missing), len(self.group.families[s].suffixes)
            chunk, i = found[i:i + m * per], i + m * per
            if not hits:
                continue
            if chunk.count(EXISTS) == len(chunk):
                pages = missing
            else:  # a page counts when every object of it (one per suffix) exists
                parts = [chunk[j * m:(j + 1) * m] for j in range(per)]
                pages = [p for p, *c in zip(missing, *parts, strict=True)
                         if c.count(EXISTS) == per]
            row, fresh, times = self._present[s], self._fresh[s], self._until[s]
            if isinstance(pages, range):
                row[:m] = fresh[:m] = b"\x01" * m
                times[:m] = [until] * m
            else:
                for p in pages:
                    row[p] = fresh[p] = 1
                    times[p] = until
        self._advance()

    def _resolve(self, k: int) -> PoolTransferResult:
        """The answer once every page below ``k`` (the first page some all-pages family
        lacks) is known: every length ``0..k`` that the trailing families allow."""
        trailing = [s for s, f in enumerate(self.group.families) if f.window]
        if not k or not trailing:
            return self.group.hit(k, list(range(k + 1)))
        ends = -1  # byte p: a prefix of p + 1 pages is restorable from every trailing pool
        for s in trailing:
            ends &= trailing_ends(self._present[s][:k], self.group.families[s].window)
        hits = [0, *(p + 1 for p in _pages(ends, k))]
        return self.group.hit(hits[-1], hits)
