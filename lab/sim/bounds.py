"""Untimed references over a trace (pure): requests one after the other, in arrival
order, each a lookup of its leading cached blocks and then its blocks inserted; one
cache for the whole cluster.

- ``global_lru``: one LRU of ``capacity`` blocks (a hit refreshes a block; an insert
  evicts the least recently used);
- ``unbounded``: nothing evicted;
- ``belady``: the same capacity with Belady's eviction: the block used again farthest
  in the future goes first (a block never used again, or later than every cached one,
  is not inserted). It is the optimum for block hits; for prefix hits (a block counts
  only after every block before it hit) it is the usual bound, not a proven optimum.

Each returns a ``Hits`` of prefix hits: blocks and tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from raykv_lab.sim.block_lru import BlockLRU, leading
from raykv_lab.sim.trace import Request


@dataclass(frozen=True)
class Hits:
    """Prefix hits of a replay: ``hit_blocks`` of ``blocks``, ``hit_tokens`` of
    ``tokens``."""

    blocks: int
    hit_blocks: int
    tokens: int
    hit_tokens: int

    @property
    def block_rate(self) -> float:
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    @property
    def token_rate(self) -> float:
        return self.hit_tokens / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"block_hit_rate": round(self.block_rate, 6),
                "token_hit_rate": round(self.token_rate, 6),
                "hit_blocks": self.hit_blocks, "blocks": self.blocks}


def _check(capacity: int) -> None:
    if type(capacity) is not int or capacity < 1:
        raise ValueError(f"a cache's capacity is >= 1 blocks, got {capacity!r}")


def _tally(requests: Sequence[Request], hits: list[int]) -> Hits:
    return Hits(sum(len(r.blocks) for r in requests), sum(hits),
                sum(r.input_tokens for r in requests),
                sum(r.hit_tokens(h) for r, h in zip(requests, hits, strict=True)))


def unbounded(requests: Sequence[Request]) -> Hits:
    """Prefix hits with every block kept."""
    seen: set[int] = set()
    hits = []
    for r in requests:
        hits.append(leading(r.blocks, seen))
        seen.update(r.blocks)
    return _tally(requests, hits)


def global_lru(requests: Sequence[Request], capacity: int) -> Hits:
    """Prefix hits of one LRU of ``capacity`` blocks."""
    _check(capacity)
    lru = BlockLRU(capacity)
    hits = []
    for r in requests:
        hits.append(lru.leading(r.blocks))
        lru.insert(r.blocks)
    return _tally(requests, hits)


def next_uses(requests: Sequence[Request]) -> list[list[float]]:
    """Per request and block: the index of the next request that names the block
    (``inf``: none)."""
    later: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        blocks = requests[i].blocks
        out[i] = [later.get(b, float("inf")) for b in blocks]
        for b in blocks:
            later[b] = i
    return out


def belady(requests: Sequence[Request], capacity: int) -> Hits:
    """Prefix hits of a cache of ``capacity`` blocks under Belady's eviction."""
    _check(capacity)
    nxt = next_uses(requests)
    cached: dict[int, float] = {}  # block -> its next use
    far: list[tuple[float, int]] = []  # (-next use, block), stale entries skipped
    hits = []
    for r, uses in zip(requests, nxt, strict=True):
        hits.append(leading(r.blocks, cached))
        for b, use in zip(r.blocks, uses, strict=True):
            if b not in cached and len(cached) >= capacity:
                while -far[0][0] != cached.get(far[0][1]):
                    heapq.heappop(far)
                if -far[0][0] <= use:
                    continue  # every cached block is used again sooner: not inserted
                del cached[heapq.heappop(far)[1]]
            if use == float("inf"):
                cached.pop(b, None)  # never used again: worth nothing cached
                continue
            cached[b] = use
            heapq.heappush(far, (-use, b))
    return _tally(requests, hits)
