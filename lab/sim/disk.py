"""A model of each node's disk tier (L4: Mooncake 0.3.13's SSD offload under raykv's
disk slot), pure.

What it models, as measured (``docs/internals.md``, "The disk tier (L4)";
``docs/disk_tier.json``):

- an object the store evicts from a node's memory is written to that node's disk
  (``offload_on_evict``), at once (the write's time, and the puts Mooncake refuses
  while it waits for it, are not modelled);
- a full disk deletes its oldest bucket for a new one: first in, first out, by the
  order objects were written. A block's objects are written one after the other, so
  the model deletes whole blocks, oldest written first; reads do not change the order;
- a get served from disk leaves the object on disk: it does not come back to memory
  (the benchmark read each object 11 times, none was in memory after);
- a node that leaves takes its disk with it (its disk objects are not drained).

Capacities are blocks per node (0: that node has no disk).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class DiskTier:
    """Every node's disk of ``capacities`` blocks (index: the node). Counters in
    ``counts``."""

    def __init__(self, capacities: Sequence[int]) -> None:
        if any(type(c) is not int or c < 0 for c in capacities):
            raise ValueError(f"disk capacities must be blocks >= 0, got {list(capacities)!r}")
        self._cap = list(capacities)
        self._fifo: list[OrderedDict[str, None]] = [OrderedDict() for _ in capacities]
        self._where: dict[str, int] = {}
        self.counts = {"offloaded": 0, "deleted": 0, "lost": 0}

    def node_of(self, key: str) -> int | None:
        """The node whose disk holds ``key``, else None."""
        return self._where.get(key)

    def offload(self, node: int, key: str) -> None:
        """``key``, evicted from ``node``'s memory, written to its disk (dropped if the
        node has none); the oldest objects deleted while the disk is over capacity."""
        if not self._cap[node] or key in self._where:
            return
        fifo = self._fifo[node]
        fifo[key] = None
        self._where[key] = node
        self.counts["offloaded"] += 1
        while len(fifo) > self._cap[node]:
            old, _ = fifo.popitem(last=False)
            del self._where[old]
            self.counts["deleted"] += 1

    def drop_node(self, node: int) -> int:
        """``node`` left: its disk's objects are gone; how many."""
        fifo = self._fifo[node]
        for key in fifo:
            del self._where[key]
        lost = len(fifo)
        fifo.clear()
        self._cap[node] = 0
        self.counts["lost"] += lost
        return lost

    def add_node(self, capacity: int) -> None:
        """A node joined with an empty disk of ``capacity`` blocks."""
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"a disk holds >= 0 blocks, got {capacity!r}")
        self._cap.append(capacity)
        self._fifo.append(OrderedDict())

    def stats(self) -> dict[str, int]:
        """Objects held, capacity (blocks, every node), and ``counts``."""
        return {"objects": len(self._where), "capacity": sum(self._cap), **self.counts}
