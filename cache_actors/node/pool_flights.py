"""The data calls in flight on a node's pools, and the pools that wait for them to end.

A data call counts itself in on the pools it resolved (``count_in``, under ``lock``,
after ``NodePools.enter`` checked they are still published) and out after its store call
(``count_out``). A pool leaving the node is first taken out of the table (under ``lock``,
so no call counts itself in on it afterwards), then *drained*: ``drain`` waits, at most
``wait_s``, until no call uses it and releases it; one still used then is *parked* and
released by its last call's ``count_out``. So memory is never freed under a pointer a
store call may still use, and nothing here waits while holding a lock other than its
own condition (a drain of up to ``DRAIN_S`` blocks only the caller that drains).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence

from raykv.cache_actors.host_pools import HostPool

log = logging.getLogger(__name__)

Release = Callable[[HostPool], None]


class PoolFlights:
    """Counts of data calls per pool (by ``id``) and the parked pools (see the module
    docstring). ``lock``: taken by a data call twice (~1 us), and by whoever publishes
    a table without some pools; never held across a store call or a release."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self._inflight: dict[int, int] = {}  # id(pool) -> data calls using it now
        self._parked: dict[int, tuple[HostPool, Release]] = {}  # out of the table, used

    def count_in(self, pools: Iterable[HostPool]) -> None:
        """With ``lock`` held: one more call uses each of ``pools``."""
        inflight = self._inflight
        for pool in pools:
            inflight[id(pool)] = inflight.get(id(pool), 0) + 1

    def count_out(self, pools: Iterable[HostPool]) -> None:
        """One call fewer uses each of ``pools``; a parked pool whose last call this was
        is released now, in this thread (no lock held)."""
        done: list[tuple[HostPool, Release]] = []
        with self.lock:
            inflight = self._inflight
            idle = False
            for pool in pools:
                n = inflight[id(pool)] - 1
                if n:
                    inflight[id(pool)] = n
                else:
                    del inflight[id(pool)]
                    idle = True
            if not idle:
                return
            self._idle.notify_all()
            if self._parked:
                done = [v for k, v in self._parked.items() if k not in inflight]
                for pool, _ in done:
                    del self._parked[id(pool)]
        for pool, release in done:
            log.warning("pool %s: its last data call ended; released now", pool.name)
            try:
                release(pool)
            except Exception:  # a data thread must not fail for it
                log.exception("pool %s could not be released", pool.name)

    def drain(self, pools: Sequence[HostPool], release: Release, wait_s: float) -> None:
        """``pools`` already out of the table: wait until no data call uses them (at most
        ``wait_s`` seconds), then ``release`` each; one still in use is parked instead,
        released by its last call (never freed under a live pointer)."""
        deadline = time.monotonic() + wait_s
        inflight = self._inflight
        with self._idle:
            self._idle.wait_for(lambda: not any(id(p) in inflight for p in pools),
                                timeout=max(0.0, deadline - time.monotonic()))
            busy = [(p, inflight[id(p)]) for p in pools if id(p) in inflight]
            for pool, _ in busy:
                self._parked[id(pool)] = (pool, release)
        for pool, calls in busy:
            log.error("pool %s: %d data calls still use it after %.0f s; it stays mapped "
                      "and registered until they end (a store call is stuck)", pool.name,
                      calls, wait_s)
        parked = {id(p) for p, _ in busy}
        for pool in pools:
            if id(pool) not in parked:
                release(pool)
