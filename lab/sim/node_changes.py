"""A node leaving and a node joining a simulated cluster, through raykv's own plans
(pure): the drain's (``controllers.drain_plan``, ``touch_journal.hottest``) and the
warm-up's (``cache_actors.node.warm_plan``), on every node's ``TouchJournal``.

The journals note what the node actor's note: the objects a node's puts stored or
found present, those its L3 reads read, and the pages its L2 served, each at the
simulated second it happened (one call's keys share it).

*Drain* (``SegmentDrain``'s steps): the leaving node's segment takes no new puts; its
candidates are the objects of its own journal, ordered by their touches merged with
the peers' touches of the same keys (``hottest``), those held on its segment alone
(``sole_on``: memory objects; disk objects are not drained), each taken while it
fits in the store's ``room`` below its high watermark (``fitting``); they move one
after the other to the other nodes' segments in turn at ``Costs.drain_blocks_per_s``,
until the deadline: a move whose target segment is full fails (a drain never makes
room), one whose object the store evicted meanwhile moves nothing. Then the node is
gone with whatever it still holds.

*Warm-up* (``L2Warmup``'s steps): the joining node asks up to ``MAX_PEERS`` peers
(``peers_to_ask``) for their journals' latest ``answer_limit`` entries and reads the
runs ``warm_runs`` chooses within its budget from L3 into free pages of its L2 (none
evicted), coldest run first, each run until its first page L3 no longer holds, reads
queued on the links; the pages are ready when their read ends; it stops at its time
budget or when L2 has no free page.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from raykv.cache_actors.node.l2_index import L2Index
from raykv.cache_actors.node.touch_journal import TouchJournal, hottest
from raykv.cache_actors.node.warm_plan import (
    MAX_PEERS,
    answer_limit,
    peers_to_ask,
    rank_objects,
    warm_runs,
)
from raykv.controllers.drain_plan import fitting, room, sole_on
from raykv.controllers.result_codes import FULL
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.l3_store import L3Store
from raykv_lab.sim.links import Links
from raykv_lab.sim.scaling import Served, around

DRAIN, LEAVE, WARMED = 10, 11, 12
"""The events this module asks its cluster to push: the drain's next move, the
leaving node gone, a warm-up's read done."""
WARM_HOLDER = (0, 1)
"""The holder a warm-up writes L2 pages as."""


def name(node: int) -> str:
    return f"node-{node}"


class NodeChanges:
    """The journals of a cluster's nodes (``nodes`` at first) and its scale events'
    reports (``report``: ``drain``, ``warm``); the cluster passes its tiers in and
    pushes the events each call returns, ``(time, kind, payload)``."""

    def __init__(self, nodes: int, costs: Costs) -> None:
        self.costs = costs
        self.journals = [TouchJournal() for _ in range(nodes)]
        self.report: dict = {}
        self._queue: deque[str] = deque()
        self._targets: list[int] = []
        self._leaving, self._end, self._started = -1, 0.0, 0

    def summary(self, log: Sequence[Served], window_s: float,
                window_at: float | None = None) -> dict:
        """``report`` with the hit rates in ``window_s`` before and after each event
        (``around``), the joining node's own after its join too (``node_after``), and
        around ``window_at`` if given (``window``)."""
        out = dict(self.report)
        if window_at is not None:
            out["window"] = around(log, window_at, window_s)
        if "removed" in out:
            out["removed"] = out["removed"] | around(log, out["removed"]["at"], window_s)
        if "added" in out:
            at, node = out["added"]["at"], out["added"]["node"]
            out["added"] = out["added"] | around(log, at, window_s) | {
                "node_after": around(log, at, window_s, node)["after"]}
        return out

    def touched(self, node: int, keys: list[str], now: float) -> None:
        """``node``'s store call or L2 touched ``keys`` at ``now``."""
        if keys:
            self.journals[node].touched(keys, [self.costs.block_bytes] * len(keys), now)

    # ---------------------------------------------------------------- leaving
    def remove(self, node: int, drain: bool, deadline_s: float, store: L3Store | None,
               alive: list[int], now: float) -> list[tuple[float, int, tuple]]:
        """``node`` leaves at ``now`` (``alive``: the nodes that stay): with ``drain``,
        its drain planned and its first move (or its leaving) asked for; without, it
        is gone at once."""
        self._leaving = node
        if store is None:
            return []
        if not drain:
            return [(now, LEAVE, ())]
        bb = self.costs.block_bytes
        mine = self.journals[node].entries()
        keys = [k for k, _ in mine]
        views = [dict(mine), *(self.journals[n].answer(keys) for n in alive)]
        order = [k for k, _ in hottest(views)]
        located = [(name(s),) if (s := store.in_memory(k)) is not None else () for k in order]
        (cap, used), (own_cap, own_used) = store.usage(), store.usage(node)
        space = room(cap * bb, used * bb, own_cap * bb, own_used * bb)
        choice = fitting([(k, bb) for k in sole_on(order, located, name(node))], space)
        store.close(node)
        self._queue = deque(k for k, _ in choice.take)
        self._targets = [n for n in alive if store.usage(n)[0]]
        self._end = now + deadline_s
        self.report["drain"] = {
            "held": store.held_on(node), "candidates": len(choice.take) + len(choice.dropped),
            "room_blocks": space // bb, "dropped": len(choice.dropped), "moved": 0,
            "evicted": 0, "failed": 0, "left": 0, "seconds": 0.0, "deadline_s": deadline_s}
        return self._next(now)

    def drain_step(self, store: L3Store, links: Links, now: float
                   ) -> list[tuple[float, int, tuple]]:
        """The drain's next move: the hottest object left, to the next target."""
        key = self._queue.popleft()
        report = self.report["drain"]
        dst = self._targets[self._started % len(self._targets)] if self._targets else None
        self._started += 1
        if store.in_memory(key) != self._leaving:
            report["evicted"] += 1  # evicted since the plan: nothing to move
        elif dst is not None and store.move(key, self._leaving, dst):
            report["moved"] += 1
            links.transfer(self._leaving, dst, self.costs.block_bytes,
                           self.costs.link_bytes_per_s, now)
        else:
            report["failed"] += 1  # the target segment had no room
        return self._next(now)

    def _next(self, now: float) -> list[tuple[float, int, tuple]]:
        at = now + 1.0 / self.costs.drain_blocks_per_s
        if self._queue and at <= self._end and self._targets:
            return [(at, DRAIN, ())]
        return [(self._end if self._queue and self._targets else now, LEAVE, ())]

    def leave(self, store: L3Store, started: float, now: float) -> None:
        """The leaving node is gone now (its drain started at ``started``): what it
        still held is lost."""
        lost = store.drop_segment(self._leaving)
        self.report["removed"]["gone_at"] = now
        if "drain" in self.report:
            self.report["drain"]["left"] = len(self._queue)
            self.report["drain"]["seconds"] = round(now - started, 3)
            self._queue.clear()
        self.report["lost"] = lost

    # ---------------------------------------------------------------- joining
    def add(self, node: int, pages: int, warm_s: float, store: L3Store | None,
            l2: L2Index | None, links: Links, alive: list[int], now: float
            ) -> list[tuple[float, int, tuple]]:
        """``node`` joined at ``now`` (its journal, L2 and segment already there): its
        warm-up of at most ``pages`` pages within ``warm_s``; a ``WARMED`` event per run
        read."""
        self.journals.append(TouchJournal())
        report = self.report["warm"] = {"pages": pages, "chosen": 0, "read": 0,
                                        "stopped": "nothing", "seconds": 0.0}
        if store is None or l2 is None or pages <= 0:
            report["stopped"] = "off"
            return []
        limit = answer_limit(pages)
        peers = peers_to_ask([name(n) for n in alive], [name(n) for n in alive],
                             name(node), MAX_PEERS)
        views = [dict(self.journals[int(p.removeprefix("node-"))].recent(limit))
                 for p in peers]
        runs = warm_runs(views, rank_objects("", "", self.costs.block_bytes), pages, limit)
        report["chosen"] = sum(map(len, runs))
        events, t, deadline = [], now, now + warm_s
        for run in reversed(runs):  # the hottest read last: the last L2 evicts
            if t >= deadline:
                report["stopped"] = "time"
                break
            missing = [k for k in run if l2.page_of(k) is None]
            segs = store.lookup(missing)
            got = missing[:len(segs)]
            res = l2.reserve(WARM_HOLDER, got, evict=False)
            made = [(k, p) for k, p in zip(got, res, strict=True) if p >= 0]
            if made:
                t = links.fetch(node, segs[:len(made)], t)
                events.append((t, WARMED, (node, made)))
                report["read"] += len(made)
                self.touched(node, [k for k, _ in made], now)
            if FULL in res:
                report["stopped"] = "no room"
                break
            report["stopped"] = "done"
        report["seconds"] = round(t - now, 3)
        return events

    def warmed(self, l2: L2Index | None, made: list[tuple[str, int]]) -> None:
        """A warm-up's read of ``made`` (key, page) ended: the pages are ready."""
        if l2 is not None:
            l2.commit(WARM_HOLDER, [p for _, p in made], [True] * len(made), dirty=False)
