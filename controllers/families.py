"""Object families: the one description of what a rank stores for a pool (pure logic).

A *family* is the objects of one rank and role, per page: ``prefix + page hash + s``
for each suffix ``s`` (one per buffer of the pool, in key order; ``KeyScheme.suffixes``).
A replicated pool's family is shared by the TP ranks of its PP stage (its objects are
stored once, by TP rank 0), so within a group no object is named twice. A hit query
(one rank's ``batch_exists_v2``, or a whole group's ``group_exists``) is a set of
families, ``GroupFamilies``: ``group_search`` resolves it, the unit tests' oracle names
every object of it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.controllers.confirmed_pages import cover
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolQuery, PoolSpec
from raykv.controllers.hit_resolution import pool_hit_pages
from raykv.controllers.keys import KeyScheme

Rank = tuple[int, int]
"""A rank of a deployment: ``(tp_rank, pp_rank)``."""


@dataclass(frozen=True)
class Family:
    """The objects of ``role`` of ``ranks`` per page: ``prefix + hash + s`` for each ``s``
    in ``suffixes``. ``ranks``: one rank, or every TP rank of a PP stage for a replicated
    pool; ``window``: 0 for an all-pages pool, else the trailing window in pages. ``key``
    names the family (a string: its hash is kept, so lookups by it are cheap)."""

    key: str
    role: PoolName
    ranks: tuple[Rank, ...]
    suffixes: tuple[str, ...]
    window: int


@dataclass(frozen=True)
class GroupFamilies:
    """The distinct families of one hit query (a group's, or one rank's), and its
    queried extra pools (for ``extra_pool_hit_pages``). ``key`` names the set of every
    family's objects (for confirmations of whole pages), made once per group."""

    prefix: str
    families: tuple[Family, ...]
    extra: tuple[PoolQuery, ...]

    @functools.cached_property
    def key(self) -> frozenset:
        return cover([f.key for f in self.families])

    def objects(self, hashes: Sequence[str]) -> list[str]:
        """Every object name of every family for pages ``hashes``: family by family,
        within one suffix by suffix, then page by page."""
        bases = [self.prefix + h for h in hashes]
        return [b + x for f in self.families for x in f.suffixes for b in bases]

    def hit(self, pages: int, lengths: list[int]) -> PoolTransferResult:
        """The result for a hit of ``pages`` pages and restorable ``lengths``."""
        per_pool = {q.role: pool_hit_pages(pages, q.policy, q.window) for q in self.extra}
        return PoolTransferResult(kv_hit_pages=pages, extra_pool_hit_pages=per_pool,
                                  restorable_prefix_pages=lengths)


def _families(prefix: str, ranks: Sequence[tuple[Rank, KeyScheme]], specs: Sequence[PoolSpec],
              queries: Sequence[PoolQuery]) -> GroupFamilies:
    """The families of ``specs`` (KV first) of every rank of ``ranks`` (rank and its key
    scheme), with ``queries``' hit policies; a family shared by ranks is listed once, at
    its first rank."""
    extra = {q.role: q for q in queries if q.role != PoolName.KV}
    found: dict[str, tuple[PoolSpec, list[Rank], tuple[str, ...]]] = {}
    for rank, keys in ranks:
        for spec in specs:
            suffixes = tuple(keys.suffixes(spec.role, spec.kind, spec.buffers))
            key = "\0".join((prefix, *suffixes))
            entry = found.setdefault(key, (spec, [], suffixes))
            entry[1].append(rank)
    families = []
    for key, (spec, members, suffixes) in found.items():
        q = extra.get(spec.role)
        window = q.window if q is not None and q.policy == PoolHitPolicy.TRAILING_PAGES else 0
        families.append(Family(key, spec.role, tuple(members), suffixes, window))
    return GroupFamilies(prefix, tuple(families), tuple(extra.values()))


@functools.lru_cache(maxsize=256)
def rank_families(keys: KeyScheme, rank: Rank, specs: tuple[PoolSpec, ...],
                  queries: tuple[PoolQuery, ...] = ()) -> GroupFamilies:
    """Families of one ``rank`` (named by ``keys``) for its pools ``specs`` (KV first),
    with ``queries``' hit policies: a group of one."""
    return _families(keys.prefix, [(rank, keys)], specs, queries)


@functools.lru_cache(maxsize=256)
def _group_families(ranks: tuple[tuple[Rank, KeyScheme], ...], specs: tuple[PoolSpec, ...],
                    queries: tuple[PoolQuery, ...]) -> GroupFamilies:
    """``group_families``, computed once per deployment shape, pool set and query."""
    return _families(ranks[0][1].prefix, ranks, specs, queries)


def group_families(dep: Deployment, queries: Sequence[PoolQuery]) -> GroupFamilies:
    """Families of every rank of ``dep`` for KV and ``queries``' pools. ``ValueError`` if
    a query names a pool the deployment did not register."""
    for q in queries:
        if q.role not in dep.pools:
            raise ValueError(f"deployment {dep.deployment_id!r} registered no "
                             f"{q.role.value!r} pool (it has {[p.value for p in dep.pools]})")
    extra = {q.role: q for q in queries if q.role != PoolName.KV}
    roles = [PoolName.KV, *extra]
    ranks = tuple(((tp, pp), dep.key_scheme(tp, pp))
                  for pp in range(dep.pp_size) for tp in range(dep.tp_size))
    return _group_families(ranks, tuple(dep.pools[r] for r in roles), tuple(extra.values()))

