"""Transfer planning: from a call's ``PoolTransfer``s to one object batch and back.

Pure (no Ray, no Mooncake, no torch): a rank's client plans here, the node actor moves
the bytes. Every check runs before any byte moves; bad input raises ``ValueError``
naming the problem.

- ``check_transfers``: every check of a ``batch_set_v2`` / ``batch_get_v2`` call, once
  (sidecars resolved, page starts checked, object keys named: ``CheckedTransfers``).
- ``plan_transfers``: those objects as one ``ObjectBatch`` (keys, pool, byte offset, byte
  size per object) and, from the node actor's per-object codes, ``{PoolName: [bool per
  page]}`` (``TransferPlan``); a call through staging pools lays out each round's
  objects itself (``TransferPlan.add``, ``cache_actors.rank.staging_pools``).
- ``check_hit_query`` and ``exists_families``: the keys, per-role queries and object
  families of a hit query (``group_search.search`` turns the codes into the hit).

Units: ``host_indices`` count token slots (``page_size`` per page, see ``PoolLayout``);
offsets and sizes count bytes from the start of a pool's shared memory.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransfer
from raykv.controllers.deployments import PoolQuery, PoolSpec
from raykv.controllers.families import GroupFamilies, rank_families
from raykv.controllers.keys import KeyScheme
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


def pool_role(name: PoolName | str) -> PoolName:
    """``name`` as a role (``PoolName``); ``ValueError`` listing the known ones otherwise."""
    try:
        return PoolName(name)
    except ValueError:
        raise ValueError(f"unknown pool name {name!r}; expected one of "
                         f"{[p.value for p in PoolName]}") from None


def registered(pools: Mapping[PoolName, PlanPool], role: PoolName) -> PlanPool:
    """``pools[role]``; ``ValueError`` naming the call that registers it otherwise."""
    pool = pools.get(role)
    if pool is None:
        hint = ("register_mem_pool_host(pool)" if role == PoolName.KV
                else f"register_mem_host_pool_v2(pool, PoolName.{role.name})")
        raise ValueError(f"no {role.value!r} host pool is registered: call {hint}")
    return pool


@dataclass(frozen=True)
class PlanPool:
    """A pool registered for a role, as planning sees it: ``pool_name``, its name on the
    node (what an ``ObjectBatch`` names each object's pool by; "": a layout registered
    alone, no pool, which moves no pages), and its ``layout``."""

    pool_name: str
    layout: PoolLayout

    def spec(self, role: PoolName) -> PoolSpec:
        """What the key rules need of this pool registered as ``role``, and what its
        bytes are (dtypes, page size, order, bytes per page object)."""
        layout = self.layout
        return PoolSpec(role, layout.kind, tuple(b.name for b in layout.buffers),
                        tuple(b.dtype for b in layout.buffers), layout.page_size,
                        layout.order, tuple(layout.object_sizes))


@dataclass(frozen=True)
class PoolPages:
    """One role's pages in a call, checked: ``objects`` (the object keys, page by page,
    ``per_page`` each, in key order) and ``starts`` (the first token slot of each page in
    the memory the call's host indices name: ``pool.layout``)."""

    role: PoolName
    pool: PlanPool
    objects: list[str]
    per_page: int
    starts: list[int]

    def pages(self, lo: int, hi: int) -> PoolPages:
        """Pages ``lo`` to ``hi - 1`` of this part."""
        return PoolPages(self.role, self.pool, self.objects[lo * self.per_page:
                                                            hi * self.per_page],
                         self.per_page, self.starts[lo:hi])


@dataclass
class CheckedTransfers:
    """A call's transfers after every check: ``parts`` (roles whose pages go to the
    store) and ``fixed`` (per role, results decided without the store: a replicated
    pool on a rank that does not write it, a disabled pool)."""

    parts: list[PoolPages] = field(default_factory=list)
    fixed: dict[PoolName, list[bool]] = field(default_factory=dict)


@dataclass
class TransferPlan:
    """One data call's objects, all in ``batch``: ``spans[role] = (first object, objects
    per page, pages)``; ``starts[role]``: the first token slot of each page of a role in
    the batch (in the pool the batch names); ``fixed[role]``: results decided without
    the store."""

    batch: ObjectBatch = field(default_factory=ObjectBatch)
    spans: dict[PoolName, tuple[int, int, int]] = field(default_factory=dict)
    starts: dict[PoolName, list[int]] = field(default_factory=dict)
    fixed: dict[PoolName, list[bool]] = field(default_factory=dict)

    def add(self, part: PoolPages, pool_name: str, layout: PoolLayout,
            starts: Sequence[int]) -> None:
        """Lay out ``part``'s objects in ``batch``: its pages at ``starts`` (first slots)
        of pool ``pool_name`` of ``layout`` (the role's own pool, or the staging pool its
        pages go through)."""
        starts = list(starts)
        self.spans[part.role] = (len(self.batch), part.per_page, len(starts))
        self.starts[part.role] = starts
        self.batch.extend(part.objects, pool_name, layout.object_offsets(starts),
                          layout.object_sizes * len(starts))

    def results(self, ok: Sequence[bool]) -> dict[PoolName, list[bool]]:
        """Per role, one bool per page: every object of the page ``ok`` (``ok`` holds
        one bool per object of ``batch``)."""
        out = dict(self.fixed)
        for role, (first, per_page, pages) in self.spans.items():
            objects = ok[first:first + pages * per_page]
            out[role] = (list(objects) if per_page == 1 else  # one object per page
                         [all(objects[p * per_page:(p + 1) * per_page]) for p in range(pages)])
        return out

    def stored(self, codes: Sequence[int]) -> dict[PoolName, list[bool]]:
        """Per-page results of a put from its per-object codes."""
        return self.results(self.batch.stored(codes))

    def read(self, codes: Sequence[int]) -> dict[PoolName, list[bool]]:
        """Per-page results of a get from its per-object codes (a page: read in full)."""
        return self.results(self.batch.read_in_full(codes))


def _by_role(transfers: Sequence[PoolTransfer]) -> dict[PoolName, PoolTransfer]:
    if isinstance(transfers, PoolTransfer) or not isinstance(transfers, Sequence) \
            or not transfers:
        raise ValueError("transfers must be a non-empty list of PoolTransfer")
    by_role: dict[PoolName, PoolTransfer] = {}
    for t in transfers:
        if not isinstance(t, PoolTransfer):
            raise ValueError(f"transfers holds a {type(t).__name__}, not a PoolTransfer")
        role = pool_role(t.name)
        if role in by_role:
            raise ValueError(f"pool {role.value!r} appears twice in one call")
        by_role[role] = t
    return by_role


def _resolve(role: PoolName, t: PoolTransfer,
             by_role: Mapping[PoolName, PoolTransfer]) -> tuple[list[str], object]:
    """Keys and host indices of a transfer, a sidecar's taken from its source pool."""
    if t.indices_from_pool is None:
        if t.host_indices is None:
            raise ValueError(f"pool {role.value!r}: the transfer has no host_indices")
        return check_keys(t.keys), t.host_indices
    if t.host_indices is not None:
        raise ValueError(f"pool {role.value!r}: give host_indices or indices_from_pool, "
                         "not both")
    src_role = pool_role(t.indices_from_pool)
    src = by_role.get(src_role)
    if src is None or src.indices_from_pool is not None or src.host_indices is None:
        raise ValueError(f"pool {role.value!r} takes its indices from pool "
                         f"{src_role.value!r}, which has no transfer with host_indices in "
                         "this call")
    return check_keys(t.keys if t.keys is not None else src.keys), src.host_indices


def _slots(indices: object) -> object:
    """Host indices as ``PoolLayout.page_starts`` takes them (a tensor, on any device,
    is brought to host memory through its own ``cpu()``/``numpy()``; one in host memory
    is viewed without a copy)."""
    if getattr(indices, "is_cpu", False):
        return indices.numpy()
    return indices.cpu().numpy() if callable(getattr(indices, "cpu", None)) else indices


def check_transfers(transfers: Sequence[PoolTransfer], pools: Mapping[PoolName, PlanPool],
                    keys: KeyScheme, *, write: bool,
                    disabled: Collection[PoolName] = ()) -> CheckedTransfers:
    """Validate ``transfers`` once: sidecars resolved to their source's host indices,
    every page start checked against its pool's layout, object keys named.

    ``pools``: the registered pools by role; ``keys``: the rank's key scheme; ``write``:
    a put (every rank puts its replicated pools' objects too: put-if-absent stores them
    once, and a rank reports stored only what the store holds); ``disabled``: pools
    whose pages fail without the store.
    ``ValueError`` for bad input: not a list of transfers, a pool named twice or unknown
    or not registered, bad keys or host indices, a sidecar without its source, an object
    named twice.
    """
    by_role = _by_role(transfers)
    out = CheckedTransfers()
    for role, t in by_role.items():
        page_hashes, idx = _resolve(role, t, by_role)
        if role in disabled:
            out.fixed[role] = [False] * len(page_hashes)
            continue
        pool = registered(pools, role)
        if not pool.pool_name:
            raise ValueError(f"the {role.value!r} pool is registered as a layout alone "
                             "(group queries only): it moves no pages")
        layout = pool.layout
        try:
            starts = layout.page_starts(_slots(idx), len(page_hashes))
        except ValueError as e:
            raise ValueError(f"pool {role.value!r}: {e}") from None
        suffixes = keys.suffixes(role, layout.kind, [b.name for b in layout.buffers])
        out.parts.append(PoolPages(role, pool, [keys.prefix + h + s for h in page_hashes
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
        plan.add(part, part.pool.pool_name, part.pool.layout, part.starts)
    return plan


def check_hit_query(keys: Sequence[str], transfers: Sequence[PoolTransfer],
                    pools: Mapping[PoolName, PlanPool],
                    disabled: Collection[PoolName] = ()) -> tuple[list[str], list[PoolQuery]]:
    """Validate a hit query (``batch_exists_v2``, ``group_exists``): its page keys, a
    registered KV pool and, per extra pool of ``transfers``, its (role, hit policy,
    window) query. KV is implied and pools in
    ``disabled`` are left out. A ``trailing_pages`` window is the number of the
    transfer's keys (1 if none). ``ValueError`` for bad input."""
    keys = check_keys(keys)
    registered(pools, PoolName.KV)
    queries: dict[PoolName, PoolQuery] = {}
    for t in transfers:
        if not isinstance(t, PoolTransfer):
            raise ValueError(f"transfers holds a {type(t).__name__}, not a PoolTransfer")
        role = pool_role(t.name)
        try:
            policy = PoolHitPolicy(t.hit_policy)
        except ValueError:
            raise ValueError(f"pool {role.value!r}: unknown hit policy {t.hit_policy!r}; "
                             f"expected one of {[p.value for p in PoolHitPolicy]}") from None
        if role == PoolName.KV or role in disabled:
            continue
        if role in queries:
            raise ValueError(f"pool {role.value!r} appears twice in one call")
        registered(pools, role)
        queries[role] = PoolQuery(role, policy, len(t.keys) if t.keys else 1)
    return keys, list(queries.values())


def exists_families(queries: Sequence[PoolQuery], pools: Mapping[PoolName, PlanPool],
                    keys: KeyScheme, rank: tuple[int, int]) -> GroupFamilies:
    """The object families of KV and of each queried pool of one ``rank`` (tp, pp), as
    ``check_hit_query`` validated them: ``group_search.search`` resolves the hit."""
    return rank_families(keys, rank, tuple(pools[r].spec(r) for r in
                                           (PoolName.KV, *(q.role for q in queries))),
                         tuple(queries))
