"""What a node actor's ``stats()`` answers, as typed records (pure): ``NodeStats`` and
its parts, each defined once here; made by the node actor's parts
(``cache_actors.node.node_stats`` assembles them), read by ranks
(``CacheClient.stats``), ``raykv status`` (``clusters.status_view``,
``status_rates``), the benchmarks and the tests. A misspelt field is an
``AttributeError`` (every record has slots), never a silent 0 or new key.

They cross Ray calls as they are (Ray pickles them; the reader imports this module);
the local channel never carries them. Where they leave raykv as JSON (``raykv status
--json``, benchmark results), ``as_dict`` makes the dicts the node actor answered
before they were records: the same keys in the same order, a field marked ``OMITTED``
left out while it is None. Maps keyed by data (pools, tenants, links, tiers, result
codes) stay dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

OMITTED = {"omitted_if_none": True}
"""A field's metadata: ``as_dict`` leaves it out while it is None (as the dicts did)."""


@dataclass(frozen=True, slots=True)
class ClientProcess:
    """The supervised ``mooncake_client`` of a standalone node (``ClientSupervisor``)."""

    pid: int | None
    port: int | None
    adopted: bool
    """Found running at the actor's start (a restarted actor), not started by it."""
    restarts: int
    alive: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """Sealed gets (a cluster with a disk tier: ``SealedObjects``) and the node's disk
    slot (``DiskSlot``; its three fields absent without one)."""

    served: dict[str, int]
    """Objects gets served, by tier (``l3_memory``, ``l3_disk``)."""
    served_bytes: dict[str, int]
    """Bytes gets served, by tier."""
    refused: dict[str, int]
    """Objects refused (seal not verified, or unreadable), by reason."""
    path: str | None = field(default=None, metadata=OMITTED)
    """The disk slot's directory."""
    limit_bytes: int | None = field(default=None, metadata=OMITTED)
    """The disk slot's bound, bytes."""
    used_bytes: int | None = field(default=None, metadata=OMITTED)
    """Bytes in the disk slot now."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """The node's store client (``NodeStore.stats``)."""

    mode: str
    """``embedded`` or ``standalone``."""
    host_pool_bytes: int
    """The host pools' budget, bytes (0: none)."""
    host_pool_used: int
    """Bytes of live pools, each counted once."""
    exposed_ports: list[str]
    """The client's listening sockets that reach beyond their address."""
    mooncake_endpoint: str | None
    """``host:port`` the client tells its peers (the node's address)."""
    own_segment: str | None
    """The segment this node's puts prefer (None: none known)."""
    mooncake_client: ClientProcess | None = field(default=None, metadata=OMITTED)
    """Standalone mode's client process."""
    tiers: TierStats | None = field(default=None, metadata=OMITTED)
    """With seals (``StoreBackend.tier_stats``)."""


@dataclass(frozen=True, slots=True)
class PoolOwner:
    """A pool's owner as stats show it (never a proof)."""

    deployment: str
    tenant: str | None


@dataclass(frozen=True, slots=True)
class PoolStats:
    """One pool of the node."""

    kind: str
    """Its layout's kind (``mha``, ``mla``, ``vllm``, ...)."""
    bytes: int
    pages: int
    owner: PoolOwner | None
    """None: a legacy pool."""
    counters: dict[str, int]
    """Objects by outcome: ``put_ok``, ``put_present``, ``get_ok``, ``<op>_error_<code>``
    (``NodeMetrics.pool_counters``)."""


@dataclass(slots=True)
class TenantUse:
    """The pools of one tenant on the node (or of the pools without one)."""

    pool_bytes: int = 0
    pools: int = 0
    quota: int | None = None
    """Bytes (None: no quota; without a tenant: the bound of those pools)."""


@dataclass(frozen=True, slots=True)
class GroupQueryStats:
    """The group queries this node answered (``NodeMetrics.group_queries``)."""

    recent: int
    """From a recent answer to another rank of the group."""
    inflight: int
    """By joining a lookup in flight."""
    confirmed: int
    """From confirmations alone."""
    looked_up: int
    """With lookups of their own."""
    store_calls: int
    """Store calls (lookups) they made."""
    deployment_fetches: int
    """Deployment copies fetched from the controller for them."""
    store_seconds: float
    """Seconds their store calls took."""


@dataclass(frozen=True, slots=True)
class MergedCallStats:
    """Put/get store calls and the ranks' batches they carried (``TransferMerger``)."""

    calls: int
    batches: int
    largest: int
    """The most batches one call carried."""


@dataclass(frozen=True, slots=True, kw_only=True)
class L2PoolStats:
    """One L2 pool's pages now and its counts since it opened (``L2Index.stats``; the
    counts are also ``raykv_l2_pages`` by event)."""

    pages: int
    ready: int
    dirty: int
    """Of ``ready``, not yet put to L3 (write-behind)."""
    held: int
    """Pages a holder was given (reading or writing)."""
    leased: int
    """Ready pages a lookup found, kept from eviction for now."""
    hits: int
    misses: int
    written: int
    evicted: int
    full: int
    """Reservations that found no page."""
    flushed: int
    """Dirty pages put to L3."""
    aborted: int
    """Reservations given up before their commit."""


@dataclass(frozen=True, slots=True, kw_only=True)
class L2Stats:
    """The node's L2 cache (``L2Pools.stats``); counts in objects."""

    l2_bytes: int
    """The node's L2 bound, bytes."""
    used: int
    """Bytes of the L2 pools open now."""
    pools: dict[str, L2PoolStats]
    filled: int
    """Objects read from L3 into L2 for a load."""
    fill_failed: int
    warmed: int
    """Objects a warm-up read into L2."""
    warm_failed: int
    l3_put_submitted: int
    """Committed objects handed to the write-behind."""
    l3_put: int
    """Of those, put to L3."""
    l3_put_retried: int
    l3_put_failed: int
    """Given up on: in L2 only, a hole in L3."""
    l3_put_pending: int
    """Waiting for a retry."""


@dataclass(frozen=True, slots=True)
class ResidencyStats:
    """Routers' residency queries answered here (``ResidencyQuery``)."""

    queries: int
    """Answered or refused."""
    refused: int
    """Bad input or claim."""
    failed: int
    """Store errors."""
    late: int
    """Past their deadline."""
    seconds: float
    """Spent answering."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Warmup:
    """One warm-up of an L2 pool new on the node (``L2Warmup``)."""

    deployment: str
    rank: list[int]
    """``[tp_rank, pp_rank]``."""
    state: str
    """``queued``, ``running`` or ``done``."""
    pages: int
    """Pages read."""
    bytes: int
    chosen: int
    """Pages chosen to read."""
    stopped: str | None
    """Why it ended (``l2_warmup``'s docstring); None while it runs."""
    seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupStats:
    """The node's warm-ups (``L2Warmup.stats``)."""

    warm_bytes: int
    """The most bytes one warm-up reads (0: off)."""
    warm_s: float
    """The most seconds one runs from its pool's open."""
    pages: int
    """Pages read by every warm-up."""
    bytes: int
    running: int
    """Warm-ups queued or running."""
    warmups: dict[str, Warmup]
    """Per pool, the latest ``KEPT``."""


@dataclass(frozen=True, slots=True)
class L2EvictionStats:
    """The node's L2 eviction record (``L2Evictions``)."""

    evictions: int
    """Recorded since start."""
    kept: int
    """Keys remembered now (what ``raykv why`` can name)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RateView:
    """One load estimate (``LoadCosts.view``)."""

    mb_per_s: float | None
    """MB per second (None: unknown)."""
    fixed_ms: float
    """Fixed cost per call, milliseconds."""
    samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkView(RateView):
    """The estimate of one link (a source segment as this node reads it)."""

    probe_age_s: float | None
    """Seconds since its last link probe (None: never probed)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStats:
    """The node's load estimates (``LoadEstimates.stats``)."""

    links: dict[str, LinkView]
    """Per source segment (``host:port``)."""
    l3_disk: RateView
    """Disk-served gets."""
    overall: RateView
    queue_wait_s: float
    """The wait its queue adds now, seconds."""
    located_keys: int
    """Objects whose place is known (``KeyPlaces``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStats(StoreStats):
    """A node actor's ``stats()``: its store client's (``StoreStats``'s fields, first),
    then what its parts count; every count since the actor started."""

    node_id: str
    uptime_s: float
    global_segment_size: int
    """Bytes of the node's own segment."""
    pools: dict[str, PoolStats]
    tenants: dict[str, TenantUse]
    """Per tenant with pools here or a quota."""
    untenanted: TenantUse
    """The pools without a tenant (their ``quota``: their bound)."""
    counters: dict[str, int]
    """Objects and bytes put and got, errors by Mooncake code, the drains' objects
    (``NodeMetrics.counters``: ``get_objects``, ``get_error_-704``, ...)."""
    group_queries: GroupQueryStats
    confirmed_pages: int
    """Pages confirmed present, trusted without an existence check."""
    merged_calls: MergedCallStats
    l2: L2Stats
    warnings: list[str]
    """What the actor said at start (e.g. both Mooncake wheels installed)."""
    residency: ResidencyStats
    warmup: WarmupStats
    l2_evictions: L2EvictionStats
    loads: LoadStats


@dataclass(frozen=True, slots=True)
class StatsFailed:
    """A node whose ``stats()`` call failed, as ``raykv status`` holds it."""

    error: str
    """The error's first line."""


def as_dict(value: Any) -> Any:
    """``value`` with every record in it (in dicts and lists too) as a dict of its
    fields in order, an ``OMITTED`` field left out while None: the JSON edge."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_dict(v) for f in fields(value)
                if (v := getattr(value, f.name)) is not None
                or not f.metadata.get("omitted_if_none")}
    if isinstance(value, dict):
        return {k: as_dict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(as_dict(v) for v in value)
    return value
