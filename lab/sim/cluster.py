"""One simulated cluster replaying a trace (pure: simulated time, no Ray, no Mooncake).

Events by timestamp: a request arrives and is routed (``routing``); it waits in its
engine's queue (one request computed at a time, first come first served); when it
starts, its leading blocks are looked up tier by tier, nearest first (the engine's GPU
prefix cache, its own host tier, its node's L2 through raykv's ``L2Index``: ``lookup``
leases, ``acquire`` holds; then L3, the ``L3Store`` model: ``lookup`` leases), the
layout's load guard keeps the leading blocks of that L2 and L3 hit worth loading
(``guard``; off: all of them), those are loaded (L3 reads queue on the links, then fill
L2 as the node's own holder does) and the rest is computed; when it ends (its first
token), its blocks enter the GPU cache and its host tier or its node's L2 (``reserve``
and ``commit``, dirty while L3 lacks them), and the node's write-behind puts them to L3
(one put stream per node, queued on the links; placement ``own`` or ``any``); a put's
end makes its objects readable and its L2 pages clean (``flushed``). With a disk tier,
what L3 evicts goes to its node's disk (``disk``), and is read from there.

Transfers queue on each node's links, put stream and disk (``links``). A node leaving
or joining at a simulated second (``scaling``, ``node_changes``): a leaving node's
engines stop taking requests (those queued on them go to the router again; the one
running ends but saves nothing), its L2 and GPU caches are gone, its segment drained or
not; a joining node's engines, L2 and segment start empty, its L2 warmed or not.
What is not modelled: see ``docs/benchmarks.md`` ("Trace replay").
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict

from raykv.cache_actors.node.l2_index import L2Index
from raykv.cache_actors.node.l2_pools import LEASE_S
from raykv.controllers.load_guard import GuardSettings
from raykv.controllers.residency import Residency
from raykv.controllers.result_codes import FULL
from raykv.integrations.serve.ranking import Weights
from raykv_lab.sim import node_changes as nc
from raykv_lab.sim.block_lru import BlockLRU
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.disk import DiskTier
from raykv_lab.sim.guard import SimGuard, hit_runs
from raykv_lab.sim.l3_store import L3Store
from raykv_lab.sim.layout import Layout
from raykv_lab.sim.links import Links
from raykv_lab.sim.node_changes import NodeChanges
from raykv_lab.sim.routing import PowerOfTwo, RayKVRouting, RoundRobin
from raykv_lab.sim.scaling import Scaling
from raykv_lab.sim.tally import Tally
from raykv_lab.sim.trace import Request

NODE_HOLDER = (0, 0)
"""The holder a node fills its L2 from L3 as (ids below 1 are the node's own)."""
_DONE, _PUT_DONE, _REMOVE, _ADD = 0, 1, 2, 3


class _Engine:
    __slots__ = ("index", "node", "node_id", "gpu", "host", "queue", "busy", "holder")

    def __init__(self, index: int, node: int, gpu_blocks: int, host_blocks: int) -> None:
        self.index, self.node, self.node_id = index, node, f"node-{node}"
        self.gpu = BlockLRU(gpu_blocks) if gpu_blocks else None
        self.host = BlockLRU(host_blocks) if host_blocks else None
        self.queue: deque[int] = deque()
        self.busy = False
        self.holder = (index + 1, 0)


class ClusterSim:
    """``layout``'s cluster with ``costs`` replaying ``requests`` (arrival order), with
    ``scaling``'s node changes if given; ``run`` once. ``weights``: the router's
    (``raykv`` routing; default its own)."""

    def __init__(self, layout: Layout, costs: Costs, requests: Sequence[Request],
                 scaling: Scaling | None = None, weights: Weights | None = None) -> None:
        self.layout, self.costs, self.requests = layout, costs, requests
        self.now = 0.0
        rng = random.Random(layout.seed)
        self._keys = [tuple(map(str, r.blocks)) for r in requests]
        self._engines = [_Engine(i, i // layout.engines_per_node, layout.gpu_blocks,
                                 layout.host_blocks) for i in range(layout.engines)]
        self._ids = list(range(layout.engines))
        clock = self._clock
        self._l2 = [L2Index(layout.l2_blocks, LEASE_S, clock, eviction=layout.l2_eviction)
                    if layout.l2_blocks else None for _ in range(layout.nodes)]
        disk = DiskTier([layout.disk_blocks] * layout.nodes) if layout.disk_blocks else None
        self._l3 = L3Store([layout.l3_blocks] * layout.nodes, clock, rng, disk=disk) \
            if layout.l3_blocks else None
        self._router = RayKVRouting(rng, weights) if layout.routing == "raykv" else \
            RoundRobin() if layout.routing == "round_robin" else PowerOfTwo(rng)
        self._links = Links(layout.nodes, costs, sealed=disk is not None)
        self._guard = SimGuard(GuardSettings.parse(layout.load_guard), costs)
        self._events: list[tuple[float, int, int, tuple]] = []
        self._seq = 0
        self.tally = Tally(layout.nodes)
        self.scaling = scaling
        self._alive = list(range(layout.nodes))
        self._changes = NodeChanges(layout.nodes, costs) if scaling else None
        self._removed_at = 0.0
        for at, kind in ((scaling and scaling.remove_at, _REMOVE),
                         (scaling and scaling.add_at, _ADD)):
            if at is not None:
                self._push(at, kind, ())

    def _clock(self) -> float:
        return self.now

    # ---------------------------------------------------------------- the loop
    def run(self) -> Tally:
        """Replay every request to its end (every put too); the run's ``Tally``."""
        reqs, events = self.requests, self._events
        handlers = {_DONE: self._done, _PUT_DONE: self._put_done, _REMOVE: self._remove,
                    _ADD: self._add}
        i = 0
        while i < len(reqs) or events:
            if events and (i >= len(reqs) or events[0][0] <= reqs[i].at):
                t, _, kind, payload = heapq.heappop(events)
                self.now = t
                if kind in handlers:
                    handlers[kind](*payload)
                else:  # the node changes' own events
                    self._change(kind, payload)
            else:
                self.now = reqs[i].at
                self._arrive(i)
                i += 1
        self.tally.network_bytes = self._links.network_bytes
        return self.tally

    def _push(self, t: float, kind: int, payload: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _load(self, e: int) -> int:
        eng = self._engines[e]
        return len(eng.queue) + eng.busy

    def _arrive(self, i: int) -> None:
        """Request ``i`` routed to one of the engines of the nodes up now."""
        keys = self._keys[i]
        e = self._router.choose(self._ids, keys, lambda: self._answers(keys), self._load,
                                lambda x: self._engines[x].node_id)
        eng = self._engines[e]
        eng.queue.append(i)
        if not eng.busy:
            self._start(eng)

    def _answers(self, keys: Sequence[str]) -> dict[str, Residency]:
        """Each node's residency of ``keys``, as its node actor answers a router."""
        l3 = self._l3.leading(keys) if self._l3 else 0
        out = {}
        for n, l2 in enumerate(self._l2):
            held = 0
            if l2 is not None:
                while held < len(keys) and l2.page_of(keys[held]) is not None:
                    held += 1
            seg = 0
            while seg < l3 and self._l3.segment_of(keys[seg]) == n:
                seg += 1
            out[f"node-{n}"] = Residency(f"node-{n}", len(keys), held, seg, l3)
        return out

    # ---------------------------------------------------------------- a request
    def _start(self, eng: _Engine) -> None:
        i = eng.queue.popleft()
        eng.busy = True
        r, keys, c = self.requests[i], self._keys[i], self.costs
        counts = {"gpu": eng.gpu.leading(keys) if eng.gpu is not None else 0}
        pos, load = counts["gpu"], 0.0
        if eng.host is not None:
            counts["host"] = eng.host.leading(keys[pos:])
            pos += counts["host"]
            load += counts["host"] * c.block_bytes / (c.host_load_gbps * 1e9)
        l2 = self._l2[eng.node]
        found = l2.lookup(keys[pos:]) if l2 is not None else 0
        segs = self._l3.lookup(keys[pos + found:]) if self._l3 is not None else []
        if not self._guard.off:
            take = self._guard.pages(hit_runs(eng.node, found, segs, self._links, c,
                                              self.now, l2 is not None))
            found, segs = min(found, take), segs[:max(0, take - found)]
        copied = 0
        if l2 is not None:
            rest = keys[pos:]
            counts["l2"] = found
            l2.acquire(eng.holder, rest[:counts["l2"]])
            self._touched(eng.node, rest[:counts["l2"]])
            pos += counts["l2"]
            copied += counts["l2"]
            load += c.l2_call_s
        if self._l3 is not None:
            rest = keys[pos:]
            if segs:
                disk = sum(d for _, d in segs)
                own = sum(s == eng.node and not d for s, d in segs)
                counts["l3_own"], counts["l3_disk"] = own, disk
                counts["l3_remote"] = len(segs) - own - disk
                load += self._links.fetch(eng.node, segs, self.now) - self.now + \
                    c.store_call_s
                self._touched(eng.node, rest[:len(segs)])
                if l2 is not None:
                    self._fill(l2, eng, rest[:len(segs)])
                    copied += len(segs)
            pos += len(segs)
        if copied:
            load += copied * c.block_bytes / (c.l2_load_gbps * 1e9)
        self.tally.served(r, eng.node, counts)
        computed = r.input_tokens - r.hit_tokens(pos)
        self._push(self.now + load + c.prefill_s(computed), _DONE, (eng, i))

    def _fill(self, l2: L2Index, eng: _Engine, keys: Sequence[str]) -> None:
        """Blocks read from L3 into the node's L2, held for the engine's load."""
        pages = [p for p in l2.reserve(NODE_HOLDER, keys) if p >= 0]
        l2.commit(NODE_HOLDER, pages, [True] * len(pages), dirty=False, reader=eng.holder)

    def _done(self, eng: _Engine, i: int) -> None:
        r, keys = self.requests[i], self._keys[i]
        ttft = self.now - r.at
        self.tally.finished(ttft, ttft + r.output_tokens / self.costs.decode_tokens_per_s)
        unique = list(dict.fromkeys(keys))
        if eng.node not in self._alive:  # its node left meanwhile: nothing is saved
            eng.busy = False
            return
        if eng.gpu is not None:
            eng.gpu.insert(unique)
        if eng.host is not None:
            eng.host.insert(unique)
        l2 = self._l2[eng.node]
        if l2 is not None:
            l2.release(eng.holder)
            res = l2.reserve(eng.holder, unique)
            pages = [p for p in res if p >= 0]
            made = l2.commit(eng.holder, pages, [True] * len(pages),
                             dirty=self._l3 is not None)
            if self._l3 is not None:
                full = [(k, None) for k, p in zip(unique, res, strict=True) if p == FULL]
                self._put(eng.node, [(l2.key_of(p), p) for p in made] + full)
        elif self._l3 is not None:
            self._put(eng.node, [(k, None) for k in unique])
        eng.busy = False
        if eng.queue:
            self._start(eng)

    # ---------------------------------------------------------------- write-behind
    def _put(self, node: int, items: list[tuple[str, int | None]]) -> None:
        """``node``'s put of ``items`` (key, its dirty L2 page or None) to L3, after its
        earlier puts; keys L3 holds, or has no room for, move no bytes."""
        preferred = node if self.layout.placement == "own" else None
        per: dict[int, list[tuple[str, int | None]]] = {}
        dropped = []
        for key, page in items:
            seg = self._l3.start_put(key, preferred)
            if seg is None:
                dropped.append((key, page))
            else:
                per.setdefault(seg, []).append((key, page))
        if dropped:
            self._push(self.now, _PUT_DONE, (node, dropped))
            self._touched(node, [k for k, _ in dropped if self._l3.segment_of(k) is not None])
        for seg, batch in per.items():
            self._push(self._links.put(node, seg, len(batch), self.now), _PUT_DONE,
                       (node, batch))

    def _put_done(self, node: int, batch: list[tuple[str, int | None]]) -> None:
        l2 = self._l2[node]
        for key, page in batch:
            self._l3.end_put(key)
            if l2 is not None and page is not None:
                l2.flushed([page], [key])
        self._touched(node, [k for k, _ in batch if self._l3.segment_of(k) is not None])

    # ---------------------------------------------------------------- nodes
    def _touched(self, node: int, keys: Sequence[str]) -> None:
        if self._changes is not None:
            self._changes.touched(node, list(keys), self.now)

    def _remove(self) -> None:
        """A node leaves (``Scaling``): its engines out of the router's sight and
        their queued requests routed again, its L2 gone, its segment drained or not."""
        s, l3 = self.scaling, self._l3
        node = s.leaving if s.leaving is not None else max(
            self._alive, key=lambda n: (l3.held_on(n) if l3 else 0, -n))
        if node not in self._alive or len(self._alive) < 2:
            raise ValueError(f"scaling: node {node} cannot leave (nodes up: {self._alive})")
        self._alive.remove(node)
        self._removed_at = self.now
        gone = [e for e in self._engines if e.node == node]
        self._ids = [i for i in self._ids if self._engines[i].node != node]
        l2, self._l2[node] = self._l2[node], None
        rerouted = [i for e in gone for i in e.queue]
        for e in gone:
            e.queue = deque()
        for i in rerouted:
            self._arrive(i)
        self._changes.report["removed"] = {
            "node": node, "at": self.now, "rerouted": len(rerouted),
            "l2_pages_lost": l2.stats().ready if l2 is not None else 0}
        self._pushed(self._changes.remove(node, s.drain, s.drain_deadline_s, l3,
                                          self._alive, self.now))

    def _add(self) -> None:
        """A node joins (``Scaling``): its engines, L2 and segment empty, its L2 warmed
        or not."""
        lay, node = self.layout, len(self._l2)
        first = len(self._engines)
        self._engines += [_Engine(first + j, node, lay.gpu_blocks, lay.host_blocks)
                          for j in range(lay.engines_per_node)]
        self._ids += range(first, len(self._engines))
        l2 = L2Index(lay.l2_blocks, LEASE_S, self._clock) if lay.l2_blocks else None
        self._l2.append(l2)
        if self._l3 is not None:
            self._l3.add_segment(lay.l3_blocks, lay.disk_blocks)
        self._links.add_node()
        self.tally.add_node()
        peers = list(self._alive)
        self._alive.append(node)
        self._changes.report["added"] = {"node": node, "at": self.now}
        self._pushed(self._changes.add(node, self.scaling.warm_budget(lay.l2_blocks),
                                       self.scaling.warm_s, self._l3, l2, self._links,
                                       peers, self.now))

    def _change(self, kind: int, payload: tuple) -> None:
        ch = self._changes
        if kind == nc.DRAIN:
            self._pushed(ch.drain_step(self._l3, self._links, self.now))
        elif kind == nc.LEAVE:
            ch.leave(self._l3, self._removed_at, self.now)
        else:
            ch.warmed(self._l2[payload[0]], payload[1])

    def _pushed(self, events: list[tuple[float, int, tuple]]) -> None:
        for t, kind, payload in events:
            self._push(t, kind, payload)

    def stats(self) -> dict:
        """The tiers' own counters after ``run``: L2 (summed over nodes), L3, routing;
        with ``scaling``, its events' reports (``NodeChanges.summary``)."""
        l2 = [asdict(x.stats()) for x in self._l2 if x is not None]  # by counter name
        out: dict = {}
        if self._changes is not None:
            out["scaling"] = self._changes.summary(self.tally.log, self.scaling.window_s,
                                                   self.scaling.window_at)
        if l2:
            out["l2"] = {k: sum(s[k] for s in l2) for k in l2[0]}
        if self._l3 is not None:
            out["l3"] = self._l3.stats()
        if isinstance(self._router, RayKVRouting):
            out["routing"] = dict(self._router.counts)
        if not self._guard.off:
            out["load_guard"] = dict(self._guard.counts)
        return out
