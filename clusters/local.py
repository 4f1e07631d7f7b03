"""The embedded default: a whole raykv cluster on this machine, started by one call.

``start_local`` starts a local Ray (several raylets through ``ray.cluster_utils.Cluster``
when ``num_nodes > 1``), a real ``mooncake_master`` and its HTTP metadata server on
free loopback ports (``MooncakeMaster``: nothing of theirs listens beyond loopback, checked
at start), the controller, and the reconciler, which gives every node exactly
one node actor (also nodes added later with ``add_node``). Leaving the ``with`` block
(or ``shutdown()``) stops all of it and removes every shared-memory file it made.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import ray
from raykv.cache_actors.node.client_supervisor import stop_recorded
from raykv.cache_actors.node.disk_tier import MASTER_FLAGS
from raykv.cache_actors.shared_memory import remove_shm_files
from raykv.clusters import ray_auth
from raykv.clusters.control_plane import LOOPBACK, start_control_plane, stop_control_plane
from raykv.clusters.hosts import EmulatedHosts
from raykv.clusters.mooncake_master import MooncakeMaster, check_confirm_ttl
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.controllers.naming import NAMESPACE, cluster_shm_prefix, node_actor_name
from raykv.controllers.node_settings import DEFAULTS, NodeSettings, pool_budget
from raykv.controllers.object_seal import read_seal_key
from raykv.controllers.pool_layout import MiB

log = logging.getLogger(__name__)

# No idle Python worker started ahead for the driver: raykv's actors each get a worker of
# their own, so the prestarted one only idled (~1 CPU-s to start, and CPU while it idles).
NO_PRESTART = {"prestart_worker_first_driver": False}
# Detect dead nodes within ~3 s (the default takes ~30 s).
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                      "health_check_initial_delay_ms": 0}


class LocalCluster:
    """A running embedded raykv cluster. Use as a context manager or call ``shutdown``."""

    def __init__(self, master: MooncakeMaster, settings: NodeSettings, namespace: str,
                 ray_cluster=None, node_args: dict | None = None,
                 hosts: EmulatedHosts | None = None) -> None:
        self.master = master
        self.hosts = hosts
        """The emulated hosts (``start_local(hosts=N)``): addresses, links, faults."""
        self.settings = settings
        self.namespace = namespace
        self._ray_cluster = ray_cluster
        self._ray_nodes: dict[str, object] = {}
        self._node_args = dict(node_args or {})
        self.node_ids: list[str] = []
        self.controller = None
        self.reconciler = None

    @property
    def cluster_tag(self) -> str:
        return self.settings.cluster_tag

    @property
    def address(self) -> str:
        """The Ray GCS address (``host:port``) that other processes join with
        ``ray.init(address=..., namespace=self.namespace)``."""
        return ray.get_runtime_context().gcs_address

    @property
    def master_address(self) -> str:
        """``host:port`` of the Mooncake master, for any other Mooncake client."""
        return self.master.master_address

    @property
    def metadata_server(self) -> str:
        """HTTP metadata server URL, for any other Mooncake client."""
        return self.master.metadata_server

    @property
    def node_actors(self) -> dict[str, ray.actor.ActorHandle]:
        """Node id -> node actor, for every node the controller knows now."""
        return {n: ray.get_actor(node_actor_name(n), namespace=self.namespace)
                for n in ray.get(self.controller.nodes.remote())}

    def add_node(self, timeout_s: float = 60.0, **node_args) -> str:
        """Add a Ray node (multi-node clusters only); returns its id once its node actor
        answers. ``node_args`` go to ``Cluster.add_node`` (default: same CPUs as the rest)."""
        if self._ray_cluster is None or self.hosts is not None:
            raise RuntimeError("add_node needs a cluster started with num_nodes > 1 "
                               "(and no emulated hosts)")
        before = {n["NodeID"] for n in ray.nodes()}
        node = self._ray_cluster.add_node(**(self._node_args | node_args))
        self._ray_cluster.wait_for_nodes()
        (node_id,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
        self._ray_nodes[node_id] = node
        self.node_ids.append(node_id)
        deadline = time.monotonic() + timeout_s
        while node_id not in ray.get(self.controller.nodes.remote()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no node actor on new node {node_id[:12]}")
            time.sleep(0.2)
        ray.get(self.node_actors[node_id].health.remote())
        return node_id

    def remove_node(self, node_id: str, timeout_s: float = 60.0) -> None:
        """Stop a node that ``add_node`` added (as the autoscaler would); returns once the
        controller no longer lists it (its node actor retired), so ``node_actors`` never
        names an actor that is gone. ``TimeoutError`` after ``timeout_s``."""
        self._ray_cluster.remove_node(self._ray_nodes.pop(node_id))
        self.node_ids.remove(node_id)
        deadline = time.monotonic() + timeout_s
        while node_id in ray.get(self.controller.nodes.remote()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id[:12]} left but is still listed")
            time.sleep(0.2)

    def shutdown(self) -> None:
        """Stop reconciler, node actors, controller, master and Ray; stop any
        ``mooncake_client`` of this cluster still running (standalone mode) and remove
        every shared-memory file of it. Each step runs even if an earlier one failed."""
        prefix = cluster_shm_prefix(self.cluster_tag)
        steps = [self.master.stop, ray.shutdown, self._stop_ray_cluster,
                 lambda: stop_recorded(prefix), lambda: remove_shm_files(prefix)]
        if self.hosts is not None:  # its Ray processes, namespaces, links, bridge
            steps.append(self.hosts.shutdown)
        if self.controller is not None and ray.is_initialized():
            steps.insert(0, lambda: stop_control_plane(self.namespace))
        self.controller = self.reconciler = None
        errors = []
        for step in steps:
            try:
                step()
            except Exception as e:  # keep stopping the rest
                errors.append(e)
                log.warning("shutdown step failed: %s", e)
        if errors:
            raise errors[0]

    def _stop_ray_cluster(self) -> None:
        if self._ray_cluster is not None:
            self._ray_cluster.shutdown()
            self._ray_cluster = None

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_local(
    num_nodes: int = 1,
    *,
    cpus_per_node: int = 2,
    global_segment_size: int | Sequence[int] = 512 * MiB,
    local_buffer_size: int = DEFAULTS.local_buffer_size,
    object_store_memory: int = 256 * MiB,
    namespace: str = NAMESPACE,
    master_args: Sequence[str] = (),
    mooncake_log_level: str = DEFAULTS.mooncake_log_level,
    group_window_s: float = DEFAULTS.group_window_s,
    confirm_ttl_s: float = DEFAULTS.confirm_ttl_s,
    reconcile_period_s: float = 1.0,
    standalone: bool = DEFAULTS.standalone,
    host_pool_bytes: int | None = None,
    log_to_driver: bool = True,
    protocol: str = DEFAULTS.protocol,
    rdma_devices: str = DEFAULTS.rdma_devices,
    local_hostname: str | None = None,
    tenant_quotas: dict[str, int] | None = None,
    tenant_digests: dict[str, str] | None = None,
    bound_tenants_only: bool = DEFAULTS.bound_tenants_only,
    untenanted_pool_bytes: int | None = DEFAULTS.untenanted_pool_bytes,
    hosts: int = 0,
    link: str | None = None,
    l2_bytes: int = DEFAULTS.l2_bytes,
    l2_warm_bytes: int = DEFAULTS.l2_warm_bytes,
    l2_warm_s: float = DEFAULTS.l2_warm_s,
    l2_eviction: str = DEFAULTS.l2_eviction,
    placement: str = DEFAULTS.placement,
    resources: dict[str, float] | None = None,
    lifecycle: LifecycleSettings | None = None,
    disk_dir: str = DEFAULTS.disk_dir,
    disk_bytes: int = DEFAULTS.disk_bytes,
) -> LocalCluster:
    """Start an embedded raykv cluster of ``num_nodes`` Ray nodes on this machine.

    ``global_segment_size`` (bytes) is what each node's Mooncake client contributes to
    the store; a sequence gives one size per initial node (0 makes a node a pure
    consumer); nodes added later get the first size. ``cpus_per_node`` is the logical
    CPU count each Ray node advertises for ranks (node actors take none).
    ``mooncake_log_level`` is Mooncake's ``MC_LOG_LEVEL`` in the node actors (``INFO``,
    ``WARNING``, ``ERROR``). ``group_window_s`` bounds how long a group hit answer is
    kept for the ranks of the group that have not asked yet (0: only ranks asking at the
    same time share one). ``confirm_ttl_s``: how long group queries trust a page the
    store confirmed present (below the master's object lease; 0: always ask the store).
    Transport (as ``NodeSettings``): ``protocol`` (``tcp`` or ``rdma``), ``rdma_devices``
    (comma-separated RDMA device names; "" lets Mooncake use every device; needs
    ``rdma``), ``local_hostname``: the address every node's Mooncake binds and
    advertises, 127.0.0.1 by default (also clients made later in this process:
    ``MC_TCP_BIND_ADDRESS`` is set to it unless already set; RDMA needs the address of
    an RDMA interface). The master and its metadata server listen on 127.0.0.1
(Mooncake's transfer engines listen on every interface: docs/deploy.md). Multi-node clusters
    detect a removed node within ~3 s. Ray prestarts no idle worker for the driver
    (``NO_PRESTART``). Ray must not be initialised already.

    ``hosts`` > 0: an emulated multi-host cluster instead (``clusters.hosts``, root
    only): ``hosts`` Ray nodes, each in a network namespace of its own with its own
    address (host 0, the head, in this machine's namespace, with the master, its
    metadata server and this driver), every node's Mooncake bound to its host's address
    (``local_hostname`` must stay None), each host's link shaped to ``link``
    (``10gbit``; None: not shaped); ``num_nodes`` is then ``hosts``. Ray declares a
    host dead after ~30 s unanswered. ``cluster.hosts`` takes links down and up and
    changes their rates; ``shutdown`` removes every process, namespace, link and bridge
    (after a crash of this process: ``raykv clean-hosts``).

    ``standalone`` runs each node's segment in a ``mooncake_client`` process that its
    node actor supervises (it survives a crash of the actor); ``host_pool_bytes`` is each
    node's budget for host pools (default: no limit embedded, ``STANDALONE_POOL_BYTES``
    (1 GiB) standalone, where it is what the node requests from ``mooncake_client``).
    ``log_to_driver=False`` keeps the output of Ray workers (engines' logs) off this
    process's console. The node defaults are ``controllers.node_settings.DEFAULTS``'
    (``global_segment_size`` and ``local_hostname`` are smaller / local here: one
    machine).
    ``tenant_quotas``: tenant -> bytes of host pools its deployments may hold on each
    node (``controllers.tenant_quotas``); ``ValueError`` for a bad name or size.
    ``tenant_digests``: tenant -> its tenant digest (public owner key), bound on every
    node from the start; ``bound_tenants_only``: no other tenant is bound
    (``NodeSettings``). ``untenanted_pool_bytes``: the most bytes of each node's pools
    without a tenant together (None: half the node's memory embedded, none beyond
    ``host_pool_bytes`` standalone; 0: none). ``l2_bytes``: the most bytes of each
    node's L2 pools (vLLM's node-local cache; 0: none). ``l2_warm_bytes``,
    ``l2_warm_s``: the budgets of the warm-up of an L2 pool new on a node (bytes, 0: no
    warm-up; seconds). ``l2_eviction``: which ready page an L2 pool evicts first
    (``NodeSettings.l2_eviction``). ``placement``: ``own`` (puts
    prefer the writing node's segment) or ``any`` (Mooncake's random choice).
    ``resources``: custom Ray resources every node advertises (also nodes added later),
    e.g. to place replicas by a bundle. ``lifecycle``: where node actors run and when
    they leave (``clusters.node_lifecycle``; default ``LifecycleSettings.fixed()``: a
    node actor on every node for good, as a fixed cluster wants).
    ``disk_dir``, ``disk_bytes``: each node's disk tier (``NodeSettings``; "", 0: none):
    the master offloads on eviction (``disk_tier.MASTER_FLAGS``, before
    ``master_args``), every object is sealed under the seal key kept in ``disk_dir``
    (``controllers.object_seal.read_seal_key``), and a cluster started again on the
    same ``disk_dir`` finds what its nodes offloaded.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; start_local starts "
                           "its own Ray (call ray.shutdown() first)")
    if hosts:
        if resources:
            raise ValueError("resources are for start_local's own nodes, not emulated hosts")
        if num_nodes not in (1, hosts) or local_hostname is not None:
            raise ValueError("with hosts, num_nodes is the number of hosts and every node's "
                             "Mooncake binds its host's address (local_hostname None)")
        num_nodes = hosts
    elif link is not None:
        raise ValueError("link shapes emulated hosts: give hosts too")
    else:
        local_hostname = local_hostname or LOOPBACK
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    sizes = ([global_segment_size] * num_nodes if isinstance(global_segment_size, int)
             else list(global_segment_size))
    if len(sizes) != num_nodes:
        raise ValueError(f"{len(sizes)} global_segment_size values for {num_nodes} nodes")
    settings = NodeSettings(
        cluster_tag=uuid.uuid4().hex[:8], global_segment_size=sizes[0],
        local_buffer_size=local_buffer_size, protocol=protocol, rdma_devices=rdma_devices,
        local_hostname=local_hostname, mooncake_log_level=mooncake_log_level,
        standalone=standalone, host_pool_bytes=pool_budget(host_pool_bytes, standalone),
        group_window_s=group_window_s, confirm_ttl_s=confirm_ttl_s,
        tenant_quotas=dict(tenant_quotas or {}), tenant_digests=dict(tenant_digests or {}),
        bound_tenants_only=bound_tenants_only, untenanted_pool_bytes=untenanted_pool_bytes,
        l2_bytes=l2_bytes, l2_warm_bytes=l2_warm_bytes, l2_warm_s=l2_warm_s,
        l2_eviction=l2_eviction, placement=placement, disk_dir=disk_dir, disk_bytes=disk_bytes)
    if disk_dir:
        settings = replace(settings, seal_key=read_seal_key(disk_dir))
        master_args = [*MASTER_FLAGS, *master_args]
    check_confirm_ttl(confirm_ttl_s, master_args)
    network = EmulatedHosts.create(hosts, link) if hosts else None
    if network is None:
        # Mooncake clients made in this process (benchmarks, tools) bind where the nodes do.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
    try:
        master = MooncakeMaster(network.address(0) if network else LOOPBACK,
                                extra_args=list(master_args)).start()
    except BaseException:
        if network is not None:
            network.shutdown()
        raise
    settings = replace(settings, master_address=master.master_address,
                       metadata_server=master.metadata_server)
    ray_cluster = None
    node_args = {"num_cpus": cpus_per_node, "object_store_memory": object_store_memory}
    if resources:
        node_args["resources"] = dict(resources)
    try:
        ray_auth.settle()
        if network is not None:
            network.set_cluster_tag(settings.cluster_tag)
            network.join_ray(cpus_per_node, object_store_memory, namespace=namespace,
                             log_to_driver=log_to_driver)
        elif num_nodes == 1:
            ray.init(address="local", namespace=namespace, include_dashboard=False,
                     log_to_driver=log_to_driver, _system_config=NO_PRESTART, **node_args)
        else:
            from ray.cluster_utils import Cluster

            # no dashboard (as a one-node cluster): its fixed port, taken by any other
            # Ray on the machine, made the head node time out at start; no autoscaler
            # monitor: these nodes are added and removed by hand (``add_node``), and the
            # monitor cost ~1 CPU-s per start
            ray_cluster = Cluster(initialize_head=True, head_node_args=node_args | {
                "_system_config": FAST_HEALTH_CHECKS | NO_PRESTART, "include_dashboard": False,
                "no_monitor": True})
            for _ in range(num_nodes - 1):
                ray_cluster.add_node(**node_args)
            ray_cluster.wait_for_nodes()
            ray.init(address=ray_cluster.address, namespace=namespace,
                     log_to_driver=log_to_driver)
        cluster = LocalCluster(master, settings, namespace, ray_cluster, node_args, network)
        head = ray.get_runtime_context().get_node_id()
        others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        cluster.node_ids = (network.map_nodes(ray.nodes()) if network is not None
                            else [head, *others])
    except BaseException:
        master.stop()
        if ray_cluster is not None:
            ray_cluster.shutdown()
        ray.shutdown()
        if network is not None:
            network.shutdown()
        raise
    try:
        cluster.controller, cluster.reconciler = start_control_plane(
            settings, namespace, reconcile_period_s=reconcile_period_s,
            overrides=dict(zip(cluster.node_ids, sizes, strict=True)),
            lifecycle=lifecycle or LifecycleSettings.fixed(), master_metrics=master.metrics_url)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
