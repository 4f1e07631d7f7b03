"""The test oracle for group hits: name every object of every rank and pool, check them
all, and resolve the hit with ``hit_resolution.resolve_hits``. Simple and slow on
purpose; the product's ``controllers.group_search`` must give the same answers (the
property tests compare them)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from raykv.controllers.contract import PoolName
from raykv.controllers.deployments import Deployment, PoolQuery, group_template
from raykv.controllers.hit_resolution import PoolPresence, resolve_hits


class ObjectPlan:
    """The objects of one existence check: for every (rank, pool) a contiguous segment
    of ``pages x objects-per-page`` keys. A replicated pool's segment is shared by all
    TP ranks (stored once, by TP rank 0), so no key is named twice."""

    def __init__(self, prefix: str, page_hashes: Sequence[str]) -> None:
        self.prefix = prefix
        self.hashes = list(page_hashes)
        self.objects: list[str] = []
        self.segments: dict[tuple[int, int], dict[PoolName, tuple[int, int]]] = {}
        self._by_scope: dict[tuple, tuple[int, int]] = {}

    def add(self, rank: tuple[int, int], pool: PoolName, scope: tuple,
            suffixes: Sequence[str]) -> None:
        """Name ``prefix + hash + suffix`` for every page and suffix, once per scope."""
        seg = self._by_scope.get((scope, pool))
        if seg is None:
            seg = (len(self.objects), len(suffixes))
            p = self.prefix
            self.objects += [p + h + s for h in self.hashes for s in suffixes]
            self._by_scope[(scope, pool)] = seg
        self.segments.setdefault(rank, {})[pool] = seg

    def presence(self, exists: np.ndarray, rank: tuple[int, int], pool: PoolName) -> np.ndarray:
        """Per page: every object of the page exists (``exists`` indexed like ``objects``)."""
        start, per_page = self.segments[rank][pool]
        n = len(self.hashes)
        return exists[start:start + n * per_page].reshape(n, per_page).all(axis=1)


def group_objects(dep: Deployment, page_hashes: Sequence[str],
                  queries: Sequence[PoolQuery]) -> ObjectPlan:
    """Every object of every rank and queried pool (KV always), each named once."""
    prefix, template = group_template(dep, queries)
    plan = ObjectPlan(prefix, page_hashes)
    for rank, pool, scope, suffixes in template:
        plan.add(rank, pool, scope, suffixes)
    return plan


def group_hits(plan: ObjectPlan, queries: Sequence[PoolQuery], codes: Sequence[int]):
    """The ``PoolTransferResult`` of every rank in ``plan`` from the ``batch_is_exist``
    codes of ``plan.objects``: the intersection over every rank and pool."""
    exists = np.fromiter(codes, dtype=np.int64, count=len(codes)) == 1
    policy = {q.name: q for q in queries if q.name != PoolName.KV}
    ranks = []
    for rank, pools in plan.segments.items():
        kv = PoolPresence(plan.presence(exists, rank, PoolName.KV))
        extra = {n: PoolPresence(plan.presence(exists, rank, n), policy[n].policy,
                                 policy[n].window)
                 for n in pools if n != PoolName.KV}
        ranks.append((kv, extra))
    first, *rest = ranks
    return resolve_hits(first[0], first[1], ranks=rest)
