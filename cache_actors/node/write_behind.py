"""The write-behind of a node's L2 (``cache_actors.node.l2_pools``): committed pages put
to L3 on one thread of its own, a failed put retried, never a silent hole.

A page committed to L2 is *dirty* (not evicted) until its write-behind ends. A put that
fails for some objects (store error, deadline, node busy) is tried again for those
objects after a back-off (``BACKOFF_S``, doubling), up to ``attempts`` puts in all;
meanwhile their pages stay dirty, so the block lives on in L2 with the right bytes. A
retry never waits on the thread: while a retry is not due the thread puts what else was
committed, and a put waits at most ``PUT_WAIT_S``. When the last attempt failed, or the
pool left the node (``reset``, ``forget``, the node actor restarted: nothing is retried
into memory no longer served), the objects are counted in ``failed`` and logged: they
are in L2 only (until evicted), and L3's chain has a hole there. A hole costs hits,
never bytes: every lookup and load stops at a chain's first missing block, so the
blocks after it are only unused space in L3 until they are evicted there.

A drain (``cache_actors.node.segment_drain``) calls ``flush``: every retry is due at
once, and it waits until the write-behind of everything handed over ended.

Counters (``counts``, read under the owner's lock): ``submitted`` (objects handed
over; the write-behind has ended for all of them once ``stored`` + ``failed`` reach
it), ``stored`` (objects put), ``retried``
(objects whose put was tried again), ``failed`` (objects never put), ``pending``
(objects a put failed for whose write-behind has not ended: waiting for a retry, or in
one).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from raykv.cache_actors.throttled_log import ThrottledLog

log = logging.getLogger(__name__)

BATCH = 64
"""Objects per write-behind put."""
PUT_WAIT_S = 30.0
"""Deadline of one write-behind put, in seconds."""
ATTEMPTS = 4
"""Puts of one object at most (the first and three retries)."""
BACKOFF_S = 0.5
"""Wait before the first retry, in seconds; it doubles with each retry (0.5, 1, 2 s),
up to ``BACKOFF_MAX_S``."""
BACKOFF_MAX_S = 8.0
"""The longest wait between two puts of one object, in seconds."""

Put = Callable[[Any, list[str], list[int], float], list[bool]]
"""``put(pool, keys, pages, deadline)``: the L3 put of ``pool``'s ``pages`` holding
``keys`` (``deadline``: ``time.monotonic()`` seconds); per object whether it is in L3.
May raise: every object failed then."""


class WriteBehind:
    """Puts committed pages to L3 behind their writers (module docstring). ``put``: the
    store call (``Put``); ``done(pool, keys, pages)``: the write-behind of those pages
    ended (they may be evicted), called under ``lock``, which also guards ``counts``;
    ``served(pool)``: whether ``pool`` is still an L2 pool of the node (a retry into a
    pool that left is dropped); ``attempts``: puts per object at most (1: no retry)."""

    def __init__(self, put: Put, done: Callable[[Any, list[str], list[int]], None],
                 served: Callable[[Any], bool], lock: threading.Lock, *,
                 attempts: int = ATTEMPTS, backoff_s: float = BACKOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if attempts < 1 or backoff_s < 0:
            raise ValueError(f"attempts must be >= 1 and backoff_s >= 0, got {attempts}, "
                             f"{backoff_s}")
        self._put, self._done, self._served, self._lock = put, done, served, lock
        self.attempts, self.backoff_s = attempts, backoff_s
        self._clock = clock
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # retries not due yet: (due, serial, pool, keys, pages, attempt); at most one
        # entry per dirty page, so bounded by the L2 pools' pages
        self._retries: list[tuple[float, int, Any, list[str], list[int], int]] = []
        self._serial = itertools.count()
        self.counts = {"submitted": 0, "stored": 0, "retried": 0, "failed": 0, "pending": 0}
        self._warn = ThrottledLog(log)
        self._closed = threading.Event()
        self._hurry = threading.Event()  # a drain: every retry is due at once
        threading.Thread(target=self._loop, name="raykv-l2-flush", daemon=True).start()

    def submit(self, pool: Any, keys: list[str], pages: list[int]) -> None:
        """Put ``pool``'s ``pages`` (holding ``keys``, dirty) to L3 behind the caller;
        never blocks. Called under the owner's lock."""
        self.counts["submitted"] += len(keys)
        self._queue.put((pool, keys, pages))

    def named_counts(self) -> dict[str, int]:
        """``counts`` as the node's L2 stats name them (read under the owner's lock):
        ``l3_put_submitted``, ``l3_put`` (stored), ``l3_put_retried``, ``l3_put_pending``
        (their pages dirty), ``l3_put_failed`` (in L2 only, a hole in L3)."""
        return {f"l3_put_{k}" if k != "stored" else "l3_put": v for k, v in self.counts.items()}

    def flush(self, until: float) -> int:
        """A drain's flush: every retry is due at once from now on (until ``unhurry``);
        waits until each object handed over ended its write-behind (put, or given up
        on) or ``until`` (``clock`` seconds) passed. Returns the objects put meanwhile.
        Never called under the owner's lock."""
        with self._lock:
            before = self.counts["stored"]
        self._hurry.set()
        self._queue.put(())  # wakes the thread to look at its retries
        while True:
            with self._lock:
                c = self.counts
                ended, put = c["stored"] + c["failed"] >= c["submitted"], c["stored"] - before
            if ended or self._clock() >= until or self._closed.is_set():
                return put
            time.sleep(0.02)

    def unhurry(self) -> None:
        """Retries wait for their back-off again (a drain was called off)."""
        self._hurry.clear()

    def close(self) -> None:
        """End the thread after its current put; retries not yet due are dropped."""
        self._closed.set()
        self._queue.put(None)

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        while not self._closed.is_set():
            wait = None if not self._retries else max(0.0, self._retries[0][0] - self._clock())
            wait = 0.0 if self._retries and self._hurry.is_set() else wait
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if item:
                pool, keys, pages = item
                for i in range(0, len(keys), BATCH):
                    self._attempt(pool, keys[i:i + BATCH], pages[i:i + BATCH], 1)
            while self._retries and (self._hurry.is_set() or self._retries[0][0]
                                     <= self._clock()) and not self._closed.is_set():
                _, _, pool, keys, pages, attempt = heapq.heappop(self._retries)
                if self._served(pool):
                    self._attempt(pool, keys, pages, attempt)
                else:
                    self._end(pool, keys, pages, attempt, "its pool left the node")

    def _attempt(self, pool: Any, keys: list[str], pages: list[int], attempt: int) -> None:
        """Put attempt number ``attempt`` of ``keys``; the failed ones retried later, or
        given up on after the last attempt."""
        try:
            ok = self._put(pool, keys, pages, self._clock() + PUT_WAIT_S)
        except Exception as e:  # every object failed; the pages stay in L2
            log.debug("L2 write-behind of %d objects failed: %s", len(keys), e)
            ok = [False] * len(keys)
        stored = [i for i, x in enumerate(ok) if x]
        failed = [i for i, x in enumerate(ok) if not x]
        with self._lock:
            self.counts["stored"] += len(stored)
            if attempt > 1:  # a retry: these were pending
                self.counts["pending"] -= len(stored)
            if stored:
                self._done(pool, [keys[i] for i in stored], [pages[i] for i in stored])
        if not failed:
            return
        keys, pages = [keys[i] for i in failed], [pages[i] for i in failed]
        if attempt >= self.attempts or not self._served(pool):
            self._end(pool, keys, pages, attempt, f"{attempt} put(s) failed")
            return
        with self._lock:
            self.counts["retried"] += len(keys)
            if attempt == 1:
                self.counts["pending"] += len(keys)
        due = self._clock() + min(BACKOFF_MAX_S, self.backoff_s * 2 ** min(attempt - 1, 16))
        heapq.heappush(self._retries, (due, next(self._serial), pool, keys, pages,
                                       attempt + 1))

    def _end(self, pool: Any, keys: list[str], pages: list[int], attempt: int,
             why: str) -> None:
        """Give up on ``keys`` after ``attempt`` puts: counted, logged, their pages
        evictable (in L2 only)."""
        self._warn.warn("gave up", "L2 write-behind gave up on %d objects (%s): they are "
                        "in L2 only until evicted, and L3 misses them", len(keys), why)
        with self._lock:
            self.counts["failed"] += len(keys)
            if attempt > 1:
                self.counts["pending"] -= len(keys)
            self._done(pool, keys, pages)
