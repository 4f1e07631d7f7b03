"""A rank's route to the raykv actors: its node's cache actor and the controller.

Data ops (``DataOp``) go over the node actor's local channel when the client runs on
that actor's node (~0.1 ms), else through a Ray call (~1 ms); control calls (pools,
health, stats) always through Ray. An actor that cannot be reached (Ray says it is dead
or restarting, its channel broke, or its store is restarting) becomes a retryable
``NodeUnavailableError``, after the actors are looked up again by name (re-attach) so
that the retry reaches their replacements; the link is then *stale*, and its next call
first re-maps the client's pools (``remap``), whose memory the replacement may have
allocated anew.

Deadlines: every data op has ``timeout_s`` (``StorageConfig.timeout_s``; a data op that
first opens the channel asks the actor for its path within it too), every control
call ``CONTROL_TIMEOUT_S`` (creating a pool reserves its memory, seconds per GiB on a
slow host). A call that runs past its deadline raises ``DeadlineExceededError`` (a
``NodeUnavailableError``): a Ray call is cancelled (best effort: a call the actor already
started runs on), a channel connection is closed so that a late reply is never taken
for the next call's. A deadline does not make the link stale: the actor may only be
slow, and re-mapping would ask it a control call.

Owner: the link carries its client's owner claim (``controllers.ownership``): every
channel connection starts with it and every Ray data call ends with it (pool calls pass
it themselves: ``PoolLifecycle``), so the node actor serves the client's own pools and
keys only. A refused claim is a ``ValueError``.

Threads: any thread of the rank may call; the channel gives each calling thread its
own connection. Re-attaching is not locked: concurrent failures each re-attach.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import ray
from raykv.cache_actors.data_ops import ASYNC_OPS, TICKETED_OPS, DataOp
from raykv.cache_actors.errors import DeadlineExceededError, NodeUnavailableError
from raykv.cache_actors.local_channel import ChannelClient, ChannelClosedError
from raykv.cache_actors.tickets import process_book
from raykv.controllers.contract import DEFAULT_TIMEOUT_S
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name
from raykv.controllers.ownership import OwnerClaim

CONTROL_TIMEOUT_S = 120.0
"""Deadline of a control call (pools, health, stats, registration), in seconds."""


class NodeLink:
    """The route of one client to the actor of ``node_id`` in ``namespace`` (and to any
    other node's actor and the controller). ``remap()`` is called before the first call
    after the link went stale (see the module docstring); it may use ``ask``.
    ``timeout_s``: the deadline of each data op, in seconds; ``owner``: the client's
    owner claim (None: none). ``NodeUnavailableError`` if that node has no cache
    actor."""

    def __init__(self, node_id: str, namespace: str, remap: Callable[[], None],
                 timeout_s: float = DEFAULT_TIMEOUT_S, owner: OwnerClaim | None = None
                 ) -> None:
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.owner = owner
        self._namespace = namespace
        self._remap = remap
        try:
            self._actor = ray.get_actor(node_actor_name(node_id), namespace=namespace)
        except ValueError as e:
            raise NodeUnavailableError(
                f"no raykv cache actor on node {node_id[:12]} (namespace {namespace!r}); "
                "is raykv running on this cluster?") from e
        self._local = node_id == ray.get_runtime_context().get_node_id()
        self._channel: ChannelClient | None = None
        self._controller: Any = None
        self.stale = False

    # ------------------------------------------------------------------ calls
    def call(self, method: str, *args, **kwargs) -> Any:
        """Control ``method`` of this node's actor, through Ray (re-maps first if stale)."""
        self._refresh()
        return self.ask(method, *args, **kwargs)

    def ask(self, method: str, *args, **kwargs) -> Any:
        """Control ``method`` of this node's actor, without re-mapping first (``remap``
        itself calls this)."""
        return self._ray(self._actor, method, *args, **kwargs)

    def data(self, op: DataOp, *args, node_id: str | None = None) -> Any:
        """Data op ``op`` on the cache actor of ``node_id`` (default: this link's node):
        over the local channel when that actor runs on this node, else through Ray. A
        put or get is final when it returns: it carries a ticket, settled if the call
        fails (``cache_actors.tickets``: it may wait for a store call of it to end)."""
        self._refresh()
        if op in TICKETED_OPS:
            with process_book().held() as ticket:
                return self._data(op, *args, ticket, node_id=node_id)
        return self._data(op, *args, node_id=node_id)

    def _data(self, op: DataOp, *args, node_id: str | None = None) -> Any:
        remote = node_id not in (None, self.node_id)
        if remote or not self._local:
            owner = () if self.owner is None else (self.owner,)
            kw = {}
            if op in TICKETED_OPS:  # the batch, then its ticket: both named on Ray
                *args, ticket = args
                kw = {"deadline": time.monotonic() + self.timeout_s, "ticket": ticket}
            return self._ray(self._actor_of(node_id) if remote else self._actor, op, *args,
                             *owner, timeout_s=self.timeout_s, **kw)
        with self._retryable(op):
            if self._channel is None:  # its path is asked within the data op's deadline
                path = self._ray(self._actor, "channel_path", timeout_s=self.timeout_s)
                self._channel = ChannelClient(path, async_ops=ASYNC_OPS,
                                              timeout_s=self.timeout_s, bind=self.owner)
            return self._channel.call(op.value, *args)

    def ask_controller(self, method: str, *args) -> Any:
        """``method`` of the controller (looked up by name once, and again after a
        re-attach); ``NodeUnavailableError`` if there is none."""
        if self._controller is None:
            try:
                self._controller = ray.get_actor(CONTROLLER_NAME, namespace=self._namespace)
            except ValueError as e:
                raise NodeUnavailableError("no raykv controller in namespace "
                                           f"{self._namespace!r}; is raykv running?") from e
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
        try:
            return ray.get_actor(node_actor_name(node_id), namespace=self._namespace)
        except ValueError as e:
            self._controller = None  # ask the controller again: the group may have moved
            raise NodeUnavailableError(f"no raykv cache actor on node {node_id[:12]}; retry "
                                       "the call") from e

    def _ray(self, actor: Any, method: str, *args, timeout_s: float = CONTROL_TIMEOUT_S,
             **kwargs) -> Any:
        with self._retryable(method):
            ref = getattr(actor, method).remote(*args, **kwargs)
            try:
                return ray.get(ref, timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                with contextlib.suppress(Exception):  # best effort: it may have started
                    ray.cancel(ref)
                raise DeadlineExceededError(
                    f"raykv actor call {method} (node {self.node_id[:12]}) did not finish "
                    f"within {timeout_s:g} s; the actor may be hung or overloaded: retry "
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
        self.close()
        self.stale = True
