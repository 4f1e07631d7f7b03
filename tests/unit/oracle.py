"""The test oracle for hits: every pool's restorable prefixes from its existence flags,
and a group's hit from a lookup of every object of every rank and pool. Simple and slow
on purpose; the product's ``controllers.group_search`` must give the same answers (the
property tests compare them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolQuery
from raykv.controllers.families import GroupFamilies, group_families
from raykv.controllers.hit_resolution import pool_hit_pages, trailing_ends


@dataclass(frozen=True)
class PoolPresence:
    """One pool's existence flags for pages ``0..n-1`` and how it counts hits."""

    exists: Sequence[bool]
    policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    window: int = 1

    def __post_init__(self) -> None:
        if self.policy not in tuple(PoolHitPolicy):
            raise ValueError(f"unknown hit policy {self.policy!r}: expected one of "
                             f"{[p.value for p in PoolHitPolicy]}")
        if self.policy == PoolHitPolicy.TRAILING_PAGES and self.window < 1:
            raise ValueError(f"trailing_pages needs a window >= 1, got {self.window}")


def restorable_mask(p: PoolPresence) -> np.ndarray:
    """``mask[L]`` (``L`` = 0..n pages) is True when pool ``p`` can restore a prefix of
    ``L`` pages."""
    exists = np.asarray(p.exists, dtype=bool)
    if p.policy == PoolHitPolicy.ALL_PAGES:
        present = np.concatenate(([0], np.cumsum(exists)))  # pages < L that exist
        return present == np.arange(exists.size + 1)
    ends = trailing_ends(exists.astype(np.uint8).tobytes(), p.window)
    mask = np.ones(exists.size + 1, dtype=bool)
    mask[1:] = np.frombuffer(ends.to_bytes(exists.size, "little"), dtype=np.uint8)
    return mask


def restorable_lengths(p: PoolPresence) -> set[int]:
    """Prefix lengths (pages, 0 included) that pool ``p`` can restore."""
    return set(np.flatnonzero(restorable_mask(p)).tolist())


def resolve_hits(kv: PoolPresence, extra: Mapping[PoolName, PoolPresence] | None = None,
                 ranks: Sequence[tuple[PoolPresence, Mapping[PoolName, PoolPresence]]] = (),
                 ) -> PoolTransferResult:
    """Intersect restorable lengths over KV, every extra pool and every further rank.

    ``ranks`` holds the (kv, extra) presences of the other ranks of a group. Every pool
    must describe the same number of pages. ``extra_pool_hit_pages`` says how many pages
    each extra pool must load for the hit: all of them for ``all_pages``, the trailing
    window (at most the hit) for ``trailing_pages``.
    """
    extra = dict(extra or {})
    groups = [(kv, extra), *ranks]
    n = len(kv.exists)
    common = np.ones(n + 1, dtype=bool)
    for rank_kv, rank_extra in groups:
        for pool in (rank_kv, *rank_extra.values()):
            if len(pool.exists) != n:
                raise ValueError(f"pools describe {len(pool.exists)} and {n} pages")
            common &= restorable_mask(pool)
    lengths = np.flatnonzero(common).tolist()
    hit = lengths[-1]
    per_pool = {name: pool_hit_pages(hit, p.policy, p.window) for name, p in extra.items()}
    return PoolTransferResult(kv_hit_pages=hit, extra_pool_hit_pages=per_pool,
                              restorable_prefix_pages=lengths)


class AllObjects:
    """Every object of a group's ``families`` for pages ``hashes``, each named once
    (``GroupFamilies.objects`` order), and where each (rank, role) finds its own:
    ``spans[rank][role] = (first object, objects per page)``. A replicated pool's
    family is shared by its TP ranks, so they share its span."""

    def __init__(self, families: GroupFamilies, page_hashes: Sequence[str]) -> None:
        self.hashes = list(page_hashes)
        self.objects = families.objects(self.hashes)
        self.spans: dict[tuple[int, int], dict[PoolName, tuple[int, int]]] = {}
        start = 0
        for f in families.families:
            for rank in f.ranks:
                self.spans.setdefault(rank, {})[f.role] = (start, len(f.suffixes))
            start += len(f.suffixes) * len(self.hashes)

    def presence(self, exists: np.ndarray, rank: tuple[int, int], role: PoolName) -> np.ndarray:
        """Per page: every object of the page exists (``exists`` indexed like ``objects``)."""
        start, per_page = self.spans[rank][role]
        n = len(self.hashes)
        return exists[start:start + n * per_page].reshape(per_page, n).all(axis=0)


def group_objects(dep: Deployment, page_hashes: Sequence[str],
                  queries: Sequence[PoolQuery]) -> AllObjects:
    """Every object of every rank and queried pool (KV always), each named once."""
    return AllObjects(group_families(dep, queries), page_hashes)


def group_hits(every: AllObjects, queries: Sequence[PoolQuery], codes: Sequence[int]):
    """The ``PoolTransferResult`` of every rank in ``every`` from the ``batch_is_exist``
    codes of ``every.objects``: the intersection over every rank and pool."""
    exists = np.fromiter(codes, dtype=np.int64, count=len(codes)) == 1
    policy = {q.role: q for q in queries if q.role != PoolName.KV}
    ranks = []
    for rank, pools in every.spans.items():
        kv = PoolPresence(every.presence(exists, rank, PoolName.KV))
        extra = {n: PoolPresence(every.presence(exists, rank, n), policy[n].policy,
                                 policy[n].window)
                 for n in pools if n != PoolName.KV}
        ranks.append((kv, extra))
    first, *rest = ranks
    return resolve_hits(first[0], first[1], ranks=rest)
