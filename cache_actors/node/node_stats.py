"""What a node actor's ``stats`` shows, assembled from its parts into a ``NodeStats``
(``controllers.node_records``; pure: no Ray, no Mooncake; ``NodeService.stats`` gathers
the parts, on a thread of the ``pools`` group, the actor adds the rest).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from raykv.controllers.node_records import (
    L2EvictionStats,
    L2Stats,
    LoadStats,
    NodeStats,
    PoolOwner,
    PoolStats,
    ResidencyStats,
    StoreStats,
    TenantUse,
    WarmupStats,
)
from raykv.controllers.ownership import Owner

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_metrics import NodeMetrics
    from raykv.cache_actors.node.node_pools import PoolTable


def node_stats(table: PoolTable, quotas: Mapping[str, int], store: StoreStats,
               metrics: NodeMetrics, *, node_id: str, uptime_s: float, segment_size: int,
               confirmed_pages: int, l2: L2Stats, warnings: list[str],
               residency: ResidencyStats, warmup: WarmupStats,
               l2_evictions: L2EvictionStats, loads: LoadStats) -> NodeStats:
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
    (``cache_actors.node.transfer_merger``); ``l2``: the L2 cache (``L2Pools.stats``);
    then ``warnings`` (the actor's, said at start), ``residency`` (``ResidencyQuery``),
    ``warmup`` (``L2Warmup``), ``l2_evictions`` (``L2Evictions``) and ``loads``
    (``LoadEstimates``)."""
    tenants = table.tenants(quotas)
    return NodeStats(
        mode=store.mode, host_pool_bytes=store.host_pool_bytes,
        host_pool_used=store.host_pool_used, exposed_ports=store.exposed_ports,
        mooncake_endpoint=store.mooncake_endpoint, own_segment=store.own_segment,
        mooncake_client=store.mooncake_client, tiers=store.tiers,
        node_id=node_id,
        uptime_s=uptime_s,
        global_segment_size=segment_size,
        pools=pool_view(table, metrics.pool_counters),
        tenants={t: use for t, use in tenants.items() if t is not None},
        untenanted=tenants.get(None, TenantUse()),
        counters=metrics.counters(),
        group_queries=metrics.group_queries(),
        confirmed_pages=confirmed_pages,
        merged_calls=metrics.merged_calls(),
        l2=l2,
        warnings=warnings, residency=residency, warmup=warmup,
        l2_evictions=l2_evictions, loads=loads)


def pool_view(table: PoolTable,
              counters_of: Callable[[str], dict[str, int]]) -> dict[str, PoolStats]:
    """Per pool of ``table``: its ``kind``, ``bytes``, ``pages``, ``owner`` (deployment
    and tenant, never a proof; None: legacy) and its object ``counters``
    (``counters_of(name)``)."""
    return {n: PoolStats(kind=p.handle.layout.kind, bytes=p.nbytes,
                         pages=p.handle.layout.num_pages,
                         owner=pool_owner(table.owners.get(n)), counters=counters_of(n))
            for n, p in table.pools.items()}


def pool_owner(owner: Owner | None) -> PoolOwner | None:
    """A pool owner as ``stats`` shows it (never a proof)."""
    if owner is None:
        return None
    return PoolOwner(deployment=owner.deployment_id, tenant=owner.tenant)
