"""Creating, finding and retiring the node actors, and the reconciler that keeps one on
each node that needs it (``clusters.node_lifecycle``) as the autoscaler adds and
removes nodes: it starts them, retires those without engines, and drains those of nodes
that leave with notice."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

import ray
from raykv.cache_actors.node.node_actor import node_actor_class
from raykv.cache_actors.processes import ProcessIdentity
from raykv.clusters.node_lifecycle import (
    Leaving,
    LifecycleSettings,
    NodeLifecycle,
    NodeSeen,
)
from raykv.clusters.store_usage import drain_room
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name
from raykv.controllers.node_settings import NodeSettings

log = logging.getLogger(__name__)

def named_node_actors(namespace: str) -> list[str]:
    """Names of every node actor in ``namespace``, whether or not its node is alive."""
    prefix = node_actor_name("")
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith(prefix))


HEAD_RESOURCE = "node:__internal_head__"
"""The resource Ray gives the head node alone."""
LOOK_TIMEOUT_S = 3.0
"""Seconds one look waits for the GCS's draining nodes and for each node actor's
engine count (a node actor that does not answer in time is not retired this look)."""
STOP_TIMEOUT_S = 30.0
"""Seconds a leaving node actor has to shut down cleanly before it is killed."""


def alive_node_ids() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def draining_nodes() -> dict[str, int]:
    """Node id -> the wall-clock deadline (ms; 0: none) of every node Ray drains now
    (``GcsClient.get_draining_nodes``: a private API of Ray 2.60; {} if it fails)."""
    try:
        gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
        found = gcs.get_draining_nodes(timeout=LOOK_TIMEOUT_S)
    except Exception as e:  # a look without drains is safe: the next one sees them
        log.warning("could not read Ray's draining nodes: %s", e)
        return {}
    return {(k.hex() if isinstance(k, bytes) else k): int(v) for k, v in found.items()}


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
    """Looks at the cluster every ``period_s`` seconds and does what
    ``NodeLifecycle.plan`` says: starts node actors (telling the controller), retires
    those of nodes that left, and lets node actors leave (drain, then stop) in tasks of
    their own beside later looks. ``want`` and ``drain`` are the engines' and the
    operator's ways in. All on one event loop (async actor)."""

    def __init__(self, settings: NodeSettings, namespace: str, period_s: float = 1.0,
                 overrides: dict[str, int] | None = None,
                 lifecycle: LifecycleSettings | None = None,
                 master_metrics: str | None = None) -> None:
        self._settings = settings
        self._master_metrics = master_metrics  # the room of drains; None: not known
        self._namespace = namespace
        self._period = period_s
        self._overrides = dict(overrides or {})
        self._lifecycle = NodeLifecycle(lifecycle or LifecycleSettings())
        self._controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
        self._reports: dict[str, dict] = {}  # node -> how its last leaving went
        self._leavings: dict[str, asyncio.Task] = {}  # node -> its leaving, running
        self._stopping: set[str] = set()  # leavings past calling off: the actor stops
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
        """One look: ``{"added": [...], "retired": [...], "leaving": [...]}`` node ids
        (leaving: drains begun by this look). A listed node whose actor is gone for good
        (killed without restart) gets a new one too."""
        seen = await self._look()
        plan = self._lifecycle.plan(seen, time.monotonic(), int(time.time() * 1000))
        for node_id in plan.start:
            await self._start(node_id)
        for node_id in plan.left:
            retire_node_actor(node_id, self._namespace)
            await self._controller.retire_node.remote(node_id)
            log.info("node %s left: node actor retired", node_id[:12])
        if plan.left:  # its segment's objects leave the store, leases or not
            self._forget_confirmations()
        for leaving in plan.leaving:
            self._leave(leaving)
        return {"added": plan.start, "retired": plan.left,
                "leaving": [x.node_id for x in plan.leaving]}

    async def _look(self) -> list[NodeSeen]:
        listed = set(await self._controller.nodes.remote())
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        draining = await asyncio.to_thread(draining_nodes)
        actors = {n: a for n in nodes if (a := self._actor(n)) is not None}
        asked = actors if self._lifecycle.settings.retire_idle_s > 0 else {}  # else unused
        counts = await asyncio.gather(*(self._engines(a) for a in asked.values()))
        engines = dict(zip(asked, counts, strict=True))
        return [NodeSeen(n, info["Alive"], HEAD_RESOURCE in info.get("Resources", {}),
                         n in listed, n in actors, engines.get(n), draining.get(n))
                for n, info in nodes.items()] + [
            NodeSeen(n, False, listed=True) for n in listed - nodes.keys()]

    def _actor(self, node_id: str):
        try:
            return ray.get_actor(node_actor_name(node_id), namespace=self._namespace)
        except ValueError:
            return None

    @staticmethod
    async def _engines(actor) -> int | None:
        try:
            return await asyncio.wait_for(actor.engines.remote(), LOOK_TIMEOUT_S)
        except Exception:  # starting, restarting or hung: not retired on this look
            return None

    async def _start(self, node_id: str) -> None:
        size = self._overrides.get(node_id, self._settings.global_segment_size)
        actor = start_node_actor(node_id, replace(self._settings, global_segment_size=size),
                                 self._namespace)
        await self._controller.register_node.remote(node_id)
        self._lifecycle.started(node_id, time.monotonic())
        log.info("node %s: node actor started", node_id[:12])
        return actor

    # ------------------------------------------------------------ ways in
    async def want(self, node_id: str, engine: ProcessIdentity | None = None) -> None:
        """An engine on ``node_id`` needs its node actor: returns once it answers (at
        once if it runs), with ``engine`` (that engine's process) counted as its engine.
        A retirement for idleness is called off, or, once it is stopping the actor,
        waited out and a new actor started. ``ValueError`` if that node is not alive or
        is draining."""
        if node_id not in alive_node_ids():
            raise ValueError(f"node {node_id[:12]} is not an alive Ray node")
        if (why := self._lifecycle.want(node_id, time.monotonic())) is not None:
            raise ValueError(why)
        if node_id in self._stopping:
            await self._leavings[node_id]  # never raises: the report says how it went
            await self._gone(node_id)
        actor = self._actor(node_id)
        leaving = self._lifecycle.leaving().get(node_id)
        if actor is None and leaving is None:
            actor = await self._start(node_id)
        if actor is not None:
            if leaving == "idle":  # called off at once: its puts land on its own segment
                await actor.undrain.remote()
            await actor.health.remote()
            if engine is not None:
                await actor.engines.remote(engine)

    async def _gone(self, node_id: str) -> None:
        """Until the node actor of ``node_id``, killed, no longer answers to its name
        (at most ``STOP_TIMEOUT_S`` seconds)."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while self._actor(node_id) is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)

    async def drain(self, node_id: str) -> dict:
        """``raykv drain``: the node actor of ``node_id`` drains its cache and stops, and
        none starts there again while the node lives; returns how it went (the drain's
        report, or ``{"error": ...}``). ``ValueError`` if it has no node actor or is the
        head node."""
        if self._actor(node_id) is None:
            raise ValueError(f"node {node_id[:12]} has no raykv node actor")
        if any(n["NodeID"] == node_id and HEAD_RESOURCE in n.get("Resources", {})
               for n in ray.nodes()):
            raise ValueError(f"node {node_id[:12]} is the head node: it keeps its node actor "
                             "(raykv down stops raykv)")
        leaving = self._lifecycle.operator_drain(node_id)
        while (running := self._leavings.get(node_id)) is not None:
            await running  # a retirement or a Ray drain under way ends first
        if self._actor(node_id) is not None and (task := self._leave(leaving)) is not None:
            await task  # still there (a retirement called off): it leaves now
        return self._reports.get(node_id, {})

    def leaving(self) -> dict:
        """Node -> reason for the nodes leaving now, and the last report of each node
        that left or stayed (for ``raykv status``)."""
        return {"leaving": self._lifecycle.leaving(), "reports": dict(self._reports)}

    # ----------------------------------------------------------- leaving
    def _leave(self, leaving: Leaving) -> asyncio.Task | None:
        if not self._lifecycle.begin(leaving):
            return None
        task = asyncio.get_event_loop().create_task(self._run_leaving(leaving))
        self._leavings[leaving.node_id] = task
        task.add_done_callback(self._left)
        return task

    def _left(self, task: asyncio.Task) -> None:
        """A leaving ended: no longer running (a later one of that node stays)."""
        for node_id, running in list(self._leavings.items()):
            if running is task:
                del self._leavings[node_id]

    async def _run_leaving(self, leaving: Leaving) -> None:
        """Drain (when on), then stop the node actor, unless an idle retirement is
        called off meanwhile. Never raises: the outcome goes to ``_reports``."""
        node_id, stopped = leaving.node_id, False
        report: dict = {"reason": leaving.reason, "deadline_s": leaving.deadline_s}
        try:
            actor = self._actor(node_id)
            if actor is None:
                report["outcome"] = "gone"
                return
            if leaving.deadline_s > 0 and not self._lifecycle.called_off(node_id, 0):
                report |= await self._drained(actor, leaving)
            engines = await self._engines(actor)
            unknown = engines is None and leaving.reason == "idle"  # keep what we can't tell
            if unknown or self._lifecycle.called_off(node_id, engines or 0):
                await actor.undrain.remote()
                report["outcome"] = "kept"
                log.info("node %s: retirement called off (an engine came)", node_id[:12])
                return
            self._stopping.add(node_id)  # no await since the check: an engine asking now waits
            await self._controller.retire_node.remote(node_id)
            with contextlib.suppress(Exception):  # killed below anyway
                await asyncio.wait_for(actor.shutdown.remote(), STOP_TIMEOUT_S)
            retire_node_actor(node_id, self._namespace)
            stopped = True
            report["outcome"] = "stopped"
            self._forget_confirmations()
            log.info("node %s: node actor stopped (%s)", node_id[:12], leaving.reason)
        except Exception as e:
            report["error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
            log.exception("node %s: leaving (%s) failed", node_id[:12], leaving.reason)
        finally:
            self._reports[node_id] = report
            self._stopping.discard(node_id)
            self._lifecycle.end(node_id, stopped, time.monotonic())

    async def _drained(self, actor, leaving: Leaving) -> dict:
        """The node actor's drain within the deadline, bounded by the store's room for
        its segment (its report), or what went wrong."""
        try:
            room = await self._room(actor)
            if self._lifecycle.called_off(leaving.node_id, 0):  # an engine came meanwhile:
                return {}  # a drain begun after its undrain would steer its puts away
            return await asyncio.wait_for(
                actor.drain.remote(leaving.deadline_s, room, leaving.reason),
                leaving.deadline_s + LOOK_TIMEOUT_S)
        except Exception as e:  # it still stops: the node is leaving or idle
            log.warning("node %s: drain failed: %s", leaving.node_id[:12], e)
            return {"drain_error": str(e).splitlines()[0] if str(e) else type(e).__name__}

    async def _room(self, actor) -> int:
        """``store_usage.drain_room`` of ``actor``'s segment (0 when unknown)."""
        segment = (await actor.health.remote()).get("segment")
        room = await asyncio.to_thread(drain_room, self._master_metrics, segment)
        if room == 0:
            log.warning("no room known or left for a drain of %s (master metrics %s): it "
                        "moves nothing", segment, self._master_metrics)
        return room

    def _forget_confirmations(self) -> None:
        """A segment left: the others' confirmed pages may be gone with it."""
        for node_id in alive_node_ids():
            if (actor := self._actor(node_id)) is not None:
                actor.forget_confirmations.remote()

    def stop(self) -> None:
        self._task.cancel()
