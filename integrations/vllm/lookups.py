"""The scheduler side's hit queries on a thread of their own (pure: no vLLM, no Ray; the
scheduler passes in the query), so that vLLM's scheduler never waits on a slow node
actor longer than a small per-step allowance.

``Lookups.ask(req_id, key, query)`` answers from the request's cached answer when it has
one for ``key`` (the request's blocks to look up: a waiting request that vLLM cannot
schedule yet is not asked about again every step), else queues ``query`` for the lookup
thread and waits for it at most what the step's allowance has left (``wait``); no
answer yet: None (vLLM asks again next step, and the answer is cached by then). The
queue is bounded (``QUEUE``): a query that does not fit gets None at once. A query
that raises answers ``miss``.

Threads: ``ask``, ``forget`` and ``close`` on vLLM's scheduler thread; the queries on
``raykv-lookup``, which never dies of what a query raises.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger("vllm." + __name__)

QUEUE = 256
"""Queries waiting for the lookup thread at most."""
STEP_WAIT_S = 0.02
"""How long one scheduler step waits for lookup answers in all, in seconds: a node
actor answering on the local channel (~0.2 ms) answers within it; a slow one costs each
step this much at most (the answer is used when it comes)."""


class _Pending:
    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.done = threading.Event()
        self.answer: object = None


class Lookups:
    """A lookup thread, its bounded queue and the answers per request (see the module
    docstring)."""

    def __init__(self, miss: object, *, maxsize: int = QUEUE) -> None:
        self._miss = miss
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._answers: dict[str, _Pending] = {}  # scheduler thread only
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="raykv-lookup", daemon=True)
        self._thread.start()

    def ask(self, req_id: str, key: Hashable, query: Callable[[], object],
            wait: float) -> object | None:
        """``query()``'s answer for ``req_id`` at ``key`` (cached, or asked now and
        waited for at most ``wait`` seconds); None while unknown."""
        p = self._answers.get(req_id)
        if p is None or p.key != key:
            p = _Pending(key)
            if self._closed:
                return None
            try:
                self._queue.put_nowait((p, query))
            except queue.Full:
                return None
            self._answers[req_id] = p
        if not p.done.is_set() and wait > 0:
            p.done.wait(wait)
        return p.answer if p.done.is_set() else None

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s answer (it was used, or the request finished)."""
        self._answers.pop(req_id, None)

    def close(self) -> None:
        """End the thread (after the query under way). Never raises."""
        self._closed = True
        self._answers.clear()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        with contextlib.suppress(queue.Full):  # emptied above; nothing is queued now
            self._queue.put_nowait(None)
        self._thread.join(5.0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None or self._closed:
                return
            p, query = item
            try:
                p.answer = query()
            except Exception as e:  # a miss, never a dead thread
                log.warning("RayKVConnector: lookup failed (%s)", e)
                p.answer = self._miss
            p.done.set()
