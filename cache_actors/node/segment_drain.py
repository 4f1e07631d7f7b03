"""A node's drain before it leaves: what its store segment alone holds moves to other
nodes' segments, hottest first, within a deadline and the room the store has.

``SegmentDrain.run`` (the node actor's ``drain``), in this order:

1. *Steer*: every later put of the node prefers another node's segment (the first of
   ``Peers.segments``), not its own, so nothing new lands on the leaving segment
   while Mooncake has room elsewhere (``StoreBackend.steer``).
2. *Flush L2*: the L2 write-behind puts every committed page not yet in L3 now, its
   retries due at once (``WriteBehind.flush``); being steered, they land elsewhere.
3. *Candidates*: the objects of this node's touch journal and of its peers' recent
   touches, ordered by their touches merged over every node (``touch_journal.hottest``:
   most recently touched first); of those, the ones whose only complete replica is on
   this node's segment (``StoreBackend.locate``, ``LOCATE_CHUNK`` at a time, the next
   chunk looked up while the moves of the ones before run).
4. *Choose*: hottest first, each that fits in ``room_bytes`` is taken, each that does
   not is *dropped* (``drain_plan.fitting``): the drain never makes room by evicting.
5. *Move*: a Mooncake move task per object (``StoreBackend.start_move``; the client
   owning the segment runs it: this node's), to the peers' segments in turn, at most
   ``IN_FLIGHT`` at once, polled every ``POLL_S``, until all ended or the deadline:
   what was not started or not done by then is *left* (it may still move, but is not
   counted moved); a move that failed is *failed*; objects not looked up by then are
   ``unlocated`` (not known to be this segment's alone). Mooncake 0.3.13's client
   takes its move tasks 16 at a time about once a second: about 16 objects a second,
   whatever their size.

Bytes move through Mooncake alone; the node keeps serving meanwhile (a rank reading an
object gets its bytes from whichever replica the master names, or a miss). The report
(``run``'s answer, ``status`` while it runs) holds ``reason``, ``state`` (``running``,
``done``, ``called off``; ``no locate`` where the client cannot tell which objects its
segment holds: a dummy client of ``mooncake_client``, standalone mode, moves nothing),
``objects_``/``bytes_`` ``moved``, ``dropped``, ``left``, ``failed``, ``started`` (move
tasks started), ``candidates`` (objects found on this segment alone), ``unlocated``,
``l2_pages`` (L2 pages put to L3 by the flush), ``targets``, ``seconds``, ``deadline_s``.
``undo`` (an aborted retirement) steers puts to the own segment again.

Threads: ``run`` on a thread of the node actor's pool group; ``status`` and ``undo``
from any thread; ``_lock`` guards the report and the steering of puts (``steer``, a
local call, is the one call made under it).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import ray
from raykv.cache_actors.node.node_metrics import DRAIN_OUTCOMES
from raykv.cache_actors.node.store_backend import StoreBackend
from raykv.cache_actors.node.touch_journal import MAX_ANSWER, Touch, TouchJournal, hottest
from raykv.controllers.drain_plan import fitting, sole_on
from raykv.controllers.naming import CONTROLLER_NAME

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_metrics import NodeMetrics
    from raykv.cache_actors.node.node_service import NodeService

log = logging.getLogger(__name__)

IN_FLIGHT = 64
"""Move tasks of one drain in flight at once."""
POLL_S = 0.05
"""Seconds between two looks at the move tasks in flight."""
LOCATE_CHUNK = 1024
"""Objects per replica lookup."""
PEER_WAIT_S = 2.0
"""The longest a drain waits for its peers' answers (segments, touches), in seconds."""
MAX_DEADLINE_S = 24 * 3600.0
"""The longest deadline a drain accepts, in seconds."""


class Peers(Protocol):
    """The node's peers as a drain sees them; ``until``: ``time.monotonic()`` seconds
    by which each answer is given up on (a peer that did not answer counts as none)."""

    def segments(self, until: float) -> list[str]:
        """The segments of the other nodes that take objects (healthy, not draining)."""
        ...

    def touches(self, keys: Sequence[str], until: float) -> list[dict[str, Touch]]:
        """Per peer, its touches of ``keys`` and its most recent ones."""
        ...


def check_drain(deadline_s: float, room_bytes: int | None, reason: str) -> None:
    """``ValueError`` unless ``deadline_s`` is a number in (0, ``MAX_DEADLINE_S``],
    ``room_bytes`` an int >= 0 or None and ``reason`` a non-empty string of at most 64
    characters."""
    if type(deadline_s) not in (int, float) or not (
            math.isfinite(deadline_s) and 0 < deadline_s <= MAX_DEADLINE_S):
        raise ValueError(f"deadline_s must be a number of seconds in (0, {MAX_DEADLINE_S:g}],"
                         f" got {deadline_s!r}")
    if room_bytes is not None and (type(room_bytes) is not int or room_bytes < 0):
        raise ValueError(f"room_bytes must be an int >= 0 or None, got {room_bytes!r}")
    if not isinstance(reason, str) or not 0 < len(reason) <= 64:
        raise ValueError(f"reason must be a string of 1 to 64 characters, got {reason!r}")


class SegmentDrain:
    """The drain of one node (module docstring). ``backend``: the node's store client;
    ``journal``: its touch journal; ``flush(until) -> pages`` and ``unhurry()``: its L2
    write-behind's (``WriteBehind.flush`` / ``unhurry``); ``peers``: ``Peers``;
    ``record(report)``: each finished drain's report counted (``NodeMetrics``)."""

    def __init__(self, backend: StoreBackend, journal: TouchJournal,
                 flush: Callable[[float], int], unhurry: Callable[[], None], peers: Peers,
                 record: Callable[[dict], None], *, in_flight: int = IN_FLIGHT,
                 poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._backend, self._journal, self._peers = backend, journal, peers
        self._flush, self._unhurry, self._record = flush, unhurry, record
        self._in_flight, self._poll_s, self._clock = in_flight, poll_s, clock
        self._lock = threading.Lock()
        self._report: dict | None = None  # the running or last drain's
        self._off = threading.Event()  # undo: the running drain stops

    @property
    def draining(self) -> bool:
        """Whether puts are steered away from this node's segment (a drain ran or runs,
        and was not undone)."""
        with self._lock:
            return self._report is not None and self._report["state"] != "called off"

    def status(self) -> dict | None:
        """The running drain's progress, or the last one's report (None: none ran);
        ``deadline_in_s``: seconds to its deadline while it runs."""
        with self._lock:
            if self._report is None:
                return None
            out = {k: v for k, v in self._report.items() if k != "end"}
            if out["state"] == "running":
                out["deadline_in_s"] = max(0.0, self._report["end"] - self._clock())
            return out

    def undo(self) -> None:
        """Call a drain off: puts prefer the own segment again, L2 retries wait for
        their back-off again; a running drain stops starting moves (``called off``)."""
        with self._lock:
            self._off.set()
            self._backend.steer(None)
            if self._report is not None and self._report["state"] != "running":
                self._report["state"] = "called off"
        self._unhurry()

    def run(self, deadline_s: float, room_bytes: int | None = None,
            reason: str = "operator") -> dict:
        """Drain within ``deadline_s`` seconds, moving at most ``room_bytes`` (None: no
        bound given); the report (module docstring). ``ValueError`` for bad arguments
        (``check_drain``) or while another drain runs; nothing changed then."""
        check_drain(deadline_s, room_bytes, reason)
        start = self._clock()
        end = start + float(deadline_s)
        with self._lock:
            if self._report is not None and self._report["state"] == "running":
                raise ValueError("a drain of this node is running")
            self._report = {"reason": reason, "state": "running", "deadline_s": deadline_s,
                            "started_at": time.time(), "end": end, "targets": 0,
                            "l2_pages": 0, "candidates": 0, "started": 0, "unlocated": 0,
                            "seconds": 0.0,
                            **{f"{w}_{c}": 0 for c in DRAIN_OUTCOMES for w in ("objects", "bytes")}}
        self._off.clear()
        try:
            self._drain(end, room_bytes)
        finally:
            with self._lock:
                report = self._report
                report["seconds"] = round(self._clock() - start, 3)
                if report["state"] == "running":
                    report["state"] = "called off" if self._off.is_set() else "done"
                out = {k: v for k, v in report.items() if k != "end"}
            self._record(out)
            log.info("drain (%s) %s: %d objects (%d bytes) moved, %d dropped, %d left, "
                     "%d failed, %d L2 pages put, %.1f s", reason, out["state"],
                     out["objects_moved"], out["bytes_moved"], out["objects_dropped"],
                     out["objects_left"], out["objects_failed"], out["l2_pages"],
                     out["seconds"])
        return out

    def _note(self, **values) -> None:
        with self._lock:
            self._report.update(values)

    def _count(self, what: str, objects: Sequence[tuple[str, int]]) -> None:
        """``objects`` (key, size) ended as ``what`` (``DRAIN_OUTCOMES``)."""
        with self._lock:
            self._report[f"objects_{what}"] += len(objects)
            self._report[f"bytes_{what}"] += sum(size for _, size in objects)

    def _drain(self, end: float, room_bytes: int | None) -> None:
        targets = self._peers.segments(min(end, self._clock() + PEER_WAIT_S))
        own = self._backend.own_segment
        targets = [t for t in targets if t != own]
        with self._lock:  # never after an undo
            if targets and not self._off.is_set():
                self._backend.steer(targets[0])
            self._report["targets"] = len(targets)
        self._note(l2_pages=self._flush(end))
        if not self._backend.can_locate:
            self._note(state="no locate")  # standalone: which objects are its own is unknown
            return
        if own is None:  # no segment of its own: nothing leaves with it
            return
        mine = self._journal.entries()
        views = [dict(mine), *self._peers.touches([k for k, _ in mine],
                                                  min(end, self._clock() + PEER_WAIT_S))]
        self._move(_Candidates(hottest(views), own, self._backend.locate, room_bytes),
                   targets, end)

    def _move(self, found: _Candidates, targets: list[str], end: float) -> None:
        """Locate ``found`` a chunk at a time and move what it takes, hottest first, to
        ``targets`` in turn (none: dropped), until all ended or ``end``; what did not end
        by then is left, what was not located by then is counted ``unlocated``."""
        own = self._backend.own_segment
        queue: deque[tuple[str, int]] = deque()
        running: dict[object, tuple[str, int]] = {}
        started, polled = 0, self._clock()
        while self._clock() < end and not (self._off.is_set() and not running):
            while queue and len(running) < self._in_flight and not self._off.is_set():
                key, size = queue.popleft()
                task, rc = self._backend.start_move(key, own, targets[started % len(targets)])
                started += 1
                if task is None:
                    log.debug("move of %s not started: %d", key, rc)
                    self._count("failed", [(key, size)])
                else:
                    running[task] = (key, size)
            self._note(started=started)
            if not found.done and not self._off.is_set():  # locate while moves run
                take, dropped, sole = found.next_chunk()
                self._count("dropped", dropped if targets else dropped + take)
                queue.extend(take if targets else ())
                with self._lock:
                    self._report["candidates"] += sole
            elif not queue and not running:
                break
            else:
                time.sleep(self._poll_s)
            if running and self._clock() - polled >= self._poll_s:
                polled = self._clock()
                for task in list(running):
                    state = self._backend.move_state(task)
                    if state != "running":
                        self._count("moved" if state == "done" else "failed",
                                    [running.pop(task)])
        self._count("left", [*queue, *running.values()])
        self._note(unlocated=found.unlocated)


class _Candidates:
    """The objects of ``order`` (key, touch; hottest first) whose only complete replica
    is on segment ``own``, looked up ``LOCATE_CHUNK`` at a time (``locate``); of those,
    each that fits in what is left of ``room`` (None: no bound) is taken, each that does
    not dropped (``drain_plan.fitting``, chunk by chunk: the same choice)."""

    def __init__(self, order: list[tuple[str, Touch]], own: str,
                 locate: Callable[[list[str]], list[tuple[str, ...]] | None],
                 room: int | None) -> None:
        self._order, self._own, self._locate, self._room = order, own, locate, room
        self._next = 0

    @property
    def done(self) -> bool:
        return self._next >= len(self._order)

    @property
    def unlocated(self) -> int:
        """Objects of ``order`` not looked up yet."""
        return len(self._order) - self._next

    def next_chunk(self) -> tuple[list[tuple[str, int]], list[tuple[str, int]], int]:
        """The next chunk's objects taken and dropped (key, size), and how many it had
        on ``own`` alone; none if the lookup failed (nothing known of them)."""
        chunk = self._order[self._next:self._next + LOCATE_CHUNK]
        self._next += len(chunk)
        keys = [k for k, _ in chunk]
        located = self._locate(keys)
        if located is None:
            return [], [], 0
        size = dict(chunk)
        choice = fitting([(k, size[k].size) for k in sole_on(keys, located, self._own)],
                         self._room)
        if self._room is not None:
            self._room -= sum(s for _, s in choice.take)
        return choice.take, choice.dropped, len(choice.take) + len(choice.dropped)


class RayPeers:
    """``Peers`` of node ``node_id`` through Ray: the controller's ``nodes()`` and each
    other node actor's ``health`` (its ``segment``, whether it is ``draining``) and
    ``touches``. Called on a worker thread of the node actor (waits on futures)."""

    def __init__(self, node_id: str, namespace: str) -> None:
        self._node_id, self._namespace = node_id, namespace

    def _actors(self, until: float) -> list:
        try:
            controller = ray.get_actor(CONTROLLER_NAME, namespace=self._namespace)
            nodes = controller.nodes.remote().future().result(_left(until))
        except Exception as e:  # no controller answer: no peers
            log.warning("drain: the controller did not list the nodes: %s", e)
            return []
        actors = []
        for node, name in nodes.items():
            if node != self._node_id:
                with contextlib.suppress(ValueError):  # gone meanwhile
                    actors.append(ray.get_actor(name, namespace=self._namespace))
        return actors

    def segments(self, until: float) -> list[str]:
        answers = _answers([a.health.remote() for a in self._actors(until)], until)
        return [h["segment"] for h in answers if h.get("segment") and h.get("store_healthy")
                and not h.get("draining")]

    def touches(self, keys: Sequence[str], until: float) -> list[dict[str, Touch]]:
        views = []
        for actor in self._actors(until):
            calls = [actor.touches.remote(None)] + [
                actor.touches.remote(list(keys[i:i + MAX_ANSWER]))
                for i in range(0, len(keys), MAX_ANSWER)]
            view: dict[str, Touch] = {}
            for answer in _answers(calls, until):
                view.update(answer)
            views.append(view)
        return views


def _left(until: float) -> float:
    return max(0.0, until - time.monotonic())


def _answers(refs: list, until: float) -> list:
    """The results of ``refs`` that came by ``until`` (the others, and errors: none)."""
    out = []
    for ref in refs:
        try:
            out.append(ref.future().result(_left(until)))
        except Exception as e:
            log.debug("drain: a peer did not answer: %s", e)
    return out


def node_drain(backend: StoreBackend, service: NodeService, metrics: NodeMetrics,
               namespace: str) -> SegmentDrain:
    """The drain of ``service``'s node (its store client ``backend``, its touch journal
    and L2 write-behind; its peers through Ray), counted in ``metrics``."""
    flushing = service.l2.write_behind
    return SegmentDrain(backend, service.touches, flushing.flush, flushing.unhurry,
                        RayPeers(service.node_id, namespace), metrics.record_drain)
