"""A node's probe objects: a timed read of a peer's probe measures that link before any
load from it (``cache_actors.node.load_estimates`` decides when).

Each node actor that can locate objects (an embedded Mooncake client) with a segment of
its own puts two probe objects, ``SMALL`` and ``LARGE`` bytes, under keys named by that
segment (``probe_key``), placed on it like its puts; one that gives the store no memory
puts none and still probes its peers. A probe of a segment reads both
(each twice, small then large, the faster read of each kept: the first read of a new
peer pays its connection's setup, and a read that a busy node's scheduler held is not
taken for the link) into a registered buffer of this actor, timed, and fits a fixed cost
per call and seconds per byte through the two points
(``cache_actors.node.load_costs.fit_probe``). ``LARGE`` is sized so a 10 Mbit/s link reads it
in about 0.2 s (both objects twice: ~0.45 s); a faster link in less.

Probe keys begin ``raykv-link-probe/`` and hold no page: a deployment's keys begin with
its prefix and end in a rank scope and buffer suffix (``controllers.keys``), a tenant's
begin ``t1.``; with seals (a disk tier) a probe object carries its seal like any object
(``cache_actors.node.sealed_objects``). One locate (``batch_get_replica_desc``) per
probe round finds which probes exist and on which segment each really lives; a probe
read is attributed to that segment.

Threads: one thread (the load estimates' background thread) calls every method.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import numpy as np
from raykv.cache_actors.node.load_costs import PROBE_PREFIX, fit_probe, source_of
from raykv.cache_actors.node.store_backend import StoreBackend

log = logging.getLogger(__name__)

SMALL = 4096
LARGE = 256 * 1024


def probe_key(segment: str, size: int) -> str:
    """The key of ``segment``'s probe object of ``size`` bytes."""
    return f"{PROBE_PREFIX}{segment}/{size}"


class LinkProbe:
    """The probe of one node actor over ``backend`` (``can_locate`` and
    ``own_segment`` set); its buffer stays registered until the client closes."""

    def __init__(self, backend: StoreBackend) -> None:
        self._backend = backend
        self._buf = np.frombuffer(os.urandom(LARGE), dtype=np.uint8).copy()
        self._ptr = self._buf.ctypes.data
        backend.register(self._ptr, LARGE)

    def publish(self) -> bool:
        """Put this node's probe objects if absent: whether both are in the store (True
        for a node with no segment of its own: it has none to put)."""
        own = self._backend.own_segment
        if not own:
            return True
        codes = self._backend.put([probe_key(own, SMALL), probe_key(own, LARGE)],
                                  [self._ptr, self._ptr], [SMALL, LARGE])
        return all(c >= 0 for c in codes)

    def _timed_read(self, key: str, size: int) -> float | None:
        t = time.perf_counter()
        n = self._backend.get([key], [self._ptr], [size])[0]
        return time.perf_counter() - t if n == size else None

    def measure(self, segments: Sequence[str], deadline: float
                ) -> tuple[dict[str, tuple[float, float]], list[str]]:
        """Probe ``segments`` until ``deadline`` (``time.monotonic()``): ``(measured,
        absent)``, ``measured`` per segment the probe really read from ``(seconds per
        byte, fixed seconds)``, ``absent`` the segments whose probe objects the store
        does not hold (gone from the cluster, or not published yet) or could not read."""
        keys = [probe_key(s, n) for s in segments for n in (SMALL, LARGE)]
        found = self._backend.locate(keys)
        if found is None:
            return {}, []
        measured, absent = {}, []
        own = self._backend.own_segment
        for i, segment in enumerate(segments):
            small, large = found[2 * i], found[2 * i + 1]
            if not small or not large:
                absent.append(segment)
                continue
            if time.monotonic() >= deadline:
                break
            times = [self._timed_read(probe_key(segment, n), n)
                     for _ in range(2) for n in (SMALL, LARGE)]
            small_s = min((t for t in times[0::2] if t is not None), default=None)
            large_s = min((t for t in times[1::2] if t is not None), default=None)
            if small_s is None or large_s is None:
                log.debug("probe of %s failed", segment)
                absent.append(segment)  # gone meanwhile, or unreadable: as absent
                continue
            measured[source_of(large, own)] = fit_probe(SMALL, small_s, LARGE, large_s)
        return measured, absent
