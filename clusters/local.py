"""The embedded default: a whole raykv cluster on this machine, started by one call.

``start_local`` starts a local Ray (several raylets through ``ray.cluster_utils.Cluster``
when ``num_nodes > 1``), a real ``mooncake_master`` with its HTTP metadata server on
free loopback ports, the controller, and the reconciler, which gives every node exactly
one cache actor (also nodes added later with ``add_node``). Leaving the ``with`` block
(or ``shutdown()``) stops all of it and removes every shared segment it made.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import uuid
from collections.abc import Sequence

import ray

from cache_actors.mooncake_backend import MooncakeBackend
from cache_actors.shared_segment import remove_segments
from clusters.mooncake_master import MooncakeMaster
from clusters.node_actors import (
    RECONCILER_NAME,
    NodeReconciler,
    NodeSettings,
    named_node_actors,
)
from controllers.controller import CacheController
from controllers.naming import CONTROLLER_NAME, NAMESPACE, node_actor_name

log = logging.getLogger(__name__)

MiB = 1 << 20
LOOPBACK = "127.0.0.1"
# Detect dead nodes within ~3 s (the default takes ~30 s).
FAST_HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_failure_threshold": 3,
                      "health_check_initial_delay_ms": 0}


def controller_store(settings: NodeSettings):
    """The controller's exists backend: a Mooncake client that contributes no memory."""
    return functools.partial(
        MooncakeBackend.embedded, local_hostname=settings.local_hostname or LOOPBACK,
        metadata_server=settings.metadata_server,
        master_server_addr=settings.master_address, global_segment_size=0,
        local_buffer_size=settings.local_buffer_size, protocol=settings.protocol)


def start_control_plane(settings: NodeSettings, namespace: str, *, group_window_s: float = 2.0,
                        reconcile_period_s: float = 1.0,
                        overrides: dict[str, int] | None = None):
    """Start the controller and the reconciler (detached, named) and run one reconcile
    pass; returns ``(controller, reconciler)`` once every node actor answers."""
    info = {"master_address": settings.master_address,
            "metadata_server": settings.metadata_server, "cluster_tag": settings.cluster_tag}
    controller = CacheController.options(
        name=CONTROLLER_NAME, namespace=namespace, lifetime="detached", get_if_exists=True,
        runtime_env={"env_vars": settings.env},
    ).remote(info, namespace, controller_store(settings), group_window_s)
    ray.get(controller.info.remote())
    reconciler = NodeReconciler.options(
        name=RECONCILER_NAME, namespace=namespace, lifetime="detached", get_if_exists=True,
    ).remote(settings, namespace, reconcile_period_s, overrides)
    ray.get(reconciler.reconcile.remote())
    names = ray.get(controller.nodes.remote()).values()
    ray.get([ray.get_actor(n, namespace=namespace).health.remote() for n in names])
    return controller, reconciler


class LocalCluster:
    """A running embedded raykv cluster. Use as a context manager or call ``shutdown``."""

    def __init__(self, master: MooncakeMaster, settings: NodeSettings, namespace: str,
                 ray_cluster=None) -> None:
        self.master = master
        self.settings = settings
        self.namespace = namespace
        self._ray_cluster = ray_cluster
        self._ray_nodes: dict[str, object] = {}
        self._node_args: dict = {}
        self.node_ids: list[str] = []
        self.controller = None
        self.reconciler = None

    @property
    def cluster_tag(self) -> str:
        return self.settings.cluster_tag

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
        """Node id -> cache actor, for every node the controller knows now."""
        return {n: ray.get_actor(node_actor_name(n), namespace=self.namespace)
                for n in ray.get(self.controller.nodes.remote())}

    def add_node(self, timeout_s: float = 60.0, **node_args) -> str:
        """Add a Ray node (multi-node clusters only); returns its id once its cache actor
        answers. ``node_args`` go to ``Cluster.add_node`` (default: same CPUs as the rest)."""
        if self._ray_cluster is None:
            raise RuntimeError("add_node needs a cluster started with num_nodes > 1")
        before = {n["NodeID"] for n in ray.nodes()}
        node = self._ray_cluster.add_node(**(self._node_args | node_args))
        self._ray_cluster.wait_for_nodes()
        (node_id,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - before
        self._ray_nodes[node_id] = node
        deadline = time.monotonic() + timeout_s
        while node_id not in ray.get(self.controller.nodes.remote()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no cache actor on new node {node_id[:12]}")
            time.sleep(0.2)
        ray.get(self.node_actors[node_id].health.remote())
        return node_id

    def remove_node(self, node_id: str) -> None:
        """Stop a node that ``add_node`` added (as the autoscaler would)."""
        self._ray_cluster.remove_node(self._ray_nodes.pop(node_id))

    def shutdown(self) -> None:
        """Stop reconciler, node actors, controller, master and Ray; remove every shared
        segment of this cluster."""
        if self.reconciler is not None:
            ray.kill(self.reconciler, no_restart=True)
        if self.controller is not None:
            for name in named_node_actors(self.namespace):
                actor = ray.get_actor(name, namespace=self.namespace)
                try:
                    ray.get(actor.shutdown.remote(), timeout=30)
                except Exception as e:  # a dead actor still has to be killed below
                    log.warning("%s did not shut down cleanly: %s", name, e)
                ray.kill(actor, no_restart=True)
            ray.kill(self.controller, no_restart=True)
        self.controller = self.reconciler = None
        self.master.stop()
        ray.shutdown()
        if self._ray_cluster is not None:
            self._ray_cluster.shutdown()
            self._ray_cluster = None
        remove_segments(f"raykv.{self.cluster_tag}.")

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def start_local(
    num_nodes: int = 1,
    *,
    cpus_per_node: int = 2,
    global_segment_size: int | Sequence[int] = 512 * MiB,
    local_buffer_size: int = 16 * MiB,
    object_store_memory: int = 256 * MiB,
    namespace: str = NAMESPACE,
    master_args: Sequence[str] = (),
    mooncake_log_level: str = "ERROR",
    group_window_s: float = 2.0,
    reconcile_period_s: float = 1.0,
) -> LocalCluster:
    """Start an embedded raykv cluster of ``num_nodes`` Ray nodes on this machine.

    ``global_segment_size`` (bytes) is what each node's Mooncake client contributes to
    the store; a sequence gives one size per initial node (0 makes a node a pure
    consumer); nodes added later get the first size. ``cpus_per_node`` is the logical
    CPU count each Ray node advertises for ranks (cache actors take none).
    ``mooncake_log_level`` is Mooncake's ``MC_LOG_LEVEL`` in the cache actors (``INFO``,
    ``WARNING``, ``ERROR``). Mooncake binds to 127.0.0.1 (also clients made later in this
    process: ``MC_TCP_BIND_ADDRESS`` is set unless already set); multi-node clusters
    detect a removed node within ~3 s. Ray must not be initialised already.
    """
    if ray.is_initialized():
        raise RuntimeError("Ray is already initialised in this process; start_local starts "
                           "its own Ray (call ray.shutdown() first)")
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    sizes = ([global_segment_size] * num_nodes if isinstance(global_segment_size, int)
             else list(global_segment_size))
    if len(sizes) != num_nodes:
        raise ValueError(f"{len(sizes)} global_segment_size values for {num_nodes} nodes")
    # Mooncake clients made in this process (benchmarks, tools) stay on loopback too.
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", LOOPBACK)
    master = MooncakeMaster(LOOPBACK, extra_args=list(master_args)).start()
    settings = NodeSettings(master.master_address, master.metadata_server, uuid.uuid4().hex[:8],
                            sizes[0], local_buffer_size, "tcp", LOOPBACK, mooncake_log_level)
    ray_cluster = None
    node_args = {"num_cpus": cpus_per_node, "object_store_memory": object_store_memory}
    try:
        if num_nodes == 1:
            ray.init(address="local", namespace=namespace, include_dashboard=False,
                     **node_args)
        else:
            from ray.cluster_utils import Cluster

            ray_cluster = Cluster(initialize_head=True, head_node_args=node_args | {
                "_system_config": FAST_HEALTH_CHECKS})
            for _ in range(num_nodes - 1):
                ray_cluster.add_node(**node_args)
            ray_cluster.wait_for_nodes()
            ray.init(address=ray_cluster.address, namespace=namespace)
        cluster = LocalCluster(master, settings, namespace, ray_cluster)
        cluster._node_args = node_args
        head = ray.get_runtime_context().get_node_id()
        others = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        cluster.node_ids = [head, *others]
    except BaseException:
        master.stop()
        if ray_cluster is not None:
            ray_cluster.shutdown()
        ray.shutdown()
        raise
    try:
        cluster.controller, cluster.reconciler = start_control_plane(
            settings, namespace, group_window_s=group_window_s,
            reconcile_period_s=reconcile_period_s,
            overrides=dict(zip(cluster.node_ids, sizes, strict=True)))
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
