"""Asking node actors where pages live: a request's pages on every node named, all at
once within a deadline (``ask``), or what changed on one node since a router last
asked (``changes``: what keeps ``RayKVRouter``'s view fresh).

``NodeAnswers.ask`` sends one ``residency`` call to the node actor of each node named
(``cache_actors.node.residency_query``) and waits for all of them at most the
deadline; a node that did not answer in time, failed or has no node actor is left out
of the answer (it counts no pages). ``changes`` sends one ``residency_changes`` call
and raises what it raised, or ``TimeoutError`` past its deadline. Nothing here blocks
the event loop: the first call to a node looks its actor up (and, for a tenant, opens
an owner session with it) on a thread; later calls only send. A late answer is
dropped, never used. Counters in ``counts`` (event-loop thread only).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

import ray
from raykv.cache_actors.rank.rank_owner import RankOwner
from raykv.controllers.naming import node_actor_name
from raykv.controllers.owner_keys import call_purpose
from raykv.controllers.ownership import OwnerClaim
from raykv.controllers.residency import Residency, ResidencyChanges

log = logging.getLogger(__name__)

SESSION_WAIT_S = 5.0
"""Longest a tenant's owner session with a node may take to open (on a thread)."""


class NodeAnswers:
    """Residency answers of node actors in Ray namespace ``namespace``, asked with
    ``owner``'s claim (a tenant's: a fresh call proof per call)."""

    def __init__(self, namespace: str, owner: RankOwner) -> None:
        self._namespace, self._owner = namespace, owner
        self._tenant = owner.base.tenant is not None
        self._actors: dict[str, ray.actor.ActorHandle] = {}
        self._opening: dict[str, asyncio.Task] = {}
        self.counts = {"asked": 0, "answered": 0, "late": 0, "failed": 0}

    async def ask(self, node_ids: Iterable[str], keys: list[str], per_page: int,
                  deadline_s: float) -> dict[str, Residency]:
        """Residency per node of ``node_ids`` that answered within ``deadline_s``."""
        end = time.monotonic() + deadline_s
        calls: dict[asyncio.Future, str] = {}
        for node in set(node_ids):
            calls[asyncio.ensure_future(self._one(node, keys, per_page, deadline_s))] = node
        self.counts["asked"] += len(calls)
        if not calls:
            return {}
        done, late = await asyncio.wait(calls, timeout=max(0.0, end - time.monotonic()))
        for f in late:
            f.cancel()
        self.counts["late"] += len(late)
        out = {}
        for f in done:
            error = f.exception()
            if error is not None:
                self._failed(calls[f], error)
                continue
            out[calls[f]] = f.result()
        self.counts["answered"] += len(out)
        return out

    async def changes(self, node: str, since: tuple[str, int] | None,
                      deadline_s: float) -> ResidencyChanges:
        """``node``'s residency changes after ``since`` (``ResidencyQuery.changes``)
        within ``deadline_s``: ``TimeoutError`` past it, else what the call raised."""
        self.counts["asked"] += 1
        try:
            async with asyncio.timeout(deadline_s):
                actor, claim = await self._actor(node, "residency_changes", since)
                got = await actor.residency_changes.remote(since, claim, deadline_s)
        except TimeoutError:
            self.counts["late"] += 1
            raise
        except Exception as e:
            self._failed(node, e)
            raise
        self.counts["answered"] += 1
        return got

    async def _one(self, node: str, keys: list[str], per_page: int,
                   deadline_s: float) -> Residency:
        actor, claim = await self._actor(node, "residency", keys, per_page)
        return await actor.residency.remote(keys, per_page, claim, deadline_s)

    async def _actor(self, node: str, method: str,
                     *args: object) -> tuple[ray.actor.ActorHandle, OwnerClaim]:
        """``node``'s actor and the claim of the next call to it (of ``method`` with
        positional ``args``: ``RankOwner.claim``)."""
        actor = self._actors.get(node)
        if actor is None:
            actor = await self._open(node)
        claim = self._owner.claim(node_actor_name(node), _no_session,
                                  call_purpose(method, *args)) if self._tenant \
            else self._owner.base
        return actor, claim

    def _failed(self, node: str, error: BaseException) -> None:
        """A call to ``node`` failed: its actor is looked up again next time."""
        self.counts["failed"] += 1
        self._actors.pop(node, None)
        if self._tenant:  # its session may be gone (the actor restarted)
            self._owner.forget()
            self._actors.clear()
        log.debug("residency call to node %s failed: %s", node[:8], error)

    def warm(self, node_ids: Iterable[str]) -> None:
        """Start looking up the actors of ``node_ids`` not known yet (on the running
        event loop), so a request's first call to a node need not wait for it."""
        for node in set(node_ids) - set(self._actors) - set(self._opening):
            task = asyncio.ensure_future(self._open(node))
            task.add_done_callback(_quiet)

    async def _open(self, node: str) -> ray.actor.ActorHandle:
        """The node's actor, looked up (and a tenant's owner session with it opened)
        on a thread, one at a time per node: concurrent requests share it."""
        task = self._opening.get(node)
        if task is None:
            task = self._opening[node] = asyncio.ensure_future(
                asyncio.to_thread(self._open_blocking, node))
            task.add_done_callback(lambda t: self._opening.pop(node, None))
        actor = await asyncio.shield(task)
        self._actors[node] = actor
        return actor

    def _open_blocking(self, node: str) -> ray.actor.ActorHandle:
        name = node_actor_name(node)
        actor = ray.get_actor(name, namespace=self._namespace)

        def ask(method: str, *args):
            return ray.get(getattr(actor, method).remote(*args), timeout=SESSION_WAIT_S)
        if self._tenant:
            self._owner.claim(name, ask, "")  # opens the session (this proof is unused)
        return actor


def _quiet(task: asyncio.Task) -> None:
    """A warming look-up that failed is tried again by the next request."""
    if not task.cancelled() and task.exception() is not None:
        log.debug("looking up a node actor failed: %s", task.exception())


def _no_session(method: str, *args):
    """A tenant's claim is made on the event loop only once its session is open."""
    raise RuntimeError("no owner session with this node actor (opened on first use)")
