"""Concurrent ranks' put/get batches as fewer, larger calls on the node's Mooncake client.

Measured here (``raykv bench-ranks``): with N ranks moving pages through one node actor, N threads
each waited on its own batch inside the one transfer engine, and Mooncake's completion
wait polls (``TransferFuture::wait`` -> ``getTransferStatus``, ``sched_yield``), so the
node spent about twice the CPU per GB of N independent clients and its throughput fell
with N. ``TransferMerger`` bounds the store calls in flight (``max_inflight``) and
merges whatever queued meanwhile into the next call (``cache_actors.node.merge_plan``).

It runs without a thread of its own (flat combining): a caller queues its batch; if a
call slot is free it takes everything that can share one call (its own batch and any
others queued), makes the call on its own thread, hands every batch its codes and wakes
their callers; otherwise it sleeps until its batch is done or a slot frees. A lone caller
thus calls the store directly, with no thread switch added; concurrent callers share
calls. Two calls never move the same key at once (a batch naming a key of a call in
flight waits for it), so of concurrent puts of one key exactly one stores it and the
others see it ``ALREADY_PRESENT``, whatever ``max_inflight``.

A caller may give a ``deadline`` (``time.monotonic()`` seconds): if its batch is still
queued then, it leaves the queue and gets ``DeadlineExceededError``, so a stuck store
call holds only the callers whose batches it carries, never every rank of the node for
good. A batch already in a store call is waited for whatever the deadline: the call holds
pointers into the caller's pool, and the caller's return is what lets that pool be
released (``NodePools``).

A caller may give its batch's ``ticket`` (``cache_actors.node.ticket_desk.Ticket``): the
thread that makes a store call starts the ticket of every batch it carries right before
the call (a batch whose ticket does not start, because its rank abandoned it or its
deadline is too close, is left out of the call and gets ``DeadlineExceededError``), and
ends them right after it, before any caller is woken: a rank's pages are touched only
while its ticket is held (``cache_actors.tickets``).

Callers hand in batches already validated (every pointer inside a registered pool), so a
bad batch fails its own caller before it is queued. The backend's per-object codes
(put-if-absent ``ALREADY_PRESENT`` included) come back unchanged, each caller getting
exactly the codes of its own objects. An exception raised by the backend call fails
every caller whose batch was in that call. Each store call is told to ``on_call`` with
the number of batches it carries (``NodeMetrics.record_merged_call``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node.merge_plan import Pending, merge, select, split
from raykv.controllers.node_settings import DEFAULTS

if TYPE_CHECKING:
    from raykv.cache_actors.node.ticket_desk import Ticket

OPS = ("put", "get")


class _Request:
    __slots__ = ("op", "keys", "ptrs", "sizes", "ticket", "codes", "error", "done")

    def __init__(self, op: str, keys: list[str], ptrs: list[int], sizes: list[int],
                 ticket: Ticket | None = None) -> None:
        self.op, self.keys, self.ptrs, self.sizes = op, keys, ptrs, sizes
        self.ticket = ticket
        self.codes: list[int] = []
        self.error: BaseException | None = None
        self.done = False


class TransferMerger:
    """``put`` / ``get`` of a ``MooncakeBackend`` (or anything with the same two methods),
    shared by concurrent callers: at most ``max_inflight`` store calls at a time, each
    carrying up to ``max_objects`` objects (a bigger single batch goes alone);
    ``max_inflight=0`` turns merging off (each caller calls the backend itself).
    ``on_call(batches)``: told of each merged store call, under this merger's lock."""

    def __init__(self, backend, *, max_inflight: int = DEFAULTS.merge_max_inflight,
                 max_objects: int = DEFAULTS.merge_max_objects,
                 on_call: Callable[[int], None] = lambda batches: None) -> None:
        if max_inflight < 0 or max_objects < 1:
            raise ValueError(f"max_inflight must be >= 0 and max_objects >= 1, got "
                             f"{max_inflight}, {max_objects}")
        self._backend = backend
        self._max_inflight = max_inflight
        self._max_objects = max_objects
        self._cond = threading.Condition()
        self._queue: list[_Request] = []
        self._inflight = 0
        self._busy: set[str] = set()  # keys of the calls in flight
        self._on_call = on_call

    def run(self, op: str, keys: Sequence[str], ptrs: Sequence[int],
            sizes: Sequence[int], deadline: float | None = None,
            ticket: Ticket | None = None) -> list[int]:
        """The backend's ``op`` codes for exactly these objects (keys distinct);
        ``DeadlineExceededError`` if the batch is still queued at ``deadline``
        (``time.monotonic()`` seconds; None: wait for ever) or its ``ticket`` does not
        start (see the module docstring)."""
        if op not in OPS:
            raise ValueError(f"unknown operation {op!r}; expected one of {OPS}")
        req = _Request(op, list(keys), list(ptrs), list(sizes), ticket)
        if not len(req.keys) == len(req.ptrs) == len(req.sizes):
            raise ValueError(f"{len(req.keys)} keys, {len(req.ptrs)} pointers, "
                             f"{len(req.sizes)} sizes: lengths must match")
        if not req.keys:
            return []
        if not self._max_inflight:  # merging off: every caller calls the store itself
            self._call([req])
            if req.error is not None:
                raise req.error
            return req.codes
        with self._cond:
            self._queue.append(req)
            while not req.done:
                group = self._take() if self._inflight < self._max_inflight else []
                if not group:
                    if deadline is None:
                        self._cond.wait()
                        continue
                    left = deadline - time.monotonic()
                    if left > 0:
                        self._cond.wait(left)
                        continue
                    if req in self._queue:  # never taken: give up on it
                        self._queue.remove(req)
                        raise DeadlineExceededError(
                            f"{op} of {len(req.keys)} objects waited past its deadline "
                            "for this node's store (a store call in flight did not end)")
                    self._cond.wait()  # taken by another caller: its call ends it
                    continue
                self._inflight += 1
                busy = [k for r in group for k in r.keys]
                self._busy.update(busy)
                self._cond.release()
                try:
                    self._call(group)
                finally:
                    self._cond.acquire()
                    self._inflight -= 1
                    self._busy.difference_update(busy)
                    self._cond.notify_all()
        if req.error is not None:
            raise req.error
        return req.codes

    def _take(self) -> list[_Request]:
        """Remove from the queue (lock held) the requests of the next store call."""
        if len(self._queue) == 1 and not self._busy:  # a lone caller: no selection
            group, self._queue = self._queue, []
            self._on_call(1)
            return group
        picked = select([Pending(r.op, r.keys) for r in self._queue], self._max_objects,
                        self._busy)
        if not picked:
            return []
        group = [self._queue[i] for i in picked]
        chosen = set(picked)
        self._queue = [r for i, r in enumerate(self._queue) if i not in chosen]
        self._on_call(len(group))
        return group

    def _call(self, group: list[_Request]) -> None:
        """One store call for the requests of ``group`` whose tickets start; every
        request ends done, with codes or error, its ticket ended first."""
        started: list[_Request] = []
        try:
            for r in group:
                try:
                    if r.ticket is None or r.ticket.start():
                        started.append(r)
                        continue
                    r.error = DeadlineExceededError(
                        f"{r.op} of {len(r.keys)} objects was not started: its deadline "
                        "was too close or its rank gave up on it")
                except Exception as e:  # its ticket's book broke: that caller's error
                    r.error = e
            self._store_call(started)
        finally:
            for r in started:
                if r.ticket is not None:
                    r.ticket.end()
            for r in group:
                r.done = True

    def _store_call(self, group: list[_Request]) -> None:
        """One store call for ``group`` (may be empty); codes or the error to each."""
        try:
            if not group:
                return
            if len(group) == 1:
                r = group[0]
                parts = [list(getattr(self._backend, r.op)(r.keys, r.ptrs, r.sizes))]
                if len(parts[0]) != len(r.keys):
                    raise RuntimeError(f"store {r.op} gave {len(parts[0])} codes for "
                                       f"{len(r.keys)} objects")
            else:
                keys, ptrs, sizes, bounds = merge([(r.keys, r.ptrs, r.sizes) for r in group])
                parts = split(getattr(self._backend, group[0].op)(keys, ptrs, sizes), bounds)
            for r, codes in zip(group, parts, strict=True):
                r.codes = codes
        except BaseException as e:  # noqa: BLE001 - handed to every caller of the call
            for r in group:
                r.error = e
