"""The embedded default: a whole raykv cluster on this machine, started by one call.

``start_local`` starts a local Ray (several raylets through ``ray.cluster_utils.Cluster``
when ``num_nodes > 1``), a real ``mooncake_master`` with its HTTP metadata server on
free loopback ports, the controller, and one cache actor per node. Leaving the ``with``
block (or ``shutdown()``) stops all of it and removes every shared segment it made.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cache_actors.node_actor import NodeCacheActor, segment_prefix
from cache_actors.shared_segment import remove_segments
from clusters.mooncake_master import MooncakeMaster
from controllers.controller import CacheController
from controllers.naming import CONTROLLER_NAME, NAMESPACE, node_actor_name

log = logging.getLogger(__name__)

MiB = 1 << 20
LOOPBACK = "127.0.0.1"


class LocalCluster:
    """A running embedded raykv cluster. Use as a context manager or call ``shutdown``."""

    def __init__(self, master: MooncakeMaster, cluster_tag: str, namespace: str,
                 ray_cluster=None) -> None:
        self.master = master
        self.cluster_tag = cluster_tag
        self.namespace = namespace
        self._ray_cluster = ray_cluster
        self.node_ids: list[str] = []
        self.node_actors: dict[str, ray.actor.ActorHandle] = {}
        self.controller: ray.actor.ActorHandle | None = None

    @property
    def master_address(self) -> str:
        """``host:port`` of the Mooncake master, for any other Mooncake client."""
        return self.master.master_address

    @property
    def metadata_server(self) -> str:
        """HTTP metadata server URL, for any other Mooncake client."""
        return self.master.metadata_server

    @property
    def head_node_id(self) -> str:
        return self.node_ids[0]

    def start_node_actor(self, node_id: str, *, global_segment_size: int,
                         local_buffer_size: int, env: dict[str, str]) -> ray.actor.ActorHandle:
        actor = NodeCacheActor.options(
            name=node_actor_name(node_id), namespace=self.namespace, lifetime="detached",
            max_restarts=-1, num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            runtime_env={"env_vars": env},
        ).remote(node_id, self.cluster_tag, self.master_address, self.metadata_server,
                 global_segment_size, local_buffer_size, local_hostname=LOOPBACK)
        self.node_actors[node_id] = actor
        ray.get(self.controller.register_node.remote(node_id))
        return actor

    def shutdown(self) -> None:
        """Stop node actors, controller, master and Ray; remove every shared segment."""
        for node_id, actor in self.node_actors.items():
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception as e:  # a dead actor still has to be killed below
                log.warning("node actor %s did not shut down cleanly: %s", node_id[:12], e)
            ray.kill(actor, no_restart=True)
        self.node_actors.clear()
        if self.controller is not None:
            ray.kill(self.controller, no_restart=True)
            self.controller = None
        self.master.stop()
        ray.shutdown()
        if self._ray_cluster is not None:
            self._ray_cluster.shutdown()
            self._ray_cluster = None
        for node_id in self.node_ids:
            remove_segments(segment_prefix(self.cluster_tag, node_id))

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
) -> LocalCluster:
    """Start an embedded raykv cluster of ``num_nodes`` Ray nodes on this machine.

    ``global_segment_size`` (bytes) is what each node's Mooncake client contributes to
    the store; a sequence gives one size per node (0 makes a node a pure consumer).
    ``cpus_per_node`` is the logical CPU count each Ray node advertises for ranks (cache
    actors take none). ``mooncake_log_level`` is Mooncake's ``MC_LOG_LEVEL`` in the cache
    actors (``INFO``, ``WARNING``, ``ERROR``). Mooncake binds to 127.0.0.1. Ray must not
    be initialised already.
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
    master = MooncakeMaster(LOOPBACK, extra_args=list(master_args)).start()
    ray_cluster = None
    try:
        node_args = {"num_cpus": cpus_per_node, "object_store_memory": object_store_memory}
        if num_nodes == 1:
            ray.init(address="local", namespace=namespace, include_dashboard=False,
                     **node_args)
        else:
            from ray.cluster_utils import Cluster

            ray_cluster = Cluster(initialize_head=True, head_node_args=node_args)
            for _ in range(num_nodes - 1):
                ray_cluster.add_node(**node_args)
            ray_cluster.wait_for_nodes()
            ray.init(address=ray_cluster.address, namespace=namespace)
        cluster = LocalCluster(master, uuid.uuid4().hex[:8], namespace, ray_cluster)
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
        cluster.controller = CacheController.options(
            name=CONTROLLER_NAME, namespace=namespace, lifetime="detached",
        ).remote(master.master_address, master.metadata_server, cluster.cluster_tag)
        env = {"MC_LOG_LEVEL": mooncake_log_level}
        for node_id, size in zip(cluster.node_ids, sizes, strict=True):
            cluster.start_node_actor(node_id, global_segment_size=size,
                                     local_buffer_size=local_buffer_size, env=env)
        ray.get([a.health.remote() for a in cluster.node_actors.values()])
    except BaseException:
        cluster.shutdown()
        raise
    return cluster
