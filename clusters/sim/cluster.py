"""One simulated cluster replaying a trace (pure: simulated time, no Ray, no Mooncake).

Events by timestamp: a request arrives and is routed (``routing``); it waits in its
engine's queue (one request computed at a time, first come first served); when it
starts, its leading blocks are looked up tier by tier, nearest first (the engine's GPU
prefix cache, its own host tier, its node's L2 through raykv's ``L2Index``: ``lookup``
leases, ``acquire`` holds; then L3, the ``L3Store`` model: ``lookup`` leases), the found
blocks are loaded (L3 reads queue on the links, then fill L2 as the node's own holder
does) and the rest is computed; when it ends (its first token), its blocks enter the
GPU cache and its host tier or its node's L2 (``reserve`` and ``commit``, dirty while
L3 lacks them), and the node's write-behind puts them to L3 (one put stream per node,
queued on the links; placement ``own`` or ``any``); a put's end makes its objects
readable and its L2 pages clean (``flushed``).

Each node has one link each way, each a first-come-first-served queue: a transfer is
done once the sender's and the receiver's links both carried it, at the slower of the
link and the store's rate (``Costs``); a node's puts also queue on its put rate.
What is not modelled: see ``docs/benchmarks.md`` ("Trace replay").
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Sequence

from raykv.cache_actors.node.l2_index import FULL, L2Index
from raykv.cache_actors.node.l2_pools import LEASE_S
from raykv.clusters.sim.block_lru import BlockLRU
from raykv.clusters.sim.costs import Costs
from raykv.clusters.sim.l3_store import L3Store
from raykv.clusters.sim.layout import Layout
from raykv.clusters.sim.routing import PowerOfTwo, RayKVRouting
from raykv.clusters.sim.tally import Tally
from raykv.clusters.sim.trace import Request
from raykv.controllers.residency import Residency

NODE_HOLDER = (0, 0)
"""The holder a node fills its L2 from L3 as (ids below 1 are the node's own)."""
_DONE, _PUT_DONE = 0, 1


class _Engine:
    __slots__ = ("index", "node", "node_id", "gpu", "host", "queue", "busy", "holder")

    def __init__(self, index: int, node: int, gpu_blocks: int, host_blocks: int) -> None:
        self.index, self.node, self.node_id = index, node, f"node-{node}"
        self.gpu = BlockLRU(gpu_blocks)
        self.host = BlockLRU(host_blocks) if host_blocks else None
        self.queue: deque[int] = deque()
        self.busy = False
        self.holder = (index + 1, 0)


class ClusterSim:
    """``layout``'s cluster with ``costs`` replaying ``requests`` (arrival order);
    ``run`` once."""

    def __init__(self, layout: Layout, costs: Costs, requests: Sequence[Request]) -> None:
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
        self._l3 = L3Store([layout.l3_blocks] * layout.nodes, clock, rng) \
            if layout.l3_blocks else None
        self._router = RayKVRouting(rng) if layout.routing == "raykv" else PowerOfTwo(rng)
        self._link_in = [0.0] * layout.nodes
        self._link_out = [0.0] * layout.nodes
        self._put_free = [0.0] * layout.nodes
        self._events: list[tuple[float, int, int, tuple]] = []
        self._seq = 0
        self.tally = Tally(layout.nodes)

    def _clock(self) -> float:
        return self.now

    # ---------------------------------------------------------------- the loop
    def run(self) -> Tally:
        """Replay every request to its end (every put too); the run's ``Tally``."""
        reqs, events = self.requests, self._events
        i = 0
        while i < len(reqs) or events:
            if events and (i >= len(reqs) or events[0][0] <= reqs[i].at):
                t, _, kind, payload = heapq.heappop(events)
                self.now = t
                if kind == _DONE:
                    self._done(*payload)
                else:
                    self._put_done(*payload)
            else:
                self.now = reqs[i].at
                self._arrive(i)
                i += 1
        return self.tally

    def _push(self, t: float, kind: int, payload: tuple) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def _load(self, e: int) -> int:
        eng = self._engines[e]
        return len(eng.queue) + eng.busy

    def _arrive(self, i: int) -> None:
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
        counts = {"gpu": eng.gpu.leading(keys)}
        pos, load = counts["gpu"], 0.0
        if eng.host is not None:
            counts["host"] = eng.host.leading(keys[pos:])
            pos += counts["host"]
            load += counts["host"] * c.block_bytes / (c.host_load_gbps * 1e9)
        l2 = self._l2[eng.node]
        copied = 0
        if l2 is not None:
            rest = keys[pos:]
            counts["l2"] = l2.lookup(rest)
            l2.acquire(eng.holder, rest[:counts["l2"]])
            pos += counts["l2"]
            copied += counts["l2"]
            load += c.l2_call_s
        if self._l3 is not None:
            rest = keys[pos:]
            segs = self._l3.lookup(rest)
            if segs:
                own = sum(s == eng.node for s in segs)
                counts["l3_own"], counts["l3_remote"] = own, len(segs) - own
                load += self._fetch(eng.node, segs) - self.now + c.store_call_s
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

    def _fetch(self, node: int, segs: Sequence[int]) -> float:
        """Reads of blocks on ``segs`` into ``node``: the own segment's at the store's
        rate, each other segment's through both links (``_transfer``); when the last
        ends."""
        c = self.costs
        per: dict[int, int] = {}
        for s in segs:
            per[s] = per.get(s, 0) + 1
        end = self.now + per.pop(node, 0) * c.block_bytes / (c.store_get_gbps * 1e9)
        rate = min(c.store_get_gbps * 1e9, c.link_bytes_per_s)
        for s, n in per.items():
            end = max(end, self._transfer(s, node, n * c.block_bytes, rate, self.now))
        return end

    def _transfer(self, src: int, dst: int, size: int, rate: float, t: float) -> float:
        """``size`` bytes from node ``src`` to ``dst`` at ``rate``, ready at ``t``: each
        link a first-come-first-served queue of its own (the sender's out, the
        receiver's in), the transfer done when both served it; counted as network
        bytes."""
        d = size / rate
        out_end = max(t, self._link_out[src]) + d
        in_end = max(t, self._link_in[dst]) + d
        self._link_out[src], self._link_in[dst] = out_end, in_end
        self.tally.network_bytes += size
        return max(out_end, in_end)

    def _done(self, eng: _Engine, i: int) -> None:
        r, keys = self.requests[i], self._keys[i]
        ttft = self.now - r.at
        self.tally.finished(ttft, ttft + r.output_tokens / self.costs.decode_tokens_per_s)
        unique = list(dict.fromkeys(keys))
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
        c = self.costs
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
        rate = min(c.store_put_gbps * 1e9, c.link_bytes_per_s)
        for seg, batch in per.items():
            size = len(batch) * c.block_bytes
            start = max(self.now, self._put_free[node])
            self._put_free[node] = start + size / (c.store_put_gbps * 1e9)
            end = self._put_free[node] if seg == node else \
                max(self._put_free[node], self._transfer(node, seg, size, rate, start))
            self._push(end, _PUT_DONE, (node, batch))

    def _put_done(self, node: int, batch: list[tuple[str, int | None]]) -> None:
        l2 = self._l2[node]
        for key, page in batch:
            self._l3.end_put(key)
            if l2 is not None and page is not None:
                l2.flushed([page], [key])

    def stats(self) -> dict:
        """The tiers' own counters after ``run``: L2 (summed over nodes), L3, routing."""
        l2 = [x.stats() for x in self._l2 if x is not None]
        out: dict = {}
        if l2:
            out["l2"] = {k: sum(s[k] for s in l2) for k in l2[0]}
        if self._l3 is not None:
            out["l3"] = self._l3.stats()
        if isinstance(self._router, RayKVRouting):
            out["routing"] = dict(self._router.counts)
        return out
