"""A model of Mooncake's store as raykv's L3 (pure): segments of fixed capacity, one per
node, objects of one block each, and the eviction Mooncake documents (its Store design
guide, "Eviction Policy" and "Lease"):

- an approximate LRU: when a put finds no room, or the space in use passes the high
  watermark (``-eviction_high_watermark_ratio``, 0.95 by default), a share of the
  objects (``-eviction_ratio``, 0.05 by default) is evicted, least recently used first;
- an object with a lease (granted by an existence check or a read, 5 s by default:
  ``default_kv_lease_ttl``) or whose put has not ended is never evicted;
- a put that finds no room fails (the eviction it triggers frees room for later puts);
- placement: a put names a preferred segment (raykv's ``own``: the writing node's) and
  falls back to a random segment with room, or names none (``any``: random);
- with a disk tier (``disk``), an evicted object goes to its segment's node's disk and
  is served from there (``lab.sim.disk``); a put of a key on disk moves nothing;
- a node that leaves: its segment takes no new puts while its drain moves objects off
  it (``close``, ``move``), then its objects, memory and disk, are gone
  (``drop_segment``); a node that joins mounts an empty one (``add_segment``).

Recency is each object's last put, lookup or read (Mooncake orders by lease expiry, which
each access renews: the same order). The clock is passed in (seconds).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from raykv_lab.sim.disk import DiskTier

HIGH_WATERMARK = 0.95
"""Mooncake's default ``eviction_high_watermark_ratio``."""
EVICTION_RATIO = 0.05
"""Mooncake's default ``eviction_ratio``."""
LEASE_S = 5.0
"""Mooncake's default object lease (``default_kv_lease_ttl``, 5000 ms)."""


class L3Store:
    """Segments of ``capacities`` blocks (index: the node); see the module docstring.
    Counters in ``counts``."""

    def __init__(self, capacities: Sequence[int], clock: Callable[[], float],
                 rng: random.Random, high_watermark: float = HIGH_WATERMARK,
                 eviction_ratio: float = EVICTION_RATIO, lease_s: float = LEASE_S,
                 disk: DiskTier | None = None) -> None:
        if not capacities or any(type(c) is not int or c < 0 for c in capacities) \
                or not sum(capacities):
            raise ValueError(f"segment capacities must be blocks >= 0, some > 0, "
                             f"got {list(capacities)!r}")
        if not 0 < high_watermark <= 1 or not 0 < eviction_ratio <= 1 or lease_s < 0:
            raise ValueError("high_watermark and eviction_ratio must be in (0, 1], "
                             "lease_s >= 0")
        self._cap = list(capacities)
        self._used = [0] * len(capacities)
        self._total = sum(capacities)
        self._clock, self._rng, self._disk = clock, rng, disk
        self._closed: set[int] = set()
        self.high_watermark, self.eviction_ratio, self.lease_s = \
            high_watermark, eviction_ratio, lease_s
        self._where: dict[str, int] = {}  # key -> segment, ended puts
        self._pending: dict[str, int] = {}  # key -> segment, puts under way
        self._lru: OrderedDict[str, None] = OrderedDict()  # ended puts, oldest first
        self._lease: dict[str, float] = {}
        self.counts = {"puts": 0, "put_failed": 0, "evicted": 0, "evictions": 0}

    def segment_of(self, key: str) -> int | None:
        """The segment holding ``key`` (a put that ended) in memory, else the node whose
        disk holds it, else None; nothing leased."""
        seg = self._where.get(key)
        if seg is None and self._disk is not None:
            return self._disk.node_of(key)
        return seg

    def in_memory(self, key: str) -> int | None:
        """The segment whose memory holds ``key``, else None."""
        return self._where.get(key)

    def leading(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the store holds, memory or disk; nothing leased
        (raykv's ``locate``)."""
        n = 0
        while n < len(keys) and self.segment_of(keys[n]) is not None:
            n += 1
        return n

    def lookup(self, keys: Sequence[str]) -> list[tuple[int, bool]]:
        """(segment, on disk) of the leading ``keys`` the store holds; those in memory
        leased and made the most recently used (an existence check, then the read),
        those on disk left as they are."""
        out = []
        until = self._clock() + self.lease_s
        for k in keys:
            seg = self._where.get(k)
            if seg is None:
                node = self._disk.node_of(k) if self._disk is not None else None
                if node is None:
                    break
                out.append((node, True))
                continue
            self._lease[k] = until
            self._lru.move_to_end(k)
            out.append((seg, False))
        return out

    def start_put(self, key: str, preferred: int | None) -> int | None:
        """Room for ``key`` on ``preferred`` if it has some, else on a random segment
        with room: the segment, its put under way until ``end_put``. None when the key
        is held or being put already (put-if-absent: no bytes move) or no segment has
        room (the put failed; eviction runs)."""
        if key in self._pending or self.segment_of(key) is not None:
            return None
        seg = preferred if preferred is not None and self._room(preferred) \
            else self._random_room()
        if seg is None:
            self.counts["put_failed"] += 1
            self._evict()
            return None
        self._used[seg] += 1
        self._pending[key] = seg
        self.counts["puts"] += 1
        if sum(self._used) > self.high_watermark * self._total:
            self._evict()
        return seg

    def end_put(self, key: str) -> None:
        """The put of ``key`` ended: its object is readable (and evictable)."""
        seg = self._pending.pop(key, None)
        if seg is not None:
            self._where[key] = seg
            self._lru[key] = None

    def usage(self, seg: int | None = None) -> tuple[int, int]:
        """(capacity, blocks in use) of segment ``seg``, or of the whole store."""
        if seg is None:
            return self._total, sum(self._used)
        return self._cap[seg], self._used[seg]

    def held_on(self, seg: int) -> int:
        """Objects segment ``seg``'s memory holds (ended puts)."""
        return sum(s == seg for s in self._where.values())

    def close(self, seg: int) -> None:
        """Segment ``seg`` takes no new puts (its node is leaving)."""
        self._closed.add(seg)

    def move(self, key: str, src: int, dst: int) -> bool:
        """A drain's move of ``key`` from segment ``src``'s memory to ``dst``'s; False
        (nothing moved) when ``src`` no longer holds it or ``dst`` has no room."""
        if self._where.get(key) != src or not self._room(dst):
            return False
        self._where[key] = dst
        self._used[src] -= 1
        self._used[dst] += 1
        return True

    def drop_segment(self, seg: int) -> dict[str, int]:
        """Segment ``seg``'s node left: its objects in memory, its puts under way and
        its disk's objects are gone; how many of each."""
        gone = [k for k, s in self._where.items() if s == seg]
        for k in gone:
            del self._where[k]
            del self._lru[k]
            self._lease.pop(k, None)
        pending = [k for k, s in self._pending.items() if s == seg]
        for k in pending:
            del self._pending[k]
        self._total -= self._cap[seg]
        self._cap[seg] = self._used[seg] = 0
        self._closed.discard(seg)
        disk = self._disk.drop_node(seg) if self._disk is not None else 0
        return {"memory": len(gone), "pending": len(pending), "disk": disk}

    def add_segment(self, capacity: int, disk_capacity: int = 0) -> int:
        """A node joined: an empty segment of ``capacity`` blocks (and a disk of
        ``disk_capacity``, with a disk tier); its index."""
        if type(capacity) is not int or capacity < 0:
            raise ValueError(f"a segment holds >= 0 blocks, got {capacity!r}")
        self._cap.append(capacity)
        self._used.append(0)
        self._total += capacity
        if self._disk is not None:
            self._disk.add_node(disk_capacity)
        return len(self._cap) - 1

    def stats(self) -> dict[str, int]:
        """Objects held, puts under way, blocks in use, and ``counts``; with a disk
        tier, its own (``disk``)."""
        out: dict = {"objects": len(self._where), "pending": len(self._pending),
                     "used": sum(self._used), "capacity": self._total, **self.counts}
        if self._disk is not None:
            out["disk"] = self._disk.stats()
        return out

    def _room(self, seg: int) -> bool:
        return self._used[seg] < self._cap[seg] and seg not in self._closed

    def _random_room(self) -> int | None:
        room = [i for i in range(len(self._cap)) if self._room(i)]
        return self._rng.choice(room) if room else None

    def _evict(self) -> None:
        """Evict ``eviction_ratio`` of the objects, least recently used first, skipping
        leased ones (at least one object when any can go)."""
        now = self._clock()
        want = max(1, math.ceil(self.eviction_ratio * len(self._where)))
        gone = []
        for k in self._lru:
            if len(gone) >= want:
                break
            if self._lease.get(k, 0.0) <= now:
                gone.append(k)
        for k in gone:
            del self._lru[k]
            self._lease.pop(k, None)
            seg = self._where.pop(k)
            self._used[seg] -= 1
            if self._disk is not None:
                self._disk.offload(seg, k)
        self.counts["evicted"] += len(gone)
        self.counts["evictions"] += 1
