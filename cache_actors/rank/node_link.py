"""A rank's route to the raykv actors: its node's actor and the controller.

Data ops (``DataOp``) go over the node actor's local channel when the client runs on
that actor's node (~0.1 ms), else through a Ray call (~1 ms); control calls (pools,
health, stats) always through Ray. An actor that cannot be reached (Ray says it is dead
or restarting, its channel broke, or its store is restarting) becomes a retryable
``NodeUnavailableError``, after the actors are looked up again by name (re-attach) so
that the retry reaches their replacements; the link is then *stale*, and its next call
first re-maps the client's pools (``remap``), whose memory the replacement may have
allocated anew.

Another node's actor (a lookup home elsewhere) is looked up by name once and kept until
a re-attach; ``prepare`` opens a route (the channel, or that handle and the owner
session) before the first data op, so that op is one round trip (a registration does,
``group_registration``).

Deadlines: every data op has ``timeout_s`` (``StorageConfig.timeout_s``), and whatever it
does first (re-map after a re-attach, ask the actor for its channel's path) happens
within that deadline too; every control call has ``CONTROL_TIMEOUT_S`` (creating a pool
reserves its memory, seconds per GiB on a slow host). A budget entered on the calling
thread (``cache_actors.rank.call_budget``) shortens both to what it has left and is spent by
them; with nothing left a call fails at once. A call that runs past its deadline raises
``DeadlineExceededError`` (a ``NodeUnavailableError``): a Ray call is cancelled (best
effort: a call the actor already started runs on), a channel connection is closed so
that a late reply is never taken for the next call's. A deadline does not make the link
stale: the actor may only be slow, and re-mapping would ask it a control call.

Circuit breaker: every data op runs through this process's guard on the actor it goes
to (``node_guard``): once data ops in a row ran into deadlines that add up to one
``timeout_s``, data ops fail at once (``CircuitOpenError``) until a probe finds the
actor answering again.

Retry: a channel call whose request certainly never reached the actor (the connection
broke before the request was written whole: the actor that owned it died, and was
restarted) re-attaches, re-maps and is sent once more on a new connection, within the
same deadline; any other failure is the caller's to retry (the actor may have run it).

Owner: the link carries its client's owner (``RankOwner``): every channel connection
starts with its claim and every Ray data call ends with one (pool calls pass it
themselves: ``claim``, ``PoolLifecycle``), so the node actor serves the client's own
pools and keys only; a tenant's claim carries a fresh call proof of its owner session
with that actor (opened at the first call, within the data op's deadline). A refused
claim is a ``ValueError``; a session the actor no longer holds, a retryable
``NodeUnavailableError`` (re-attaching forgets the sessions).

Threads: any thread of the rank may call; the channel gives each calling thread its
own connection. Re-attaching is not locked: concurrent failures each re-attach.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import ray
from raykv.cache_actors.channel_socket import ChannelClosedError, RequestNotSentError
from raykv.cache_actors.data_ops import ASYNC_OPS, DEADLINE_OPS, TICKETED_OPS, DataOp
from raykv.cache_actors.errors import DeadlineExceededError, NodeUnavailableError
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.rank.call_budget import spending, time_left
from raykv.cache_actors.rank.channel_client import ChannelClient
from raykv.cache_actors.rank.node_guard import guard_of
from raykv.cache_actors.rank.node_lookup import node_actor_of
from raykv.cache_actors.tickets import process_book
from raykv.controllers.contract import DEFAULT_TIMEOUT_S
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name
from raykv.controllers.owner_keys import call_purpose
from raykv.controllers.ownership import OwnerClaim

if TYPE_CHECKING:
    from raykv.cache_actors.rank.rank_owner import RankOwner

CONTROL_TIMEOUT_S = 120.0
"""Deadline of a control call (pools, health, stats, registration), in seconds."""
MIN_CALL_S = 0.001
"""A call with less time than this left (budget spent) fails without being sent."""


def sent_again(error: NodeUnavailableError) -> bool:
    """Whether a channel call that failed with ``error`` is sent once more (re-attached,
    on a new connection, within its deadline): only if its request certainly never
    reached the actor (see the module docstring)."""
    return isinstance(error.__cause__, RequestNotSentError)


class NodeLink:
    """The route of one client to the actor of ``node_id`` in ``namespace`` (and to any
    other node's actor and the controller). ``remap()`` is called before the first call
    after the link went stale (see the module docstring); it may use ``ask``.
    ``timeout_s``: the deadline of each data op, in seconds; ``owner``: the client's
    owner (None: it sends no claim). The node's actor is started if it has none
    (``node_lookup``); ``NodeUnavailableError`` if none can be."""

    def __init__(self, node_id: str, namespace: str, remap: Callable[[], None],
                 timeout_s: float = DEFAULT_TIMEOUT_S, owner: RankOwner | None = None
                 ) -> None:
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.owner = owner
        self._namespace = namespace
        self._remap = remap
        self._local = node_id == ray.get_runtime_context().get_node_id()
        # an engine here: counted as its node actor's (which stays while it lives)
        self._actor = node_actor_of(node_id, namespace,
                                    ProcessIdentity.current() if self._local else None)
        self._channel: ChannelClient | None = None
        self._controller: Any = None
        self._others: dict[str, Any] = {}  # other nodes' actors, by node id (``_actor_of``)
        # .deadline, .granted: of the call in progress on a thread (``bounded``)
        self._calls = threading.local()
        self.stale = False

    # ------------------------------------------------------------------ calls
    def call(self, method: str, *args, **kwargs) -> Any:
        """Control ``method`` of this node's actor, through Ray (re-maps first if stale)."""
        self._refresh()
        return self.ask(method, *args, **kwargs)

    def ask(self, method: str, *args, **kwargs) -> Any:
        """Control ``method`` of this node's actor, without re-mapping first (``remap``
        itself calls this; inside a data op, within that op's deadline)."""
        with self.bounded(CONTROL_TIMEOUT_S, method):
            return self._ray(self._actor, method, *args, **kwargs)

    def data(self, op: DataOp, *args, node_id: str | None = None) -> Any:
        """Data op ``op`` on the node actor of ``node_id`` (default: this link's node):
        over the local channel when that actor runs on this node, else through Ray;
        ``CircuitOpenError`` at once while that actor's breaker is open. A put or get is
        final when it returns: it carries a ticket, settled if the call fails
        (``cache_actors.tickets``: it may wait for a store call of it to end)."""
        target = self.node_id if node_id is None else node_id
        guard = guard_of(self._namespace, target)
        with self.bounded(self.timeout_s, op) as granted, guard.call(op, granted,
                                                                     self.timeout_s):
            self._refresh()
            if op in TICKETED_OPS:
                with process_book().held() as ticket:
                    return self._data(op, target, (*args, ticket))
            return self._data(op, target, args)

    def _data(self, op: DataOp, target: str, args: tuple) -> Any:
        """``data``'s call itself, inside its deadline (``bounded``) and guard."""
        if target != self.node_id or not self._local:
            remote = target != self.node_id
            kw = {"deadline": self._calls.deadline} if op in DEADLINE_OPS else {}
            if op in TICKETED_OPS:  # the batch, then its ticket: both named on Ray
                *args, ticket = args
                kw["ticket"] = ticket
            claim = self.claim(target if remote else None, op, *args)
            if claim is not None:  # by name, as the channel hands it to the handler
                kw["claim"] = claim
            actor = self._actor_of(target) if remote else self._actor
            return self._ray(actor, op, *args, **kw)
        try:
            with self._retryable(op):
                return self._over_channel(op, args)
        except NodeUnavailableError as e:
            if not sent_again(e):
                raise
        self._refresh()  # re-attached: the replacement's pools
        with self._retryable(op):
            return self._over_channel(op, args)

    @contextlib.contextmanager
    def bounded(self, limit_s: float, what: str) -> Iterator[float]:
        """Run the calls of the block within ``limit_s`` seconds, less where a budget
        entered on this thread (``cache_actors.rank.call_budget``) or the call around this one
        (a data op) ends sooner, and spend the time it takes from those budgets; yields
        the seconds granted to the caller's call (the outermost one on this thread: a
        group query's, for the data op it ends with). ``DeadlineExceededError`` at once
        when less than ``MIN_CALL_S`` is left."""
        outer = getattr(self._calls, "deadline", None)
        now = time.monotonic()
        seconds = time_left(limit_s) if outer is None else min(limit_s, outer - now)
        if seconds < MIN_CALL_S:
            raise DeadlineExceededError(
                f"raykv {what} (node {self.node_id[:12]}) not sent: the time this thread "
                "may wait on raykv (its budget, or the call it is part of) is spent")
        if outer is not None:  # the call around this one sets the deadline and spends
            yield self._calls.granted
            return
        self._calls.deadline, self._calls.granted = now + seconds, seconds
        try:
            with spending():
                yield seconds
        finally:
            self._calls.deadline = None

    def claim(self, node_id: str | None, method: str, *args: object) -> OwnerClaim | None:
        """The owner claim for one call of ``method`` with positional ``args`` (those
        before the claim, as the actor receives them; ``"channel"`` and none for a
        channel connection) to the actor of ``node_id`` (None: this link's node); None
        without an owner. A tenant's proof is good for that call only; its session with
        that actor is opened first if there is none (two Ray calls within
        ``timeout_s``)."""
        if self.owner is None:
            return None
        node = node_id or self.node_id
        actor = self._actor if node == self.node_id else self._actor_of(node)
        # only a tenant's proof covers its call: without one no digest of the arguments
        purpose = call_purpose(method, *args) if self.owner.base.tenant is not None else ""
        with self.bounded(self.timeout_s, "owner session"):
            return self.owner.claim(node, lambda m, *a: self._ray(actor, m, *a), purpose)

    def ask_at(self, node_id: str, method: str, *args) -> Any:
        """Control ``method`` of the actor of ``node_id`` (this link's node or another),
        through Ray, without re-mapping first."""
        actor = self._actor if node_id == self.node_id else self._actor_of(node_id)
        with self.bounded(CONTROL_TIMEOUT_S, method):
            return self._ray(actor, method, *args)

    def prepare(self, node_id: str) -> None:
        """Open the route of data ops to the actor of ``node_id`` now, so that the first
        one is a single round trip: the local channel (its path asked of the actor, a
        connection for data ops and one for group queries opened with the claim) when
        that actor is this node's and runs here, else the actor looked up (kept until a
        re-attach) and, with a tenant, the owner session with it opened. Within
        ``timeout_s``."""
        with self.bounded(self.timeout_s, "prepare"):
            self._refresh()
            if node_id == self.node_id and self._local:
                with self._retryable("prepare"):  # group queries have connections apart
                    self._open_channel().warm(DataOp.GROUP_EXISTS.value, self._calls.deadline)
                return
            actor = self._actor if node_id == self.node_id else self._actor_of(node_id)
            if self.owner is not None:
                self.owner.session(node_id, lambda m, *a: self._ray(actor, m, *a))

    def ask_controller(self, method: str, *args) -> Any:
        """``method`` of the controller (looked up by name once, and again after a
        re-attach); ``NodeUnavailableError`` if there is none."""
        if self._controller is None:
            try:
                self._controller = ray.get_actor(CONTROLLER_NAME, namespace=self._namespace)
            except ValueError as e:
                raise NodeUnavailableError("no raykv controller in namespace "
                                           f"{self._namespace!r}; is raykv running?") from e
        with self.bounded(CONTROL_TIMEOUT_S, method):
            return self._ray(self._controller, method, *args)

    @property
    def controller_attached(self) -> bool:
        """False until the controller was reached, and again after a re-attach or a
        group's home node could not be found (the group may have moved: register
        again)."""
        return self._controller is not None

    def close(self) -> None:
        """Close the channel (the next local data op opens it again)."""
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    # ---------------------------------------------------------------- helpers
    def _refresh(self) -> None:
        if self.stale:
            self._remap()
            self.stale = False

    def _actor_of(self, node_id: str) -> Any:
        """The actor of another node, looked up by name once (again after a re-attach)."""
        actor = self._others.get(node_id)
        if actor is not None:
            return actor
        try:
            actor = ray.get_actor(node_actor_name(node_id), namespace=self._namespace)
        except ValueError as e:
            self._controller = None  # ask the controller again: the group may have moved
            raise NodeUnavailableError(f"no raykv node actor on node {node_id[:12]}; retry "
                                       "the call") from e
        self._others[node_id] = actor
        return actor

    def _over_channel(self, op: DataOp, args: tuple) -> Any:
        """``op`` over the local channel, opened first if it is not (its path asked of
        the actor through Ray), all within the call's deadline."""
        return self._open_channel().call(op.value, *args, timeout_s=self._left())

    def _open_channel(self) -> ChannelClient:
        """The local channel, opened first if it is not (its path asked of the actor
        through Ray, a first connection made), within the call's deadline."""
        if self._channel is None:
            path = self._ray(self._actor, "channel_path")
            bind = None if self.owner is None else partial(self.claim, None, "channel")
            self._channel = ChannelClient(path, async_ops=ASYNC_OPS, timeout_s=self.timeout_s,
                                          bind=bind, deadline=self._calls.deadline)
        return self._channel

    def _left(self) -> float:
        """Seconds left to the call in progress on this thread (``bounded``)."""
        return self._calls.deadline - time.monotonic()

    def _ray(self, actor: Any, method: str, *args, **kwargs) -> Any:
        """``method`` of ``actor`` through Ray, within the call's deadline."""
        with self._retryable(method):
            ref = getattr(actor, method).remote(*args, **kwargs)
            timeout_s = max(0.0, self._left())
            try:
                return ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                with contextlib.suppress(Exception):  # best effort: it may have started
                    ray.cancel(ref)
                raise DeadlineExceededError(
                    f"raykv actor call {method} (node {self.node_id[:12]}) did not finish "
                    f"within {timeout_s:.3g} s; the actor may be hung or overloaded: retry "
                    "later") from None

    @contextlib.contextmanager
    def _retryable(self, what: str) -> Iterator[None]:
        """Turn an unreachable actor and a store restart inside it into
        ``NodeUnavailableError``, after re-attaching (see the module docstring)."""
        try:
            yield
        except DeadlineExceededError:  # slow, not gone: no re-attach, no re-map
            raise
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ChannelClosedError) as e:
            self._reattach()
            raise NodeUnavailableError(
                f"raykv actor for {what} (node {self.node_id[:12]}) is unavailable ({e}); "
                "it is restarted automatically: retry the call") from e
        except NodeUnavailableError as e:  # raised by the actor: its store is restarting
            self._reattach()
            raise NodeUnavailableError(
                f"node {self.node_id[:12]}: {getattr(e, 'cause', e)}") from None

    def _reattach(self) -> None:
        """Look the node actor and controller up by name again, so the next call reaches
        a replacement (one the reconciler started after the old one died for good)."""
        with contextlib.suppress(ValueError):
            self._actor = ray.get_actor(node_actor_name(self.node_id), namespace=self._namespace)
        self._controller = None
        self._others.clear()
        if self.owner is not None:
            self.owner.forget()
        self.close()
        self.stale = True
