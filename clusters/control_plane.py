"""Starting and stopping raykv's actors on a running Ray cluster: the controller, the
reconciler (and through it the node actors, where ``clusters.node_lifecycle`` says)
and, when raykv runs its own
master, the master supervisor. Used by ``start_local`` and by ``raykv up``/``down``."""

from __future__ import annotations

import contextlib
import logging
import time

import ray
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.clusters.master_supervisor import ports_key
from raykv.clusters.node_actors import HEAD_RESOURCE, NodeReconciler, named_node_actors
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.controllers.controller import CacheController, checkpoint_key
from raykv.controllers.naming import CONTROLLER_NAME, RECONCILER_NAME, SUPERVISOR_NAME
from raykv.controllers.node_settings import NodeSettings

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
SHUTDOWN_TIMEOUT_S = 30.0
"""How long ``stop_control_plane`` waits for the node actors (all at once) and for the
master supervisor to stop cleanly before it kills them."""


def start_control_plane(settings: NodeSettings, namespace: str, *,
                        reconcile_period_s: float = 1.0,
                        overrides: dict[str, int] | None = None,
                        lifecycle: LifecycleSettings | None = None,
                        master_metrics: str | None = None):
    """Start the controller and the reconciler (detached, named, on the head node: an
    actor on another node would keep that node busy for Ray's autoscaler) and run one
    reconcile pass; returns ``(controller, reconciler)`` once every node actor answers.
    ``lifecycle``: where node actors run and when they leave (default
    ``LifecycleSettings()``: the head node, nodes with engines, nodes kept);
    ``master_metrics``: the master's metrics URL, read on the head node for the room a
    drain has (None: drains move nothing, they only write L2's unsaved pages)."""
    on_head = head_affinity()
    info = {"master_address": settings.master_address,
            "metadata_server": settings.metadata_server, "cluster_tag": settings.cluster_tag,
            "mode": settings.mode, "host_pool_bytes": settings.host_pool_bytes}
    controller = CacheController.options(
        name=CONTROLLER_NAME, namespace=namespace, lifetime="detached", get_if_exists=True,
        scheduling_strategy=on_head,
    ).remote(info, namespace, settings.tenant_digests, settings.bound_tenants_only)
    ray.get(controller.info.remote())
    reconciler = NodeReconciler.options(
        name=RECONCILER_NAME, namespace=namespace, lifetime="detached", get_if_exists=True,
        scheduling_strategy=on_head,
    ).remote(settings, namespace, reconcile_period_s, overrides, lifecycle, master_metrics)
    ray.get(reconciler.reconcile.remote())
    names = ray.get(controller.nodes.remote()).values()
    ray.get([ray.get_actor(n, namespace=namespace).health.remote() for n in names])
    return controller, reconciler


def head_affinity() -> NodeAffinitySchedulingStrategy:
    """Scheduling on the head node (soft: anywhere if it has none alive)."""
    head = next((n["NodeID"] for n in ray.nodes()
                 if n["Alive"] and HEAD_RESOURCE in n.get("Resources", {})), None)
    if head is None:
        head = ray.get_runtime_context().get_node_id()
    return NodeAffinitySchedulingStrategy(head, soft=True)


def _named(name: str, namespace: str):
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def stop_control_plane(namespace: str) -> list[str]:
    """Stop everything raykv runs in ``namespace``: reconciler, node actors (their pools
    removed; all at once), controller (its checkpoint deleted) and the master supervisor
    (its recorded ports deleted). Returns what was there to stop (actor names,
    ``checkpoint`` if one was deleted): empty if raykv did not run in ``namespace``."""
    stopped = []
    reconciler = _named(RECONCILER_NAME, namespace)
    if reconciler is not None:
        ray.kill(reconciler, no_restart=True)
        stopped.append(RECONCILER_NAME)
    actors = {name: actor for name in named_node_actors(namespace)
              if (actor := _named(name, namespace)) is not None}
    # every node actor shuts down at once (each closes its Mooncake client: ~1 s)
    closing = {name: actor.shutdown.remote() for name, actor in actors.items()}
    deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
    for name, actor in actors.items():
        try:
            ray.get(closing[name], timeout=max(0.0, deadline - time.monotonic()))
        except Exception as e:  # a dead actor still has to be killed below
            log.warning("%s did not shut down cleanly: %s", name, e)
        ray.kill(actor, no_restart=True)
        stopped.append(name)
    controller = _named(CONTROLLER_NAME, namespace)
    if controller is not None:
        ray.kill(controller, no_restart=True)
        stopped.append(CONTROLLER_NAME)
    with contextlib.suppress(Exception):
        if internal_kv._internal_kv_del(checkpoint_key(namespace)):
            stopped.append("checkpoint")
    supervisor = _named(SUPERVISOR_NAME, namespace)
    if supervisor is not None:
        with contextlib.suppress(Exception):
            ray.get(supervisor.stop.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        ray.kill(supervisor, no_restart=True)
        stopped.append(SUPERVISOR_NAME)
    with contextlib.suppress(Exception):  # the master's ports, recorded by its supervisor
        internal_kv._internal_kv_del(ports_key(namespace))
    return stopped
