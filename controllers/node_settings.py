"""How every node actor of a cluster joins the store, and the defaults of it all, in one
place (pure: no Ray, no Mooncake). ``raykv up`` (``clusters.cli``), ``start_local``
(``clusters.local``), ``clusters.deploy`` and the reconciler (``clusters.node_actors``)
build one ``NodeSettings`` and hand it whole to every node actor
(``cache_actors.node.node_actor``, one argument per field); their own defaults are read
from ``DEFAULTS`` here, never written again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from raykv.controllers.object_seal import check_seal_key
from raykv.controllers.ownership import check_tenant_digests
from raykv.controllers.tenant_quotas import check_tenant_quotas

STANDALONE_POOL_BYTES = 1 << 30
"""Each node's host pool budget in standalone mode when none is given (what the node
requests from ``mooncake_client``), in bytes."""



def pool_budget(host_pool_bytes: int | None, standalone: bool) -> int:
    """``host_pool_bytes``, or when None its default by mode: no limit embedded (0),
    ``STANDALONE_POOL_BYTES`` standalone."""
    if host_pool_bytes is not None:
        return host_pool_bytes
    return STANDALONE_POOL_BYTES if standalone else 0


DISK_BUCKET_BYTES = 8 << 20
"""Bytes per file of a disk tier (Mooncake's offload bucket: ``cache_actors.node.disk_tier``)."""

MIN_DISK_BYTES = 3 * DISK_BUCKET_BYTES
"""The smallest disk tier of a node: Mooncake makes room on a full one by deleting its
oldest bucket for a new one, but with room for fewer than three buckets (measured: 16
MiB) it stopped offloading once one bucket was written, and memory, full of objects
waiting to be offloaded, answered every put -200 from then on (125 of 250 puts stored,
none in the last 100 s)."""

PLACEMENTS = ("own", "any")
"""Where a node's puts place objects (``NodeSettings.placement``)."""
L2_EVICTIONS = ("s3fifo", "lru", "slru")
"""Which ready page an L2 pool evicts first (``NodeSettings.l2_eviction``; the policies:
``cache_actors.node.eviction_order``)."""

PROCESS_ONLY = frozenset({"mooncake_log_level"})
"""``NodeSettings`` fields that set the node actor's process environment (``env``)
rather than an argument of ``NodeCacheActor``."""


@dataclass(frozen=True)
class NodeSettings:
    """How every node actor of a cluster joins the store, passed whole from ``raykv up``
    and ``start_local`` to each node's Mooncake client. Sizes in bytes.

    ``master_address``, ``metadata_server`` and ``cluster_tag`` are filled in by whoever
    starts the cluster (``raykv up``, ``start_local``); ``actor_kwargs`` refuses settings
    without them.

    Transport, in Mooncake's words (embedded mode: the node actor's ``setup`` call;
    standalone: ``mooncake_client``'s flags): ``protocol`` ``tcp`` or ``rdma``;
    ``rdma_devices`` the comma-separated RDMA devices to use (Mooncake's
    ``device_name``; "" lets Mooncake use every device it finds; needs ``rdma``);
    ``local_hostname`` the address the node's Mooncake binds and advertises (None: the
    node's IP as Ray sees it); ``local_buffer_size`` the client's own transfer buffer;
    ``mooncake_log_level`` Mooncake's ``MC_LOG_LEVEL`` in every client process.

    ``standalone`` runs each node's segment in a supervised ``mooncake_client`` process
    (see ``cache_actors.node.node_store``); ``host_pool_bytes`` is each node's budget for
    host pools (0: no limit, embedded mode only). ``group_window_s`` bounds how long a
    group hit answer is kept for the ranks of the group that have not asked yet.
    ``confirm_ttl_s`` is how long group queries trust a page the store confirmed
    present; it must stay below the master's ``default_kv_lease_ttl`` (10 s by default),
    0 turns it off.
    ``tenant_quotas``: tenant -> bytes of host pools its deployments may hold on each
    node (``controllers.tenant_quotas``; none: only ``host_pool_bytes`` bounds them).
    ``tenant_digests``: tenant -> its tenant digest, the public owner key (``raykv
    tenant-digest``), bound on every node and the controller from the start instead of
    on first use; ``bound_tenants_only``: bind no other tenant, so nobody can fill the
    tenant tables (``controllers.ownership``).
    ``untenanted_pool_bytes``: the most bytes each node's host pools without a tenant
    hold together (they need no secret: anyone in the Ray cluster can make them), so
    they cannot take the node's memory from the tenants (``controllers.tenant_quotas``);
    None: the default, ``UNTENANTED_SHARE`` (half) of the node's memory in embedded
    mode and none beyond ``host_pool_bytes`` in standalone mode; 0: no bound.
    ``l2_bytes``: the most bytes each node's L2 pools (vLLM's node-local cache) hold
    together, within ``host_pool_bytes`` and the tenants' quotas (0: no L2).
    ``l2_warm_bytes``: the most bytes a warm-up reads into an L2 pool new on a node (the
    hottest pages of its deployment's rank, from L3: ``cache_actors.node.l2_warmup``;
    0: no warm-up); ``l2_warm_s``: the most seconds one runs. ``l2_eviction``: which
    ready page an L2 pool evicts first (``L2_EVICTIONS``: ``s3fifo``, the default, pages
    never used since they came in before used ones; ``lru``, the least recently used;
    ``slru``, pages used once before pages used again; why: docs/benchmarks.md,
    "Eviction and the L2 split").
    ``placement``: where a node's puts go (``PLACEMENTS``): ``own``, on the node's own
    segment while it has room and anywhere else after (embedded mode; standalone puts
    keep Mooncake's placement); ``any``, Mooncake's own choice, a random segment.
    ``disk_dir``: the directory on every node under which its disk tier lives (one
    slot per node actor: ``cache_actors.node.disk_tier``; "": no disk tier);
    ``disk_bytes``: the most bytes each node's disk tier holds (at least
    ``MIN_DISK_BYTES``). ``seal_key``: the
    cluster's seal key (64 hex digits, ``controllers.object_seal``), filled in by
    whoever starts a cluster with a disk tier; with it every object is sealed and every
    get verified. Standalone mode has no disk tier (its ``mooncake_client`` owns the
    segment, and raykv cannot verify what it offloads).

    ``merge_max_inflight``: store calls in flight per node actor, each carrying the
    concurrent ranks' batches that queued meanwhile (``cache_actors.node.transfer_merger``;
    0: no merging, each rank's batch its own call); ``merge_max_objects``: the most
    objects one merged call carries (a bigger single batch goes alone).
    """

    master_address: str = ""
    metadata_server: str = ""
    cluster_tag: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 16 << 20
    protocol: str = "tcp"
    rdma_devices: str = ""
    local_hostname: str | None = None
    mooncake_log_level: str = "ERROR"
    standalone: bool = False
    host_pool_bytes: int = 0
    group_window_s: float = 2.0
    confirm_ttl_s: float = 2.0
    tenant_quotas: dict[str, int] = field(default_factory=dict)
    tenant_digests: dict[str, str] = field(default_factory=dict)
    bound_tenants_only: bool = False
    untenanted_pool_bytes: int | None = None
    l2_bytes: int = 1 << 30
    l2_warm_bytes: int = 256 << 20
    l2_warm_s: float = 30.0
    l2_eviction: str = "s3fifo"
    placement: str = "own"
    disk_dir: str = ""
    disk_bytes: int = 0
    seal_key: str = field(default="", repr=False)
    merge_max_inflight: int = 1
    merge_max_objects: int = 2048

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_quotas", check_tenant_quotas(self.tenant_quotas))
        object.__setattr__(self, "tenant_digests", check_tenant_digests(self.tenant_digests))
        if self.untenanted_pool_bytes is not None and (
                type(self.untenanted_pool_bytes) is not int or self.untenanted_pool_bytes < 0):
            raise ValueError(f"untenanted_pool_bytes must be None or an int >= 0, got "
                             f"{self.untenanted_pool_bytes!r}")
        if type(self.l2_bytes) is not int or self.l2_bytes < 0:
            raise ValueError(f"l2_bytes must be an int >= 0, got {self.l2_bytes!r}")
        if type(self.l2_warm_bytes) is not int or self.l2_warm_bytes < 0:
            raise ValueError(f"l2_warm_bytes must be an int >= 0, got {self.l2_warm_bytes!r}")
        if type(self.l2_warm_s) not in (int, float) or not 0 < self.l2_warm_s < math.inf:
            raise ValueError(f"l2_warm_s must be seconds > 0, got {self.l2_warm_s!r}")
        if self.l2_eviction not in L2_EVICTIONS:
            raise ValueError(f"l2_eviction must be one of {L2_EVICTIONS}, got "
                             f"{self.l2_eviction!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        if self.confirm_ttl_s < 0:
            raise ValueError(f"confirm_ttl_s must be >= 0, got {self.confirm_ttl_s}")
        if self.standalone and self.host_pool_bytes <= 0:
            raise ValueError(f"standalone mode needs host_pool_bytes > 0, got "
                             f"{self.host_pool_bytes}")
        if bool(self.disk_dir) != (self.disk_bytes > 0):
            raise ValueError(f"a disk tier needs both disk_dir and disk_bytes > 0, got "
                             f"{self.disk_dir!r} and {self.disk_bytes}")
        if self.disk_dir and self.disk_bytes < MIN_DISK_BYTES:
            raise ValueError(f"a disk tier needs disk_bytes >= {MIN_DISK_BYTES} (three "
                             f"offload buckets), got {self.disk_bytes}")
        if self.disk_dir and self.standalone:
            raise ValueError("standalone mode has no disk tier: drop disk_dir or standalone")
        if self.seal_key:
            check_seal_key(self.seal_key)
        if type(self.merge_max_inflight) is not int or self.merge_max_inflight < 0:
            raise ValueError(f"merge_max_inflight must be an int >= 0, got "
                             f"{self.merge_max_inflight!r}")
        if type(self.merge_max_objects) is not int or self.merge_max_objects < 1:
            raise ValueError(f"merge_max_objects must be an int >= 1, got "
                             f"{self.merge_max_objects!r}")
        if self.rdma_devices and self.protocol != "rdma":
            raise ValueError(f"rdma_devices={self.rdma_devices!r} needs protocol 'rdma', "
                             f"got {self.protocol!r}")

    @property
    def mode(self) -> str:
        return "standalone" if self.standalone else "embedded"

    @property
    def env(self) -> dict[str, str]:
        """Environment of every Mooncake client process of the cluster."""
        return {"MC_LOG_LEVEL": self.mooncake_log_level}

    def actor_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``NodeCacheActor`` after the node id: every field,
        whole, except ``mooncake_log_level`` (it reaches the actor as ``env``).
        ``ValueError`` if the master, metadata server or cluster tag is not filled in."""
        missing = [name for name in ("master_address", "metadata_server", "cluster_tag")
                   if not getattr(self, name)]
        if self.disk_dir and not self.seal_key:
            missing.append("seal_key")
        if missing:
            raise ValueError(f"node settings without {', '.join(missing)}")
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in PROCESS_ONLY}


DEFAULTS = NodeSettings()
"""The default of every setting (``raykv up``'s options, ``start_local``'s arguments)."""
