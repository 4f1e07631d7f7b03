"""This process's circuit breaker on each node actor it calls, and the probe that
watches an actor while its breaker is open.

One ``NodeGuard`` per node actor (namespace and node id) per process (``guard_of``),
shared by every ``CacheClient`` of the process: an engine's scheduler side and its
worker side wait on the same actor, so they learn together that it stopped answering.
``NodeLink.data`` runs each data call inside ``guard.call()``; the breaker's rules are
``cache_actors.rank.circuit_breaker``'s. A call only fails the breaker by running into its
deadline (``DeadlineExceededError``): the other errors of an unavailable actor (Ray
says it is dead or restarting, a broken channel, a store restarting) come back at once,
so repeating them costs an engine nothing.

Probe: while the breaker is open, one daemon thread per guard waits out the hold, asks
the actor ``health`` (a control call: no pool, no store) and waits for that answer in
steps of ``hold_s``, never asking a second question while one is unanswered (a stopped
actor does not pile them up); an answer moves the breaker to its trial, and the thread
ends. An actor that died is looked up by name again, so its replacement is found.
The probe ends too once this process is no longer connected to Ray (``ray.shutdown``):
a Ray call from it would start a new local Ray instance in the engine's process (Ray's
auto-init); the breaker stays open and the next failed call starts a new probe.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from raykv.cache_actors.errors import CircuitOpenError, DeadlineExceededError
from raykv.cache_actors.rank.circuit_breaker import BreakerSettings, CircuitBreaker
from raykv.controllers.naming import node_actor_name


class NodeGuard:
    """The breaker on the actor of ``node_id`` in ``namespace``, and its probe."""

    def __init__(self, node_id: str, namespace: str,
                 settings: BreakerSettings | None = None) -> None:
        self.node_id = node_id
        self._namespace = namespace
        self.breaker = CircuitBreaker(settings)
        self._lock = threading.Lock()  # guards _probing
        self._probing = False

    @contextlib.contextmanager
    def call(self, what: str, granted_s: float, timeout_s: float) -> Iterator[None]:
        """Run data call ``what`` (granted ``granted_s`` seconds; a whole deadline of
        the caller is ``timeout_s``) if the breaker admits it, and report how it ended;
        ``CircuitOpenError`` at once if it does not."""
        breaker = self.breaker
        if not breaker.admit():
            raise CircuitOpenError(
                f"raykv {what} (node {self.node_id[:12]}) failed at once: the node actor "
                "ran calls into their deadlines and has not answered a probe since; "
                "retry later")
        try:
            yield
        except DeadlineExceededError:
            breaker.failed(granted_s, timeout_s)
            self._start_probe()
            raise
        except BaseException:
            breaker.released()
            raise
        breaker.succeeded()

    def _start_probe(self) -> None:
        with self._lock:
            if self._probing or not self.breaker.probe_wanted():
                return
            self._probing = True
        threading.Thread(target=self._probe, name=f"raykv-probe-{self.node_id[:8]}",
                         daemon=True).start()

    def _probe(self) -> None:
        """The probe thread (see the module docstring)."""
        breaker, step = self.breaker, self.breaker.settings.hold_s
        question: Any = None
        try:
            while True:
                with self._lock:
                    if not breaker.probe_wanted() or not ray.is_initialized():
                        self._probing = False
                        return
                if question is None:
                    time.sleep(breaker.hold_left())
                    question = self._ask()
                    if question is None:  # no actor by that name now
                        time.sleep(step)
                        continue
                ready, _ = ray.wait([question], timeout=step)
                if not ready:
                    continue  # no answer yet: keep waiting for this one
                try:
                    ray.get(question)
                    breaker.probe_answered()
                except Exception:  # it died or restarts: ask its replacement later
                    time.sleep(step)
                question = None
        except BaseException:  # never leave a guard that believes it is probed
            with self._lock:
                self._probing = False
            raise

    def _ask(self) -> Any:
        """A ``health`` question to the actor, looked up by name (None: there is none,
        or this process is no longer connected to Ray)."""
        if not ray.is_initialized():
            return None
        try:
            actor = ray.get_actor(node_actor_name(self.node_id), namespace=self._namespace)
        except ValueError:
            return None
        return actor.health.remote()


_guards: dict[tuple[str, str], NodeGuard] = {}
_guards_lock = threading.Lock()


def guard_of(namespace: str, node_id: str) -> NodeGuard:
    """This process's guard on the actor of ``node_id`` in ``namespace`` (made on first
    use, with the default ``BreakerSettings``)."""
    key = (namespace, node_id)
    with _guards_lock:
        guard = _guards.get(key)
        if guard is None:
            guard = _guards[key] = NodeGuard(node_id, namespace)
        return guard
