"""Asynchronous loads of raykv's vLLM connector, on a thread of the worker process (pure:
no vLLM, no Ray; the worker passes in how one request's blocks are loaded).

vLLM parks a request whose lookup answered ``(n, True)`` in ``WAITING_FOR_REMOTE_KVS``
with its blocks allocated, and schedules it once a ``get_finished`` of every TP rank
names it in ``finished_recving``. The worker's ``start_load_kv`` hands such a request's
blocks to ``AsyncLoads.submit``; the load thread reads them (L3 into L2 into vLLM's
blocks, which no running request reads) while vLLM's forwards go on; ``get_finished``
takes the finished ones (``AsyncLoads.finished``): their ids, and the blocks that did
not load, which the worker hands to vLLM in the same step's
``get_block_ids_with_load_errors`` (vLLM then recomputes from the first of them).

Rules: the queue is bounded (``QUEUE``): a load that does not fit fails at once, all its
blocks (counted ``load_dropped``), never a wait; a load that raises fails its blocks;
nothing the thread does raises into vLLM; ``close`` ends the thread and fails what is
still queued, waiting for the load under way (it ends within its own deadline, which
``close_wait_s`` covers: no load writes vLLM's blocks after ``close`` returned). A
request vLLM aborts while its load runs keeps its blocks until its id is reported (vLLM
delays their free for requests in ``WAITING_FOR_REMOTE_KVS``), so the thread never
writes a freed block.

Threads: ``submit``, ``finished`` and ``close`` on vLLM's worker thread; the loads on
``raykv-load``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from raykv.integrations.vllm.request_blocks import BlockTransfer

log = logging.getLogger("vllm." + __name__)

QUEUE = 256
"""Loads waiting for the load thread at most (vLLM parks at most this many requests'
loads before the first fails at once)."""
CLOSE_WAIT_S = 10.0
"""How long ``close`` waits for the load under way beyond that load's own deadline, in
seconds (the copy into vLLM's blocks after its last data op)."""


@dataclass
class Finished:
    """What the load thread finished since the last ``AsyncLoads.finished``: request ids
    (loaded in full or not) and the block ids that did not load; ``loaded``/``failed``:
    how many blocks."""

    req_ids: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    loaded: int = 0
    failed: int = 0
    dropped: int = 0


class AsyncLoads:
    """A load thread and its bounded queue. ``load(x) -> n``: loads the leading ``n``
    blocks of ``x`` into vLLM's blocks (runs on the load thread; what it raises fails
    the whole load); ``close_wait_s``: how long ``close`` waits for the load under way
    (its deadline and ``CLOSE_WAIT_S``)."""

    def __init__(self, load: Callable[[BlockTransfer], int], *, maxsize: int = QUEUE,
                 close_wait_s: float = CLOSE_WAIT_S) -> None:
        self._load, self._close_wait_s = load, close_wait_s
        self._queue: queue.Queue[BlockTransfer | None] = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self._done = Finished()  # under _lock
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="raykv-load", daemon=True)
        self._thread.start()

    def submit(self, x: BlockTransfer) -> bool:
        """Queue ``x``'s load; False (and its blocks failed, reported at the next
        ``finished``) if the queue is full or closed."""
        if not self._closed:
            try:
                self._queue.put_nowait(x)
                return True
            except queue.Full:
                pass
        self._settle(x, 0, dropped=True)
        return False

    def finished(self) -> Finished:
        """The loads finished since the last call (and their failed blocks)."""
        with self._lock:
            done, self._done = self._done, Finished()
        return done

    def pending(self) -> int:
        """Loads queued and not finished (approximate: for stats and tests)."""
        return self._queue.qsize()

    def close(self) -> None:
        """End the thread: the load under way ends (waited for ``close_wait_s`` at most;
        logged if it outlives that), queued ones fail. Never raises."""
        self._closed = True
        while True:
            try:
                x = self._queue.get_nowait()
            except queue.Empty:
                break
            if x is not None:
                self._settle(x, 0, dropped=True)
        with contextlib.suppress(queue.Full):  # emptied above; nothing is queued now
            self._queue.put_nowait(None)
        self._thread.join(self._close_wait_s)
        if self._thread.is_alive():
            log.error("RayKVConnector: an async load still ran %.0f s after shutdown began "
                      "and may still write vLLM's blocks", self._close_wait_s)

    def _run(self) -> None:
        while True:
            x = self._queue.get()
            if x is None or self._closed:
                if x is not None:
                    self._settle(x, 0, dropped=True)
                return
            try:
                n = max(0, min(int(self._load(x)), len(x.block_ids)))
            except Exception as e:  # never raises into vLLM: the blocks are recomputed
                log.warning("RayKVConnector: async load of %d blocks failed (%s)",
                            len(x.block_ids), e)
                n = 0
            self._settle(x, n)

    def _settle(self, x: BlockTransfer, n: int, *, dropped: bool = False) -> None:
        with self._lock:
            d = self._done
            d.req_ids.add(x.req_id)
            d.failed_blocks.update(x.block_ids[n:])
            d.loaded += n
            d.failed += len(x.block_ids) - n
            d.dropped += len(x.block_ids) - n if dropped else 0
