"""What a node actor's ``stats`` shows, assembled from its parts (pure: no Ray, no
Mooncake; ``NodeService.stats`` gathers the parts, on a thread of the ``pools`` group).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from raykv.controllers.ownership import Owner

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_metrics import NodeMetrics
    from raykv.cache_actors.node.node_pools import PoolTable


def node_stats(table: PoolTable, quotas: Mapping[str, int], store: dict,
               metrics: NodeMetrics, *, node_id: str, uptime_s: float, segment_size: int,
               confirmed_pages: int, l2: dict) -> dict:
    """``store``'s stats (``NodeStore.stats``: the mode, ``host_pool_bytes`` budget (0:
    none) and ``host_pool_used`` (bytes of live pools, each counted once), in standalone
    mode the ``mooncake_client`` process: pid, port, adopted, restarts, alive), then:
    ``node_id``, ``uptime_s``, ``global_segment_size`` (bytes); ``pools``: per pool of
    ``table`` (``pool_view``); ``tenants``: per tenant with pools here or a quota in
    ``quotas``, its ``pool_bytes``, ``pools`` and ``quota`` (bytes, None: none);
    ``untenanted``: the same of the pools without a tenant (under no quota);
    ``counters``: objects and bytes put/got, errors by Mooncake code
    (``NodeMetrics.counters``); ``group_queries``: the group queries answered here
    (``recent``, ``inflight``: shared; ``confirmed``: from confirmations alone;
    ``looked_up``: own lookups; ``store_calls``, ``store_seconds``,
    ``deployment_fetches``: ``NodeMetrics.group_queries``); ``confirmed_pages`` held;
    ``merged_calls``: put/get store calls made and the ranks' batches they carried
    (``cache_actors.node.transfer_merger``); ``l2``: the L2 cache (``L2Pools.stats``)."""
    tenants = table.tenants(quotas)
    return {
        **store,
        "node_id": node_id,
        "uptime_s": uptime_s,
        "global_segment_size": segment_size,
        "pools": pool_view(table, metrics.pool_counters),
        "tenants": {t: use for t, use in tenants.items() if t is not None},
        "untenanted": tenants.get(None, {"pool_bytes": 0, "pools": 0, "quota": None}),
        "counters": metrics.counters(),
        "group_queries": metrics.group_queries(),
        "confirmed_pages": confirmed_pages,
        "merged_calls": metrics.merged_calls(),
        "l2": l2,
    }


def pool_view(table: PoolTable, counters_of: Callable[[str], dict]) -> dict[str, dict]:
    """Per pool of ``table``: its ``kind``, ``bytes``, ``pages``, ``owner`` (deployment
    and tenant, never a proof; None: legacy) and its object ``counters``
    (``counters_of(name)``)."""
    return {n: {"kind": p.handle.layout.kind, "bytes": p.nbytes,
                "pages": p.handle.layout.num_pages, "owner": owner_dict(table.owners.get(n)),
                "counters": counters_of(n)}
            for n, p in table.pools.items()}


def owner_dict(owner: Owner | None) -> dict | None:
    """A pool owner as ``stats`` shows it (never a proof)."""
    if owner is None:
        return None
    return {"deployment": owner.deployment_id, "tenant": owner.tenant}
