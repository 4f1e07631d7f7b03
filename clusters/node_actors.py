"""Creating, finding and retiring the node actors, and the reconciler that
keeps exactly one per alive Ray node as the autoscaler adds and removes nodes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import replace

import ray
from raykv.cache_actors.node.node_actor import node_actor_class
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name
from raykv.controllers.node_settings import NodeSettings

log = logging.getLogger(__name__)

def named_node_actors(namespace: str) -> list[str]:
    """Names of every node actor in ``namespace``, whether or not its node is alive."""
    prefix = node_actor_name("")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(prefix))


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def start_node_actor(node_id: str, settings: NodeSettings, namespace: str):
    """The node actor of ``node_id`` (see ``node_actor_class``); the existing one if it
    is already there."""
    return node_actor_class(node_id, namespace, settings.env).remote(
        node_id, **settings.actor_kwargs())


def retire_node_actor(node_id: str, namespace: str) -> None:
    """Kill the node actor of a node that left (it cannot be rescheduled anyway)."""
    with contextlib.suppress(ValueError):  # already gone
        ray.kill(ray.get_actor(node_actor_name(node_id), namespace=namespace), no_restart=True)


@ray.remote(num_cpus=0, max_restarts=-1)
class NodeReconciler:
    """Polls the alive Ray nodes every ``period_s`` seconds; starts a node actor on each
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
            log.info("node %s joined: node actor started", node_id[:12])
        for node_id in retired:
            retire_node_actor(node_id, self._namespace)
            await self._controller.retire_node.remote(node_id)
            log.info("node %s left: node actor retired", node_id[:12])
        if retired:  # its segment's objects leave the store, leases or not
            for node_id in alive & known:
                with contextlib.suppress(ValueError):
                    ray.get_actor(node_actor_name(node_id), namespace=self._namespace
                                  ).forget_confirmations.remote()
        return {"added": added, "retired": retired}

    def stop(self) -> None:
        self._task.cancel()
