"""Sealed puts and gets through a Mooncake client: each object is the page followed by
its seal (``controllers.object_seal``), written and read in one object with Mooncake's
multi-buffer calls, so the page's bytes land where the caller named and the seal in a
registered scratch area of this node actor.

A get serves the page only if its seal verifies; every other object it read (damaged,
truncated, foreign, another size) answers ``SEAL_MISMATCH``, is logged, counted by
reason and removed from the store, so a later put writes it again instead of finding it
present. So is an object Mooncake cannot read from its disk tier (``FILE_OPEN_FAIL``,
``FILE_READ_FAIL``: its bucket file gone or cut), which Mooncake keeps reporting
existing; as Mooncake fails every object of a batch read from such a bucket, each
object of a batch that answered so is read again alone first. After each get the
master is asked where the objects it served live (one ``batch_get_replica_desc`` per
call, of those only: a miss logs an error in Mooncake's client) and they are counted by
tier: ``l3_memory`` (a segment), ``l3_disk`` (a node's disk tier only), ``unknown``
(the lookup failed or the object went meanwhile); a link probe's objects
(``cache_actors.node.load_costs.PROBE_PREFIX``) are read, verified and neither looked up nor
counted.

Any data thread may call ``put_from`` and ``get_into`` at once: each call takes one
region of the scratch area for its seals (``REGIONS`` of them; a call waits while all
are taken) and splits into pieces of at most ``REGION_SLOTS`` objects.
"""

from __future__ import annotations

import ctypes
import logging
import queue
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
from raykv.cache_actors.node.load_costs import PROBE_PREFIX
from raykv.controllers.node_records import TierStats
from raykv.controllers.object_seal import SEAL_BYTES, check, seal
from raykv.controllers.result_codes import (
    CLIENT_ERROR,
    FILE_OPEN_FAIL,
    FILE_READ_FAIL,
    SEAL_MISMATCH,
)

log = logging.getLogger(__name__)

REGIONS = 16
REGION_SLOTS = 1024
UNREADABLE = frozenset({FILE_OPEN_FAIL, FILE_READ_FAIL})
"""Mooncake's get codes for an object it could not read from a disk tier."""


def _buffers(pages: list[int], seals: list[int]) -> list[list[int]]:
    """Mooncake's per-object buffer lists: each page's, then its seal's."""
    return [[p, s] for p, s in zip(pages, seals, strict=True)]


def _view(ptr: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


class SealedObjects:
    """Sealed ``batch_put_from`` / ``batch_get_into`` on ``store`` (a set-up
    ``MooncakeDistributedStore``) under ``seal_key`` (32 bytes)."""

    def __init__(self, store, seal_key: bytes) -> None:
        self._store = store
        self._key = seal_key
        self._scratch = np.zeros(REGIONS * REGION_SLOTS * SEAL_BYTES, dtype=np.uint8)
        self._base = self._scratch.ctypes.data
        rc = store.register_buffer(self._base, self._scratch.nbytes)
        if rc != 0:
            raise RuntimeError(f"Mooncake register_buffer of the seal area failed with {rc}")
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        for region in range(REGIONS):
            self._free.put(region)
        self._lock = threading.Lock()
        self.served: Counter[str] = Counter()
        """Objects a get served, by tier (``l3_memory``, ``l3_disk``, ``unknown``)."""
        self.served_bytes: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        """Objects a get read but did not serve, by the seal's failure (``format``,
        ``length``, ``mac``), or ``unreadable`` (Mooncake could not read it from disk,
        alone)."""

    def _pieces(self, n: int) -> Iterator[tuple[int, int, int]]:
        """(start, end, region base address) for each piece of a call of ``n``
        objects; the region is taken for the piece and given back after it."""
        for start in range(0, n, REGION_SLOTS):
            region = self._free.get()
            try:
                yield (start, min(n, start + REGION_SLOTS),
                       self._base + region * REGION_SLOTS * SEAL_BYTES)
            finally:
                self._free.put(region)

    def put_from(self, keys: list[str], ptrs: list[int], sizes: list[int],
                 config=None) -> list[int]:
        """Put each page with its seal: Mooncake's code per object."""
        codes: list[int] = []
        for start, end, base in self._pieces(len(keys)):
            seals = [base + j * SEAL_BYTES for j in range(end - start)]
            for j, i in enumerate(range(start, end)):
                _view(seals[j], SEAL_BYTES)[:] = seal(self._key, keys[i],
                                                      _view(ptrs[i], sizes[i]))
            args = (keys[start:end], _buffers(ptrs[start:end], seals),
                    _buffers(sizes[start:end], [SEAL_BYTES] * len(seals)))
            try:
                got = (self._store.batch_put_from_multi_buffers(*args) if config is None
                       else self._store.batch_put_from_multi_buffers(*args, config))
                codes += [int(rc) for rc in got]
            except Exception:
                log.exception("batch_put_from_multi_buffers raised")
                codes += [CLIENT_ERROR] * (end - start)
        return codes

    def get_into(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """Read each object: the page's size when its seal verified, ``SEAL_MISMATCH``
        when it did not (removed from the store), else Mooncake's negative code (an
        ``UNREADABLE`` one only for an object that failed alone: removed too)."""
        codes: list[int] = []
        bad: list[str] = []
        for start, end, base in self._pieces(len(keys)):
            seals = [base + j * SEAL_BYTES for j in range(end - start)]
            try:
                got = [int(n) for n in self._store.batch_get_into_multi_buffers(
                    keys[start:end], _buffers(ptrs[start:end], seals),
                    _buffers(sizes[start:end], [SEAL_BYTES] * len(seals)))]
            except Exception:
                log.exception("batch_get_into_multi_buffers raised")
                got = [CLIENT_ERROR] * (end - start)
            for j, n in enumerate(got):
                i = start + j
                if n < 0:
                    codes.append(n)
                    if n in UNREADABLE and len(keys) == 1:
                        self._refuse(bad, keys[i], "unreadable")
                    continue
                why = "length" if n != sizes[i] + SEAL_BYTES else check(
                    self._key, keys[i], _view(ptrs[i], sizes[i]),
                    bytes(_view(seals[j], SEAL_BYTES)))
                if why is None:
                    codes.append(sizes[i])
                    continue
                codes.append(SEAL_MISMATCH)
                self._refuse(bad, keys[i], why)
        served = [i for i, n in enumerate(codes) if n >= 0
                  and not keys[i].startswith(PROBE_PREFIX)]  # link probes: no page
        if served:
            for i, tier in zip(served, self._tiers([keys[i] for i in served]), strict=True):
                with self._lock:
                    self.served[tier] += 1
                    self.served_bytes[tier] += sizes[i]
        if bad:
            self._remove(bad)
        if len(keys) > 1:  # Mooncake failed each object read from that bucket with it
            for i, n in enumerate(codes):
                if n in UNREADABLE:
                    codes[i] = self.get_into(keys[i:i + 1], ptrs[i:i + 1], sizes[i:i + 1])[0]
        return codes

    def _refuse(self, bad: list[str], key: str, why: str) -> None:
        """Count and log ``key`` as not served for ``why``; add it to ``bad``."""
        bad.append(key)
        with self._lock:
            self.refused[why] += 1
        log.warning("object %s was not served (%s): removed from the store", key, why)

    def _tiers(self, keys: list[str]) -> list[str]:
        """Per key: ``l3_memory`` if a complete replica is in a segment, else
        ``l3_disk`` if one is on a disk tier, else ``unknown``."""
        from mooncake.store import ReplicaStatus

        try:
            found = self._store.batch_get_replica_desc(keys)
        except Exception:
            log.exception("batch_get_replica_desc raised")
            return ["unknown"] * len(keys)
        out = []
        for k in keys:
            replicas = [r for r in found.get(k, ()) if r.status == ReplicaStatus.COMPLETE]
            out.append("l3_memory" if any(r.is_memory_replica() for r in replicas) else
                       "l3_disk" if replicas else "unknown")
        return out

    def _remove(self, keys: list[str]) -> None:
        try:
            codes = list(self._store.batch_remove(keys, True))
        except Exception:
            log.exception("batch_remove of objects that failed their seal raised")
            return
        for k, rc in zip(keys, codes, strict=True):
            if rc != 0:
                log.warning("could not remove %s, which failed its seal: code %s", k, rc)

    def stats(self) -> TierStats:
        """``served`` and ``served_bytes`` by tier, ``refused`` by reason (no disk slot:
        ``MooncakeBackend.tier_stats`` adds it)."""
        with self._lock:
            return TierStats(served=dict(self.served), served_bytes=dict(self.served_bytes),
                             refused=dict(self.refused))

    def close(self) -> None:
        """Unregister the seal area (the client closes next)."""
        self._store.unregister_buffer(self._base)
