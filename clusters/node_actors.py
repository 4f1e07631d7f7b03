"""Creating, finding and retiring the per-node cache actors, and the reconciler that
keeps exactly one per alive Ray node as the autoscaler adds and removes nodes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field, fields, replace
from typing import Any

import ray
from raykv.cache_actors.node.node_actor import node_actor_class
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name
from raykv.controllers.ownership import check_tenant_digests
from raykv.controllers.tenant_quotas import check_tenant_quotas

log = logging.getLogger(__name__)

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
    ``l2_bytes``: the most bytes each node's L2 pools (vLLM's node-local cache) hold
    together, within ``host_pool_bytes`` and the tenants' quotas (0: no L2).
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
    l2_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_quotas", check_tenant_quotas(self.tenant_quotas))
        object.__setattr__(self, "tenant_digests", check_tenant_digests(self.tenant_digests))
        if type(self.l2_bytes) is not int or self.l2_bytes < 0:
            raise ValueError(f"l2_bytes must be an int >= 0, got {self.l2_bytes!r}")
        if self.confirm_ttl_s < 0:
            raise ValueError(f"confirm_ttl_s must be >= 0, got {self.confirm_ttl_s}")
        if self.standalone and self.host_pool_bytes <= 0:
            raise ValueError(f"standalone mode needs host_pool_bytes > 0, got "
                             f"{self.host_pool_bytes}")
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
        if missing:
            raise ValueError(f"node settings without {', '.join(missing)}")
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in PROCESS_ONLY}


def named_node_actors(namespace: str) -> list[str]:
    """Names of every cache actor in ``namespace``, whether or not its node is alive."""
    prefix = node_actor_name("")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(prefix))


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def start_node_actor(node_id: str, settings: NodeSettings, namespace: str):
    """The cache actor of ``node_id`` (see ``node_actor_class``); the existing one if it
    is already there."""
    return node_actor_class(node_id, namespace, settings.env).remote(
        node_id, **settings.actor_kwargs())


def retire_node_actor(node_id: str, namespace: str) -> None:
    """Kill the cache actor of a node that left (it cannot be rescheduled anyway)."""
    with contextlib.suppress(ValueError):  # already gone
        ray.kill(ray.get_actor(node_actor_name(node_id), namespace=namespace), no_restart=True)


@ray.remote(num_cpus=0, max_restarts=-1)
class NodeReconciler:
    """Polls the alive Ray nodes every ``period_s`` seconds; starts a cache actor on each
    new node and retires the actors of nodes that left, telling the controller."""

    def __init__(self, settings: NodeSettings, namespace: str, period_s: float = 1.0,
                 overrides: dict[str, int] | None = None) -> None:
        self._settings = settings
        self._namespace = namespace
        self._period = period_s
        self._overrides = dict(overrides or {})
        self._controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
        self._task = asyncio.get_event_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.reconcile()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                log.warning("controller unavailable, reconciling again shortly: %s", e)
            except Exception:
                log.exception("reconcile pass failed; retrying")
            await asyncio.sleep(self._period)

    async def reconcile(self) -> dict[str, list[str]]:
        """One pass: ``{"added": [...], "retired": [...]}`` node ids. A known node whose
        actor is gone for good (killed without restart) gets a new one too."""
        alive = alive_node_ids()
        known = set(await self._controller.nodes.remote())
        added, retired = sorted(alive - known), sorted(known - alive)
        for node_id in sorted(alive & known):
            try:
                ray.get_actor(node_actor_name(node_id), namespace=self._namespace)
            except ValueError:
                added.append(node_id)
        for node_id in added:
            size = self._overrides.get(node_id, self._settings.global_segment_size)
            start_node_actor(node_id, replace(self._settings, global_segment_size=size),
                             self._namespace)
            await self._controller.register_node.remote(node_id)
            log.info("node %s joined: cache actor started", node_id[:12])
        for node_id in retired:
            retire_node_actor(node_id, self._namespace)
            await self._controller.retire_node.remote(node_id)
            log.info("node %s left: cache actor retired", node_id[:12])
        if retired:  # its segment's objects leave the store, leases or not
            for node_id in alive & known:
                with contextlib.suppress(ValueError):
                    ray.get_actor(node_actor_name(node_id), namespace=self._namespace
                                  ).forget_confirmations.remote()
        return {"added": added, "retired": retired}

    def stop(self) -> None:
        self._task.cancel()
