"""The embedded default: a whole raykv cluster on this machine, started by one call.

``start_local`` starts a local Ray (several raylets through ``ray.cluster_utils.Cluster``
when ``num_nodes > 1``), a real ``mooncake_master`` and its HTTP metadata server on
free loopback ports (``MooncakeMaster``: nothing of theirs listens beyond loopback, checked
at start), the controller, and the reconciler, which gives every node exactly
one node actor (also nodes added later with ``add_node``). Leaving the ``with`` block
(or ``shutdown()``) stops all of it and removes every shared-memory file it made.

``launch`` is the part after Ray's nodes: any ``RayNodes`` (this module's ``OwnNodes``;
the lab's emulated hosts, ``raykv_lab.hosts``) gets the same master, control plane and
shutdown.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

import ray
from raykv.cache_actors.node.client_supervisor import stop_recorded
from raykv.cache_actors.node.disk_tier import MASTER_FLAGS
from raykv.cache_actors.shared_memory import remove_shm_files
from raykv.clusters import ray_auth
from raykv.clusters.control_plane import LOOPBACK, start_control_plane, stop_control_plane
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

LOCAL_DEFAULTS = replace(DEFAULTS, global_segment_size=512 * MiB)
"""``start_local``'s node settings when none are given: ``DEFAULTS`` with a smaller
segment per node (one machine holds every node)."""


def local_settings(**changes: Any) -> NodeSettings:
    """``LOCAL_DEFAULTS`` with ``changes`` (``NodeSettings``' fields, checked as it checks
    them: ``ValueError``, ``TypeError`` for an unknown name). ``host_pool_bytes`` not
    given (or None) is its default by mode (``pool_budget``: no limit embedded, 1 GiB
    standalone)."""
    changes["host_pool_bytes"] = pool_budget(changes.get("host_pool_bytes"),
                                             changes.get("standalone", False))
    return replace(LOCAL_DEFAULTS, **changes)


class RayNodes(Protocol):
    """Where a local cluster's Ray nodes come from. ``launch`` calls, in the driver's
    thread: ``master_host`` (the address the master and its metadata server bind),
    ``join`` once (start or reach the nodes and ``ray.init`` this process; returns the
    node ids, the head's first), ``shutdown`` once when the cluster stops or its start
    failed (idempotent)."""

    master_host: str

    def join(self, cluster_tag: str, namespace: str, log_to_driver: bool) -> list[str]: ...

    def shutdown(self) -> None: ...


class OwnNodes:
    """``start_local``'s nodes: one Ray node in this process's ``ray.init``, or several
    raylets of ``ray.cluster_utils.Cluster``, which ``LocalCluster.add_node`` grows."""

    master_host = LOOPBACK

    def __init__(self, num_nodes: int, node_args: dict) -> None:
        self.num_nodes = num_nodes
        self.node_args = node_args
        """``Cluster.add_node``'s arguments for every node (CPUs, object store, resources)."""
        self.cluster = None
        """The ``ray.cluster_utils.Cluster`` (None for one node, or once shut down)."""
        self.added: dict[str, object] = {}
        """Node id -> the ``Cluster``'s node, for nodes ``add_node`` added."""

    def join(self, cluster_tag: str, namespace: str, log_to_driver: bool) -> list[str]:
        if self.num_nodes == 1:
            ray.init(address="local", namespace=namespace, include_dashboard=False,
                     log_to_driver=log_to_driver, _system_config=NO_PRESTART, **self.node_args)
        else:
            from ray.cluster_utils import Cluster

            # no dashboard (as a one-node cluster): its fixed port, taken by any other
            # Ray on the machine, made the head node time out at start; no autoscaler
            # monitor: these nodes are added and removed by hand (``add_node``), and the
            # monitor cost ~1 CPU-s per start
            self.cluster = Cluster(initialize_head=True, head_node_args=self.node_args | {
                "_system_config": FAST_HEALTH_CHECKS | NO_PRESTART, "include_dashboard": False,
                "no_monitor": True})
            for _ in range(self.num_nodes - 1):
                self.cluster.add_node(**self.node_args)
            self.cluster.wait_for_nodes()
            ray.init(address=self.cluster.address, namespace=namespace,
                     log_to_driver=log_to_driver)
        head = ray.get_runtime_context().get_node_id()
        return [head, *sorted(n["NodeID"] for n in ray.nodes()
                              if n["Alive"] and n["NodeID"] != head)]

    def shutdown(self) -> None:
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None


class LocalCluster:
    """A running embedded raykv cluster. Use as a context manager or call ``shutdown``."""

    def __init__(self, master: MooncakeMaster, settings: NodeSettings, namespace: str,
                 ray_nodes: RayNodes) -> None:
        self.master = master
        self.settings = settings
        self.namespace = namespace
        self.ray_nodes = ray_nodes
        """Where the Ray nodes come from (``OwnNodes``, or the lab's emulated hosts: their
        addresses, links and faults)."""
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

    def _own_cluster(self):
        nodes = self.ray_nodes
        if not isinstance(nodes, OwnNodes) or nodes.cluster is None:
            raise RuntimeError("adding and removing nodes needs a cluster started with "
                               "num_nodes > 1 (start_local's own nodes)")
        return nodes

    def add_node(self, timeout_s: float = 60.0, **node_args) -> str:
        """Add a Ray node (multi-node clusters only); returns its id once its node actor
        answers. ``node_args`` go to ``Cluster.add_node`` (default: same CPUs as the rest)."""
        nodes = self._own_cluster()
        before = {n["NodeID"] for n in ray.nodes()}
        node = nodes.cluster.add_node(**(nodes.node_args | node_args))
        nodes.cluster.wait_for_nodes()
        (node_id,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
        nodes.added[node_id] = node
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
        nodes = self._own_cluster()
        nodes.cluster.remove_node(nodes.added.pop(node_id))
        self.node_ids.remove(node_id)
        deadline = time.monotonic() + timeout_s
        while node_id in ray.get(self.controller.nodes.remote()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id[:12]} left but is still listed")
            time.sleep(0.2)

    def shutdown(self) -> None:
        """Stop reconciler, node actors, controller, master and Ray (``ray_nodes``); stop
        any ``mooncake_client`` of this cluster still running (standalone mode) and remove
        every shared-memory file of it. Each step runs even if an earlier one failed."""
        prefix = cluster_shm_prefix(self.cluster_tag)
        steps = [self.master.stop, ray.shutdown, self.ray_nodes.shutdown,
                 lambda: stop_recorded(prefix), lambda: remove_shm_files(prefix)]
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

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_local(
    num_nodes: int = 1,
    settings: NodeSettings | None = None,
    *,
    segment_sizes: Sequence[int] | None = None,
    cpus_per_node: int = 2,
    object_store_memory: int = 256 * MiB,
    resources: dict[str, float] | None = None,
    namespace: str = NAMESPACE,
    master_args: Sequence[str] = (),
    reconcile_period_s: float = 1.0,
    log_to_driver: bool = True,
    lifecycle: LifecycleSettings | None = None,
) -> LocalCluster:
    """Start an embedded raykv cluster of ``num_nodes`` Ray nodes on this machine.

    ``settings`` are every node's (``NodeSettings``; default ``LOCAL_DEFAULTS``, and
    ``local_settings(**changes)`` makes them from it): the master's address, its
    metadata server and the cluster tag are filled in here, ``local_hostname`` None
    becomes 127.0.0.1 (Mooncake clients made later in this process bind it too:
    ``MC_TCP_BIND_ADDRESS`` is set to it unless already set; RDMA needs the address of
    an RDMA interface). ``segment_sizes``: one ``global_segment_size`` per initial node
    instead (0 makes a node a pure consumer); nodes added later get the settings'.
    ``cpus_per_node`` is the logical CPU count each Ray node advertises for ranks (node
    actors take none); ``object_store_memory`` each node's Ray object store (bytes);
    ``resources``: custom Ray resources every node advertises (also nodes added later),
    e.g. to place replicas by a bundle. The master and its metadata server listen on
    127.0.0.1 (Mooncake's transfer engines listen on every interface: docs/deploy.md).
    Multi-node clusters detect a removed node within ~3 s. Ray prestarts no idle worker
    for the driver (``NO_PRESTART``). Ray must not be initialised already.

    ``master_args``: more flags of ``mooncake_master``; with a disk tier
    (``settings.disk_dir``) the master offloads on eviction (``disk_tier.MASTER_FLAGS``,
    before ``master_args``), every object is sealed under the seal key kept in
    ``disk_dir`` (``controllers.object_seal.read_seal_key``), and a cluster started again
    on the same ``disk_dir`` finds what its nodes offloaded. ``reconcile_period_s``: how
    often the reconciler looks for new nodes. ``log_to_driver=False`` keeps the output of
    Ray workers (engines' logs) off this process's console. ``lifecycle``: where node
    actors run and when they leave (``clusters.node_lifecycle``; default
    ``LifecycleSettings.fixed()``: a node actor on every node for good, as a fixed
    cluster wants).
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; start_local starts "
                           "its own Ray (call ray.shutdown() first)")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    settings = settings or LOCAL_DEFAULTS
    settings = replace(settings, local_hostname=settings.local_hostname or LOOPBACK)
    node_args: dict = {"num_cpus": cpus_per_node, "object_store_memory": object_store_memory}
    if resources:
        node_args["resources"] = dict(resources)
    sizes = per_node_sizes(settings, segment_sizes, num_nodes)
    # Mooncake clients made in this process (benchmarks, tools) bind where the nodes do.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", settings.local_hostname)
    return launch(OwnNodes(num_nodes, node_args), settings, sizes, namespace=namespace,
                  master_args=master_args, reconcile_period_s=reconcile_period_s,
                  log_to_driver=log_to_driver, lifecycle=lifecycle)


def per_node_sizes(settings: NodeSettings, segment_sizes: Sequence[int] | None,
                   num_nodes: int) -> list[int]:
    """Each of ``num_nodes`` nodes' ``global_segment_size``: ``segment_sizes`` if given
    (``ValueError`` unless one per node), else the settings' for every node."""
    if segment_sizes is None:
        return [settings.global_segment_size] * num_nodes
    if len(segment_sizes) != num_nodes:
        raise ValueError(f"{len(segment_sizes)} segment_sizes for {num_nodes} nodes")
    return list(segment_sizes)


def launch(ray_nodes: RayNodes, settings: NodeSettings, segment_sizes: Sequence[int], *,
           namespace: str = NAMESPACE, master_args: Sequence[str] = (),
           reconcile_period_s: float = 1.0, log_to_driver: bool = True,
           lifecycle: LifecycleSettings | None = None) -> LocalCluster:
    """The cluster on ``ray_nodes``: a master at its ``master_host``, Ray joined, the
    controller and the reconciler (``start_local``'s arguments of the same names;
    ``segment_sizes``: one ``global_segment_size`` per node ``join`` returns, in its
    order). On any failure everything started is stopped (``ray_nodes.shutdown`` too)
    and the error raised."""
    settings = replace(settings, cluster_tag=settings.cluster_tag or uuid.uuid4().hex[:8])
    if settings.disk_dir:
        settings = replace(settings, seal_key=read_seal_key(settings.disk_dir))
        master_args = [*MASTER_FLAGS, *master_args]
    try:
        check_confirm_ttl(settings.confirm_ttl_s, master_args)
        master = MooncakeMaster(ray_nodes.master_host, extra_args=list(master_args)).start()
    except BaseException:
        ray_nodes.shutdown()
        raise
    settings = replace(settings, master_address=master.master_address,
                       metadata_server=master.metadata_server)
    cluster = LocalCluster(master, settings, namespace, ray_nodes)
    try:
        ray_auth.settle()
        cluster.node_ids = ray_nodes.join(settings.cluster_tag, namespace, log_to_driver)
        if len(cluster.node_ids) != len(segment_sizes):
            raise ValueError(f"{len(segment_sizes)} segment sizes for "
                             f"{len(cluster.node_ids)} nodes")
        cluster.controller, cluster.reconciler = start_control_plane(
            settings, namespace, reconcile_period_s=reconcile_period_s,
            overrides=dict(zip(cluster.node_ids, segment_sizes, strict=True)),
            lifecycle=lifecycle or LifecycleSettings.fixed(), master_metrics=master.metrics_url)
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
