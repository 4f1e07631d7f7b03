"""Transfer planning: from a call's ``PoolTransfer``s to one object batch and back.

Pure (no Ray, no Mooncake, no torch): a rank's client plans here, the node actor moves
the bytes. Every check runs before any byte moves; bad input raises ``ValueError``
naming the problem.

- ``check_transfers``: every check of a ``batch_set_v2`` / ``batch_get_v2`` call, once
  (sidecars resolved, page starts checked, object keys named: ``CheckedTransfers``).
- ``plan_transfers``: those objects as one ``ObjectBatch`` (keys, pool, byte offset, byte
  size per object) and, from the node actor's per-object codes, ``{PoolName: [bool per
  page]}`` (``TransferPlan``); a call through staging pools lays out each round's
  objects itself (``TransferPlan.add``, ``cache_actors.rank.engine_pools``).
- ``check_exists`` and ``exists_families``: the keys, per-pool hit queries and object
  families of an exists call (``group_search.search`` turns the codes into the hit).

Units: ``host_indices`` count token slots (``page_size`` per page, see ``PoolLayout``);
offsets and sizes count bytes from the start of a pool's shared segment.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransfer
from raykv.controllers.deployments import PoolQuery, PoolSpec
from raykv.controllers.group_search import GroupFamilies, rank_families
from raykv.controllers.keys import KeyScheme, is_replicated
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout


def check_keys(keys: Sequence[str]) -> list[str]:
    """Return ``keys`` as a list; ``ValueError`` if empty, not strings, empty or repeated."""
    if isinstance(keys, str) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list of strings, got {type(keys).__name__}")
    if not keys:
        raise ValueError("keys is empty")
    keys = list(keys)
    try:  # the common case at the cost of one set; the loop below names what is wrong
        if set(map(type, keys)) == {str} and len(unique := set(keys)) == len(keys) \
                and "" not in unique:
            return keys
    except TypeError:  # an unhashable key
        pass
    seen: dict[str, int] = {}
    for i, k in enumerate(keys):
        if not isinstance(k, str) or not k:
            raise ValueError(f"key {i} is {k!r}: keys must be non-empty strings")
        if k in seen:
            raise ValueError(f"key {k!r} appears at positions {seen[k]} and {i}")
        seen[k] = i
    return keys


def pool_name(name: PoolName | str) -> PoolName:
    """``name`` as a ``PoolName``; ``ValueError`` listing the known names otherwise."""
    try:
        return PoolName(name)
    except ValueError:
        raise ValueError(f"unknown pool name {name!r}; expected one of "
                         f"{[p.value for p in PoolName]}") from None


def registered(pools: Mapping[PoolName, PlanPool], name: PoolName) -> PlanPool:
    """``pools[name]``; ``ValueError`` naming the call that registers it otherwise."""
    pool = pools.get(name)
    if pool is None:
        hint = ("register_mem_pool_host(pool)" if name == PoolName.KV
                else f"register_mem_host_pool_v2(pool, PoolName.{name.name})")
        raise ValueError(f"no {name.value!r} host pool is registered: call {hint}")
    return pool


@dataclass(frozen=True)
class PlanPool:
    """A registered pool as planning sees it: ``name``, the pool (shared segment) that
    batches name, and its ``layout``."""

    name: str
    layout: PoolLayout

    def spec(self, role: PoolName) -> PoolSpec:
        """What the key rules need of this pool registered as ``role``."""
        return PoolSpec(role, self.layout.kind, tuple(b.name for b in self.layout.buffers))


@dataclass(frozen=True)
class PoolPages:
    """One pool's pages in a call, checked: ``objects`` (the object keys, page by page,
    ``per_page`` each, in key order) and ``starts`` (the first token slot of each page in
    the memory the call's host indices name: ``pool.layout``)."""

    name: PoolName
    pool: PlanPool
    objects: list[str]
    per_page: int
    starts: list[int]

    def pages(self, lo: int, hi: int) -> PoolPages:
        """Pages ``lo`` to ``hi - 1`` of this part."""
        return PoolPages(self.name, self.pool, self.objects[lo * self.per_page:
                                                            hi * self.per_page],
                         self.per_page, self.starts[lo:hi])


@dataclass
class CheckedTransfers:
    """A call's transfers after every check: ``parts`` (pools whose pages go to the
    store) and ``fixed`` (per pool, results decided without the store: a replicated
    pool on a rank that does not write it, a disabled pool)."""

    parts: list[PoolPages] = field(default_factory=list)
    fixed: dict[PoolName, list[bool]] = field(default_factory=dict)


@dataclass
class TransferPlan:
    """One data call's objects, all in ``batch``: ``spans[pool] = (first object, objects
    per page, pages)``; ``starts[pool]``: the first token slot of each page of a pool in
    the batch (in the pool the batch names); ``fixed[pool]``: results decided without
    the store."""

    batch: ObjectBatch = field(default_factory=ObjectBatch)
    spans: dict[PoolName, tuple[int, int, int]] = field(default_factory=dict)
    starts: dict[PoolName, list[int]] = field(default_factory=dict)
    fixed: dict[PoolName, list[bool]] = field(default_factory=dict)

    def add(self, part: PoolPages, pool: str, layout: PoolLayout,
            starts: Sequence[int]) -> None:
        """Lay out ``part``'s objects in ``batch``: its pages at ``starts`` (first slots)
        of pool ``pool`` of ``layout`` (the part's own pool, or the staging pool its
        pages go through)."""
        starts = list(starts)
        self.spans[part.name] = (len(self.batch), part.per_page, len(starts))
        self.starts[part.name] = starts
        self.batch.extend(part.objects, pool, layout.object_offsets(starts),
                          layout.object_sizes * len(starts))

    def results(self, ok: Sequence[bool]) -> dict[PoolName, list[bool]]:
        """Per pool, one bool per page: every object of the page ``ok`` (``ok`` holds
        one bool per object of ``batch``)."""
        out = dict(self.fixed)
        for name, (first, per_page, pages) in self.spans.items():
            out[name] = [all(ok[first + p * per_page:first + (p + 1) * per_page])
                         for p in range(pages)]
        return out

    def stored(self, codes: Sequence[int]) -> dict[PoolName, list[bool]]:
        """Per-page results of a put from its per-object codes."""
        return self.results(self.batch.stored(codes))

    def read(self, codes: Sequence[int]) -> dict[PoolName, list[bool]]:
        """Per-page results of a get from its per-object codes (a page: read in full)."""
        return self.results(self.batch.read_in_full(codes))


def _by_name(transfers: Sequence[PoolTransfer]) -> dict[PoolName, PoolTransfer]:
    if isinstance(transfers, PoolTransfer) or not isinstance(transfers, Sequence) \
            or not transfers:
        raise ValueError("transfers must be a non-empty list of PoolTransfer")
    by_name: dict[PoolName, PoolTransfer] = {}
    for t in transfers:
        if not isinstance(t, PoolTransfer):
            raise ValueError(f"transfers holds a {type(t).__name__}, not a PoolTransfer")
        name = pool_name(t.name)
        if name in by_name:
            raise ValueError(f"pool {name.value!r} appears twice in one call")
        by_name[name] = t
    return by_name


def _resolve(name: PoolName, t: PoolTransfer,
             by_name: Mapping[PoolName, PoolTransfer]) -> tuple[list[str], object]:
    """Keys and host indices of a transfer, a sidecar's taken from its source pool."""
    if t.indices_from_pool is None:
        if t.host_indices is None:
            raise ValueError(f"pool {name.value!r}: the transfer has no host_indices")
        return check_keys(t.keys), t.host_indices
    if t.host_indices is not None:
        raise ValueError(f"pool {name.value!r}: give host_indices or indices_from_pool, "
                         "not both")
    src_name = pool_name(t.indices_from_pool)
    src = by_name.get(src_name)
    if src is None or src.indices_from_pool is not None or src.host_indices is None:
        raise ValueError(f"pool {name.value!r} takes its indices from pool "
                         f"{src_name.value!r}, which has no transfer with host_indices in "
                         "this call")
    return check_keys(t.keys if t.keys is not None else src.keys), src.host_indices


def _slots(indices: object) -> object:
    """Host indices as ``PoolLayout.page_starts`` takes them (a tensor, on any device,
    is brought to host memory through its own ``cpu()``/``numpy()``)."""
    return indices.cpu().numpy() if callable(getattr(indices, "cpu", None)) else indices


def check_transfers(transfers: Sequence[PoolTransfer], pools: Mapping[PoolName, PlanPool],
                    keys: KeyScheme, *, write: bool,
                    disabled: Collection[PoolName] = ()) -> CheckedTransfers:
    """Validate ``transfers`` once: sidecars resolved to their source's host indices,
    every page start checked against its pool's layout, object keys named.

    ``pools``: the registered pools by role; ``keys``: the rank's key scheme; ``write``:
    a put (replicated pools are then written by TP rank 0 only: other ranks get True
    without writing); ``disabled``: pools whose pages fail without the store.
    ``ValueError`` for bad input: not a list of transfers, a pool named twice or unknown
    or not registered, bad keys or host indices, a sidecar without its source, an object
    named twice.
    """
    by_name = _by_name(transfers)
    out = CheckedTransfers()
    for name, t in by_name.items():
        page_hashes, idx = _resolve(name, t, by_name)
        if name in disabled:
            out.fixed[name] = [False] * len(page_hashes)
            continue
        pool = registered(pools, name)
        layout = pool.layout
        try:
            starts = layout.page_starts(_slots(idx), len(page_hashes))
        except ValueError as e:
            raise ValueError(f"pool {name.value!r}: {e}") from None
        if write and is_replicated(name, layout.kind) and not keys.writes_replicated:
            out.fixed[name] = [True] * len(page_hashes)
            continue
        suffixes = keys.suffixes(name, layout.kind, [b.name for b in layout.buffers])
        out.parts.append(PoolPages(name, pool, [keys.prefix + h + s for h in page_hashes
                                                for s in suffixes], len(suffixes), starts))
    objects = [k for part in out.parts for k in part.objects]
    if len(set(objects)) != len(objects):
        raise ValueError("the transfers name the same object twice")
    return out


def plan_transfers(transfers: Sequence[PoolTransfer], pools: Mapping[PoolName, PlanPool],
                   keys: KeyScheme, *, write: bool, epoch: int,
                   disabled: Collection[PoolName] = ()) -> TransferPlan:
    """Validate ``transfers`` (``check_transfers``) and lay out their objects in one
    batch at their own pools' offsets; ``epoch``: that of the pool handles
    (``ObjectBatch.epoch``)."""
    checked = check_transfers(transfers, pools, keys, write=write, disabled=disabled)
    plan = TransferPlan(fixed=dict(checked.fixed))
    plan.batch.epoch = epoch
    for part in checked.parts:
        plan.add(part, part.pool.name, part.pool.layout, part.starts)
    return plan


def check_exists(keys: Sequence[str], transfers: Sequence[PoolTransfer],
                 pools: Mapping[PoolName, PlanPool],
                 disabled: Collection[PoolName] = ()) -> tuple[list[str], list[PoolQuery]]:
    """Validate an exists call: its page keys, a registered KV pool and, per extra pool
    of ``transfers``, its (pool, hit policy, window) query. KV is implied and pools in
    ``disabled`` are left out. A ``trailing_pages`` window is the number of the
    transfer's keys (1 if none). ``ValueError`` for bad input."""
    keys = check_keys(keys)
    registered(pools, PoolName.KV)
    queries: dict[PoolName, PoolQuery] = {}
    for t in transfers:
        if not isinstance(t, PoolTransfer):
            raise ValueError(f"transfers holds a {type(t).__name__}, not a PoolTransfer")
        name = pool_name(t.name)
        try:
            policy = PoolHitPolicy(t.hit_policy)
        except ValueError:
            raise ValueError(f"pool {name.value!r}: unknown hit policy {t.hit_policy!r}; "
                             f"expected one of {[p.value for p in PoolHitPolicy]}") from None
        if name == PoolName.KV or name in disabled:
            continue
        if name in queries:
            raise ValueError(f"pool {name.value!r} appears twice in one call")
        registered(pools, name)
        queries[name] = PoolQuery(name, policy, len(t.keys) if t.keys else 1)
    return keys, list(queries.values())


def exists_families(queries: Sequence[PoolQuery], pools: Mapping[PoolName, PlanPool],
                    keys: KeyScheme, rank: tuple[int, int]) -> GroupFamilies:
    """The object families of KV and of each queried pool of one ``rank`` (tp, pp), as
    ``check_exists`` validated them: ``group_search.search`` resolves the hit."""
    return rank_families(keys, rank, [pools[n].spec(n)
                                      for n in (PoolName.KV, *(q.name for q in queries))],
                         queries)
