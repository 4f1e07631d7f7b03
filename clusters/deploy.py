"""``raykv up | status | drain | down`` against a running Ray cluster.

``up`` starts, in the ``raykv`` namespace, a supervised ``mooncake_master`` on the head
node (unless ``master_address`` and ``metadata_server`` of an existing one are given),
the controller and the reconciler, which gives a node actor to the head node, to kept
nodes and to every node where ranks run, and follows the autoscaler from then on
(``clusters.node_lifecycle``). Everything is detached: it outlives the ``up``
command. ``down`` stops it all. Each joins the cluster through ``connect``, which fails
in seconds, with a one-line ``RayUnreachableError``, where no Ray cluster answers.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import replace

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.cache_actors.mooncake_wheels import environment_warning
from raykv.cache_actors.node.disk_tier import MASTER_FLAGS
from raykv.cache_actors.ray_auth_mode import join_mode
from raykv.clusters.control_plane import start_control_plane, stop_control_plane
from raykv.clusters.master_supervisor import MasterSupervisor, ports_key
from raykv.clusters.mooncake_master import check_confirm_ttl
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.clusters.ray_address import HINT, RayUnreachableError, check_gcs
from raykv.controllers.naming import (
    CONTROLLER_NAME,
    NAMESPACE,
    RECONCILER_NAME,
    SUPERVISOR_NAME,
    node_actor_name,
)
from raykv.controllers.node_records import StatsFailed
from raykv.controllers.node_settings import NodeSettings
from raykv.controllers.object_seal import read_seal_key

log = logging.getLogger(__name__)


def connect(address: str, namespace: str = NAMESPACE) -> None:
    """Join the Ray cluster at ``address`` as a driver (quietly). Raises
    ``RayUnreachableError`` (one line, with a hint) within seconds if no Ray cluster
    answers there (see ``clusters.ray_address``). Ray's auth mode: ``join_mode`` (a
    token at hand is sent, as a cluster ``ray start`` made with one wants)."""
    if ray.is_initialized():
        return
    check_gcs(address)
    join_mode()
    try:
        ray.init(address=address, namespace=namespace, logging_level="WARNING",
                 log_to_driver=False)
    except ConnectionError as e:
        raise RayUnreachableError(f"{str(e).splitlines()[0]}: {HINT}") from None


def head_node() -> dict:
    """The ``ray.nodes()`` entry of the head node."""
    for n in ray.nodes():
        if n["Alive"] and "node:__internal_head__" in n["Resources"]:
            return n
    raise RuntimeError("no alive head node in this Ray cluster")


def controller(namespace: str = NAMESPACE):
    """The running controller, or None."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        return None


def up(address: str, settings: NodeSettings | None = None, *, namespace: str = NAMESPACE,
       master_address: str | None = None, metadata_server: str | None = None,
       master_args: tuple[str, ...] = (), master_ports: tuple[int, int] = (0, 0),
       lifecycle: LifecycleSettings | None = None) -> dict:
    """Start raykv on the cluster at ``address``; returns the controller's info.

    ``settings`` (default ``NodeSettings()``) reach every node actor whole: transport
    (``protocol``, ``rdma_devices``, ``local_hostname``, ``local_buffer_size``), mode,
    budgets (``host_pool_bytes``, ``tenant_quotas``) and windows; ``up`` fills in the
    master, the metadata server and a new cluster tag. ``local_hostname`` is also where
    the master raykv starts and its metadata server listen (None: the head node's IP;
    ``127.0.0.1`` for a cluster whose nodes all run on one machine), its metrics on
    127.0.0.1 alone; any of their sockets bound wider is logged as a warning.
    ``master_ports``: the RPC and HTTP metadata ports of the master raykv starts (0: a
    free port). ``lifecycle``: where node actors run and when they leave (default
    ``LifecycleSettings()``: the head node and nodes with engines). With a disk tier
    (``settings.disk_dir``) the master raykv starts offloads on eviction
    (``disk_tier.MASTER_FLAGS``; an external master must be started so) and the seal
    key is kept in ``disk_dir`` on the head node. ``confirm_ttl_s``
    must be below the master's object lease (checked for
    the master raykv starts; with ``master_address`` it is the caller's promise).

    Raises ``ValueError`` if raykv already runs there or only one of ``master_address``
    / ``metadata_server`` is given. Logs a warning when this environment has both
    Mooncake wheels (``mooncake_wheels``; each node actor says the same for its own
    node).
    """
    if (warning := environment_warning()) is not None:
        log.warning("raykv up: %s", warning)
    if (master_address is None) != (metadata_server is None):
        raise ValueError("give both --master-address and --metadata-server of an existing "
                         "master, or neither to run one on the head node")
    settings = replace(settings or NodeSettings(), cluster_tag=uuid.uuid4().hex[:8])
    if master_address is None:
        if settings.disk_dir:
            master_args = (*MASTER_FLAGS, *master_args)
        check_confirm_ttl(settings.confirm_ttl_s, master_args)
    connect(address, namespace)
    if controller(namespace) is not None:
        raise ValueError(f"raykv is already up in namespace {namespace!r}: "
                         "use `raykv status` or `raykv down`")
    metrics_url = None  # an external master's metrics are not raykv's to read
    if master_address is None:
        head = head_node()
        try:
            ray.get_actor(SUPERVISOR_NAME, namespace=namespace)
        except ValueError:  # none runs: ports recorded by an earlier one are not ours
            internal_kv._internal_kv_del(ports_key(namespace))
        supervisor = MasterSupervisor.options(
            name=SUPERVISOR_NAME, namespace=namespace, lifetime="detached",
            get_if_exists=True,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head["NodeID"], soft=False),
        ).remote(settings.local_hostname or head["NodeManagerAddress"], list(master_args),
                 rpc_port=master_ports[0], http_port=master_ports[1])
        found = ray.get(supervisor.addresses.remote())
        master_address, metadata_server = found["master_address"], found["metadata_server"]
        metrics_url = found["metrics_url"]
        for door in found["exposed"]:
            log.warning("raykv up: %s listens beyond the address it was given (%s): "
                        "firewall that port (docs/deploy.md, Ports)", door,
                        master_address.rpartition(":")[0])
    settings = replace(settings, master_address=master_address,
                       metadata_server=metadata_server)
    if settings.disk_dir:
        settings = replace(settings, seal_key=_head_seal_key(settings.disk_dir))
    ctl, _ = start_control_plane(settings, namespace, lifecycle=lifecycle,
                                 master_metrics=metrics_url)
    return ray.get(ctl.info.remote())


def _head_seal_key(disk_dir: str) -> str:
    """The cluster's seal key, kept in ``disk_dir`` on the head node
    (``controllers.object_seal.read_seal_key``, run there as a Ray task)."""
    task = ray.remote(num_cpus=0)(read_seal_key).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(head_node()["NodeID"], soft=False))
    try:
        return ray.get(task.remote(disk_dir), timeout=60)
    except ray.exceptions.RayTaskError as e:
        raise ValueError(f"cannot keep the seal key in {disk_dir} on the head node: "
                         f"{e.cause}") from None


def drain(address: str, node_id: str, namespace: str = NAMESPACE) -> dict:
    """``NodeReconciler.drain`` of ``node_id`` (its report). ``ValueError`` if raykv does
    not run in ``namespace`` or that node has no node actor."""
    connect(address, namespace)
    try:
        reconciler = ray.get_actor(RECONCILER_NAME, namespace=namespace)
    except ValueError:
        raise ValueError(f"raykv is not running in namespace {namespace!r}") from None
    try:
        return ray.get(reconciler.drain.remote(node_id))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise e.cause from None
        raise


def status(address: str, namespace: str = NAMESPACE) -> dict:
    """The controller's info, its deployments, the master supervisor's state, every
    node actor's stats (``nodes``: node id -> ``NodeStats``, or ``StatsFailed``) and the
    reconciler's ``lifecycle`` (``NodeReconciler.leaving``: nodes leaving now, the last
    report of each that left or stayed)."""
    connect(address, namespace)
    ctl = controller(namespace)
    if ctl is None:
        raise ValueError(f"raykv is not running in namespace {namespace!r}")
    info = ray.get(ctl.info.remote())
    nodes = {}
    for node_id in info["node_ids"]:
        try:
            actor = ray.get_actor(node_actor_name(node_id), namespace=namespace)
            nodes[node_id] = ray.get(actor.stats.remote(), timeout=10)
        except Exception as e:
            nodes[node_id] = StatsFailed(str(e).splitlines()[0])
    try:
        supervisor = ray.get_actor(SUPERVISOR_NAME, namespace=namespace)
        master = ray.get(supervisor.addresses.remote(), timeout=10)
    except ValueError:
        master = {"master_address": info["master_address"], "supervised": False}
    try:
        reconciler = ray.get_actor(RECONCILER_NAME, namespace=namespace)
        lifecycle = ray.get(reconciler.leaving.remote(), timeout=10)
        lifecycle["draining"] = {}  # the progress of each drain running now
        for node_id in lifecycle["leaving"]:
            with contextlib.suppress(Exception):  # it may have just stopped
                actor = ray.get_actor(node_actor_name(node_id), namespace=namespace)
                lifecycle["draining"][node_id] = ray.get(actor.drain_status.remote(),
                                                         timeout=10)
    except Exception as e:  # status still shows the rest
        lifecycle = {"error": str(e).splitlines()[0]}
    return {"info": info, "master": master, "nodes": nodes, "lifecycle": lifecycle,
            "deployments": ray.get(ctl.deployments.remote())}


def down(address: str, namespace: str = NAMESPACE) -> list[str]:
    """Stop everything ``up`` started in ``namespace`` (pools are removed); returns what
    was stopped (actor names, and the controller's checkpoint), empty if nothing ran."""
    connect(address, namespace)
    return stop_control_plane(namespace)
