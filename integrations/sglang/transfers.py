"""SGLang's v2 transfers and hit queries as raykv's (pure: no SGLang, no Ray import).

SGLang's ``PoolTransfer``, ``PoolName`` and ``PoolHitPolicy`` are read by their field
names and values, so this runs (and is tested) without SGLang. Transfers are forwarded
one to one: the client checks them once per call (``transfer_plan.check_transfers``:
sidecars resolved, page starts checked against the registered pool).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransfer
from raykv.integrations.sglang.config import SUPPORTED_POOLS

N = TypeVar("N")


def value(x: Any) -> str:
    """The string value of an SGLang (or raykv) enum member, or ``x`` as a string."""
    return str(getattr(x, "value", x))


def pool_of(name: Any) -> PoolName:
    """raykv's ``PoolName`` for SGLang's pool ``name``; ``ValueError`` for a pool raykv
    does not serve."""
    pool = SUPPORTED_POOLS.get(value(name))
    if pool is None:
        raise ValueError(f"pool {value(name)!r} is not registered with raykv")
    return pool


def to_raykv(transfers: Sequence[Any]) -> tuple[list[PoolTransfer], list[Any]]:
    """SGLang's v2 ``transfers`` as raykv's, one to one, and the SGLang names of those
    with an empty key list (not forwarded: they move no page; their result is ``[]``).

    A transfer that carries host indices uses them even if it also names the pool they
    came from (SGLang fills a KV-derived sidecar's indices in itself); one without names
    its source in ``indices_from_pool`` and the client takes that pool's indices (and
    keys, if it has none). ``ValueError`` for a pool raykv does not serve."""
    out, empty = [], []
    for t in transfers:
        name = pool_of(t.name)
        if t.keys is not None and not len(t.keys):
            empty.append(t.name)
            continue
        source = None
        if t.host_indices is None and t.indices_from_pool is not None:
            source = pool_of(t.indices_from_pool)
        out.append(PoolTransfer(name, None if t.keys is None else list(t.keys),
                                t.host_indices, indices_from_pool=source))
    return out, empty


def exists_queries(pool_transfers: Sequence[Any] | None) -> list[PoolTransfer]:
    """The extra pools of a ``batch_exists_v2`` call as raykv hit queries (KV is
    implied); ``ValueError`` for a pool or hit policy raykv does not serve (SGLang's
    ``block_groups``)."""
    queries = []
    for t in pool_transfers or []:
        name = value(t.name)
        if name == PoolName.KV.value:
            continue
        policy = value(t.hit_policy)
        if name not in SUPPORTED_POOLS or policy not in {p.value for p in PoolHitPolicy}:
            raise ValueError(f"pool {name!r} / hit policy {t.hit_policy} not served")
        queries.append(PoolTransfer(SUPPORTED_POOLS[name], list(t.keys or []) or None, None,
                                    PoolHitPolicy(policy)))
    return queries


def results_for(out: dict[PoolName, list[bool]], empty: Sequence[Any],
                sglang_name: Callable[[str], N]) -> dict[N, list[bool]]:
    """The client's per-pool results keyed by SGLang's pool names (``sglang_name`` of a
    value), ``[]`` for each transfer with no keys."""
    result = {sglang_name(n.value): v for n, v in out.items()}
    result.update({sglang_name(value(n)): [] for n in empty})
    return result


def failed(transfers: Sequence[Any]) -> dict[Any, list[bool]]:
    """What a failed v2 call reports: every page of every transfer not moved (a
    sidecar without keys counts as many pages as the call's longest key list)."""
    most = max((len(t.keys or []) for t in transfers), default=0)
    return {t.name: [False] * (len(t.keys) if t.keys is not None else most)
            for t in transfers}
