"""Which pools serve one engine process, and since when that process is gone (pure),
and the reaper thread that removes them.

``NodePools`` notes each pool that serves a single engine process (an adopted memfd, a
pool created with a ``process``: SGLang staging and vLLM pools) and asks ``due`` which of
them to remove: a pool is due once its process was first seen gone at least ``grace_s``
seconds ago. The reaper thread of the node actor asks (``NodeService``), ``NodePools``
destroys what is due.

It also keeps the engine processes that attached to the node actor (``attach``, from
the node actor's control event loop alone), so that ``alive`` counts every engine on the
node for the reconciler (``clusters.node_lifecycle``).

Threads: ``watch``, ``forget``, ``clear`` and ``watched`` (a snapshot) run under
``NodePools._lock``; ``due`` runs on the reaper thread without it, on that snapshot (it
and ``forget`` touch the exit times by single dict operations, atomic under the GIL).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Watched(Protocol):
    """A process that can be told gone (``ProcessIdentity``)."""

    def alive(self) -> bool: ...


MAX_CLIENTS = 4096
"""Engine processes one node actor keeps as attached (far more than run on a node)."""


class EngineWatch:
    """Pool name -> the engine process it serves, and when that process was seen gone
    (``time.monotonic()`` seconds)."""

    def __init__(self) -> None:
        self._engines: dict[str, Watched] = {}
        self._exited: dict[str, float] = {}
        self._clients: dict[Watched, None] = {}  # engine processes that attached

    def attach(self, process: Watched) -> None:
        """``process`` (of this node) is an engine using this node actor; the gone ones
        are dropped first, and at most ``MAX_CLIENTS`` are kept (the newest)."""
        for gone in [p for p in list(self._clients) if not p.alive()]:
            self._clients.pop(gone, None)
        self._clients.pop(process, None)
        self._clients[process] = None
        while len(self._clients) > MAX_CLIENTS:
            self._clients.pop(next(iter(self._clients)))

    def watch(self, name: str, process: Watched) -> None:
        """Pool ``name`` serves ``process`` alone: it is removed once that exited."""
        self._engines[name] = process

    def forget(self, name: str) -> None:
        """Pool ``name`` left (destroyed): no longer watched."""
        self._engines.pop(name, None)
        self._exited.pop(name, None)

    def clear(self) -> None:
        """Every pool left (the node actor stops)."""
        self._engines.clear()
        self._exited.clear()

    def watched(self) -> list[tuple[str, Watched]]:
        """A snapshot of the watched pools and their processes."""
        return list(self._engines.items())

    def alive(self) -> int:
        """The live engine processes, each once: those its pools serve and those that
        attached (any thread: snapshots by one dict operation each, atomic under the
        GIL)."""
        processes = {*list(self._engines.values()), *list(self._clients)}
        return len({p for p in processes if p.alive()})

    def due(self, watched: list[tuple[str, Watched]], now: float, grace_s: float
            ) -> list[str]:
        """The pools of ``watched`` whose process was first seen gone (by this call or an
        earlier one) at least ``grace_s`` seconds before ``now``."""
        for name, process in watched:
            if not process.alive():
                self._exited.setdefault(name, now)
        return [n for n, t in list(self._exited.items()) if now - t >= grace_s]


def reap_every(period_s: float, reap: Callable[[], object], stop: threading.Event) -> None:
    """Start the engine reaper: a daemon thread that calls ``reap()`` every ``period_s``
    seconds until ``stop`` is set; a look that raises is logged and the thread goes on."""
    def loop() -> None:
        while not stop.wait(period_s):
            try:
                reap()
            except Exception:  # the reaper must outlive one bad look
                log.exception("a look at the engine pools failed")
    threading.Thread(target=loop, name="raykv-engine-reaper", daemon=True).start()
