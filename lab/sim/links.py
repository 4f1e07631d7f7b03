"""What moves bytes between and within a simulated cluster's nodes, on simulated time
(pure): each node's link each way, its write-behind put stream and its disk, each a
first-come-first-served queue (the time it is next free, seconds).

A transfer between two nodes is done once the sender's and the receiver's links both
carried it, at the slower of the link and the store's rate (``Costs``); a node's puts
also queue on its put rate; a get served from a disk queues on that node's disk, then
crosses the links when the reader is another node (read, then sent: not overlapped).
With a disk tier every object is sealed: puts and memory gets pay the seal's pass
(``Costs.seal_s``); a disk get's rate has its check in it.
"""

from __future__ import annotations

from collections.abc import Sequence

from raykv_lab.sim.costs import Costs


class Links:
    """The queues of ``nodes`` nodes under ``costs``; ``sealed``: the cluster has a
    disk tier. ``network_bytes``: bytes moved between nodes so far."""

    def __init__(self, nodes: int, costs: Costs, sealed: bool) -> None:
        self.costs, self.sealed = costs, sealed
        self._in = [0.0] * nodes
        self._out = [0.0] * nodes
        self._put = [0.0] * nodes
        self._disk = [0.0] * nodes
        self.network_bytes = 0

    def add_node(self) -> None:
        """A node joined: its queues, idle."""
        for q in (self._in, self._out, self._put, self._disk):
            q.append(0.0)

    def transfer(self, src: int, dst: int, size: int, rate: float, t: float) -> float:
        """``size`` bytes from node ``src`` to ``dst`` at ``rate``, ready at ``t``: the
        sender's out link and the receiver's in link each serve it in turn; when both
        did. Counted in ``network_bytes``."""
        d = size / rate
        out_end = max(t, self._out[src]) + d
        in_end = max(t, self._in[dst]) + d
        self._out[src], self._in[dst] = out_end, in_end
        self.network_bytes += size
        return max(out_end, in_end)

    def fetch(self, node: int, segs: Sequence[tuple[int, bool]], t: float) -> float:
        """Reads into ``node`` from ``t`` of blocks at ``segs`` (segment, on disk): the
        own segment's memory at the store's rate, each other segment's through both
        links, each disk's on that node's disk and then, from another node, the links;
        when the last ends."""
        c = self.costs
        block = c.block_bytes
        mem: dict[int, int] = {}
        disk: dict[int, int] = {}
        for s, on_disk in segs:
            per = disk if on_disk else mem
            per[s] = per.get(s, 0) + 1
        get = self._rate(c.store_get_gbps)
        end = t + mem.pop(node, 0) * block / get
        rate = min(get, c.link_bytes_per_s)
        for s, n in mem.items():
            end = max(end, self.transfer(s, node, n * block, rate, t))
        for s, n in disk.items():
            self._disk[s] = max(t, self._disk[s]) + n * block / (c.disk_get_gbps * 1e9)
            end = max(end, self._disk[s] if s == node else self.transfer(
                s, node, n * block, min(c.disk_get_gbps * 1e9, c.link_bytes_per_s),
                self._disk[s]))
        return end

    def estimate(self, node: int, seg: int, on_disk: bool, blocks: int, t: float) -> float:
        """Seconds a read of ``blocks`` into ``node`` from segment ``seg`` (its disk when
        ``on_disk``) would take if issued alone at ``t``, the queues as they are then:
        what ``fetch`` of those blocks would add, changing nothing (the load guard's
        estimate, ``lab.sim.guard``)."""
        c = self.costs
        size = blocks * c.block_bytes
        get = self._rate(c.store_get_gbps)
        if not on_disk:
            if seg == node:
                return size / get
            d = size / min(get, c.link_bytes_per_s)
            return max(max(t, self._out[seg]), max(t, self._in[node])) + d - t
        disk_rate = c.disk_get_gbps * 1e9
        ready = max(t, self._disk[seg]) + size / disk_rate
        if seg == node:
            return ready - t
        d = size / min(disk_rate, c.link_bytes_per_s)
        return max(ready, self._out[seg], self._in[node]) + d - t

    def put(self, node: int, seg: int, blocks: int, t: float) -> float:
        """A put of ``blocks`` by ``node`` onto segment ``seg``, from ``t``: after the
        node's earlier puts, at its put rate (plus the seals), through both links when
        ``seg`` is another node's; when it ends."""
        c = self.costs
        size = blocks * c.block_bytes
        rate = self._rate(c.store_put_gbps)
        start = max(t, self._put[node])
        self._put[node] = start + size / rate
        if seg == node:
            return self._put[node]
        return max(self._put[node],
                   self.transfer(node, seg, size, min(rate, c.link_bytes_per_s), start))

    def _rate(self, gbps: float) -> float:
        """Bytes per second of a store get or put at ``gbps``, with the seal's pass
        when sealed."""
        if not self.sealed:
            return gbps * 1e9
        return 1.0 / (1.0 / (gbps * 1e9) + self.costs.seal_s(1))
