"""A node's load costs: what a load of a hit is estimated to take, per link (pure: no
Ray, no Mooncake; any clock).

A node actor reads a hit's objects from the store: each object from one of the
store's segments (``host:port``, its own or a peer's, over that link) or, with a disk
tier, from a segment's disk. ``LoadCosts`` keeps, per source segment, a ``Rate`` of
seconds per byte and a fixed cost per call (seeded by a probe of that link, moved by
every get the node serves), one ``Rate`` for disk-served gets (``l3_disk``), one of
every get together (the fallback for a link never measured), and the node's queue: a
new store call waits for the calls in flight, each taking the moving-average call time
or, once it has run longer, as long as it has run so far (a call that hangs, on a
stopped peer or a stalled store, raises every estimate of the node for as long as it
hangs, before it ends or fails; a node actor merges whatever queued into its next call,
so the calls in flight are the queue: ``cache_actors.node.transfer_merger``).
Bounded: at most ``max_segments`` links, the least recently used forgotten first, and
``forget`` drops a link gone from the cluster.

``KeyPlaces`` remembers where recently located objects live (bounded, each entry for
``ttl_s``), so a measured get and a repeated hit need no second locate.

``load_runs`` turns a hit's pages and where each lives into ``PoolTransferResult``'s
``load_runs``: consecutive pages from one source are one run ``(tier, pages,
seconds)``; ``seconds`` = that source's estimate for the run's bytes, and the first
run carries the queue's wait too (one load is one batch: it waits once).

Threads: every method of ``LoadCosts`` and ``KeyPlaces`` is thread-safe (one lock
each; ``Rate`` has its own).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from raykv.controllers.load_guard import Rate
from raykv.controllers.node_records import LinkView, LoadStats, RateView
from raykv.controllers.pool_layout import MiB

MEMORY, DISK = "l3", "l3_disk"
"""Tier names of ``load_runs`` (``controllers.load_guard``): a segment's memory, its disk."""
MAX_SEGMENTS = 256
PROBE_PREFIX = "raykv-link-probe/"
"""Keys of link probe objects (``cache_actors.node.link_probe``): no page's (a
deployment's keys end in a rank scope and buffer suffix, a tenant's begin ``t1.``);
gets of them are not counted as pages served."""
CALL_WEIGHT = 0.2  # of the newest store call in the moving-average call time


@dataclass
class Link:
    """One source segment's estimate: ``rate`` (seconds per byte and a fixed cost per
    call), when a probe last measured it (``probed_at``, the clock's seconds; None:
    never) and when this node last read from it or found its objects (``used_at``;
    None: only known as a peer)."""

    rate: Rate
    probed_at: float | None = None
    used_at: float | None = None


def fit_probe(small: int, small_s: float, large: int, large_s: float) -> tuple[float, float]:
    """``(seconds per byte, fixed seconds per call)`` from a probe's two timed reads of
    ``small`` and ``large`` bytes (``small < large``): the line through both points,
    neither part below 0."""
    if not 0 < small < large:
        raise ValueError(f"probe sizes {small}, {large}: expected 0 < small < large")
    per_byte = max(0.0, large_s - small_s) / (large - small)
    if per_byte == 0.0:  # the large read was no slower: all of it per byte, a bound
        per_byte = large_s / large
    return per_byte, max(0.0, small_s - small * per_byte)


class LoadCosts:
    """See the module docstring. ``clock``: seconds (``time.monotonic``)."""

    def __init__(self, max_segments: int = MAX_SEGMENTS, clock=time.monotonic) -> None:
        if max_segments < 1:
            raise ValueError(f"max_segments {max_segments!r}: expected at least 1")
        self._max = max_segments
        self._clock = clock
        self._lock = threading.Lock()
        self._links: OrderedDict[str, Link] = OrderedDict()
        self.disk = Rate()
        self.overall = Rate()
        self.call = Rate(weight=CALL_WEIGHT)  # seconds per store call
        self._inflight: dict[int, float] = {}  # call -> when it started (the clock's)
        self._calls = itertools.count()

    # ----------------------------------------------------------- the queue
    def call_started(self) -> int:
        """A store call of this node began (any op): its handle for ``call_ended``."""
        with self._lock:
            call = next(self._calls)
            self._inflight[call] = self._clock()
        return call

    def call_ended(self, call: int, seconds: float) -> None:
        """The store call ``call`` (``call_started``'s handle) ended after ``seconds``."""
        with self._lock:
            self._inflight.pop(call, None)
        self.call.observe(1, seconds)

    def queue_wait(self) -> float:
        """Expected seconds before a new store call starts: per call in flight, the
        moving-average call time (0 before any call ended) or, if longer, its age."""
        typical = self.call.per_unit() or 0.0
        now = self._clock()
        with self._lock:
            started = list(self._inflight.values())
        return sum(max(typical, now - t) for t in started)

    # ----------------------------------------------------------- the links
    def _link(self, segment: str, used: bool = True) -> Link:
        """Under the lock: ``segment``'s link, made (and the least recently used
        dropped) if new; ``used``: noted as used now."""
        link = self._links.get(segment)
        if link is None:
            link = self._links[segment] = Link(Rate())
            while len(self._links) > self._max:
                self._links.popitem(last=False)
        if used:
            self._links.move_to_end(segment)
            link.used_at = self._clock()
        return link

    def seen(self, segments: Iterable[str]) -> list[str]:
        """Note ``segments`` as sources in use; the ones new to this record."""
        new = []
        with self._lock:
            for s in segments:
                if s not in self._links:
                    new.append(s)
                self._link(s)
        return new

    def known(self, segments: Iterable[str]) -> None:
        """Note ``segments`` as peers (the cluster's node list), not used yet."""
        with self._lock:
            for s in segments:
                self._link(s, used=False)

    def probed(self, segment: str, per_byte: float, fixed_s: float) -> None:
        """A probe of ``segment``'s link measured ``per_byte`` and ``fixed_s``: the
        link's estimate starts there if no get measured it yet, else the probe counts as
        one more measurement (a call of 1 MB)."""
        with self._lock:
            link = self._link(segment, used=False)
            link.probed_at = self._clock()
            if link.rate.samples == 0:
                link.rate = Rate(prior_per_unit=per_byte, fixed_s=fixed_s)
                return
        link.rate.observe(1 << 20, fixed_s + per_byte * (1 << 20))

    def observed(self, by_segment: Mapping[str, int], disk_bytes: int,
                 seconds: float, failed: bool = False) -> None:
        """One get read ``by_segment`` bytes from each segment's memory and
        ``disk_bytes`` from disk in ``seconds``: each source is given the share of the
        time its bytes were of the call's (the call's sources were read together).
        ``failed``: those bytes never arrived (a transfer or RPC failure after
        ``seconds``; see ``observe``)."""
        total = sum(by_segment.values()) + disk_bytes
        if total <= 0:
            return
        with self._lock:
            rates = [(self._link(s).rate, n) for s, n in by_segment.items() if n > 0]
        for rate, n in [(self.overall, total), (self.disk, disk_bytes), *rates]:
            if n > 0:
                observe(rate, n, seconds * n / total, failed)

    def forget(self, segments: Iterable[str]) -> None:
        """Drop the links of ``segments`` (gone from the cluster)."""
        with self._lock:
            for s in segments:
                self._links.pop(s, None)

    def segments(self) -> list[str]:
        """Every link's segment, least recently used first."""
        with self._lock:
            return list(self._links)

    def probe_due(self, every_s: float, limit: int) -> list[str]:
        """Up to ``limit`` used segments whose link a probe never measured, or measured
        more than ``every_s`` ago and was used since: the never-probed first, then the
        oldest-probed. A peer never used is left to ``cold``."""
        now = self._clock()
        with self._lock:
            due = [(link.probed_at is not None, link.probed_at or 0.0, s)
                   for s, link in self._links.items() if link.used_at is not None and (
                       link.probed_at is None or (now - link.probed_at >= every_s
                                                  and link.used_at >= link.probed_at))]
        return [s for _, _, s in sorted(due)[:limit]]

    def cold(self, limit: int) -> list[str]:
        """Up to ``limit`` peers never used and never probed (a cold start's)."""
        with self._lock:
            return [s for s, link in self._links.items()
                    if link.used_at is None and link.probed_at is None][:limit]

    def seconds(self, source: str | None, nbytes: int) -> float | None:
        """Estimated seconds to read ``nbytes`` from ``source`` (a segment, or None:
        disk), from that source's rate, else every get's together; None if neither is
        known."""
        if source is None:
            rate = self.disk
        else:
            with self._lock:
                link = self._links.get(source)
            rate = link.rate if link is not None else self.overall
        estimate = rate.seconds(nbytes)
        return self.overall.seconds(nbytes) if estimate is None else estimate

    def view(self, located_keys: int) -> LoadStats:
        """What ``stats`` shows: per segment its ``mb_per_s`` (None: unknown),
        ``fixed_ms``, ``samples`` and ``probe_age_s`` (None: never probed); the same
        (less the probe) for ``l3_disk`` and ``overall``; ``queue_wait_s``; and
        ``located_keys``, the caller's ``KeyPlaces`` entries."""
        now = self._clock()
        with self._lock:
            links = list(self._links.items())
        return LoadStats(
            links={s: _rate_view(link.rate, LinkView, probe_age_s=None if link.probed_at
                                 is None else round(now - link.probed_at, 1))
                   for s, link in links},
            l3_disk=_rate_view(self.disk), overall=_rate_view(self.overall),
            queue_wait_s=self.queue_wait(), located_keys=located_keys)


def observe(rate: Rate, nbytes: int, seconds: float, failed: bool = False) -> None:
    """``rate.observe(nbytes, seconds)``; with ``failed`` (the bytes never arrived: a
    transfer or RPC failure after ``seconds``) the time is a bound, not a rate: it
    counts only where it is slower than ``rate``'s estimate, and never while there is
    none (a failure that took long slows the source; one that came at once never makes
    it look fast)."""
    if not failed or seconds > (rate.seconds(nbytes) or float("inf")):
        rate.observe(nbytes, seconds)


def tier_estimates(costs: LoadCosts, own: str | None) -> dict[str, float]:
    """What a router credits a node with (``controllers.residency.ResidencyChanges``'s
    ``load_s``): seconds this node would take now to load one MiB from its own segment
    (``segment``) and from the store's other segments (``l3``: the median of its other
    links' estimates), each with the queue's wait; a tier without an estimate is left
    out."""
    wait = costs.queue_wait()
    out: dict[str, float] = {}
    if own is not None and (mine := costs.seconds(own, MiB)) is not None:
        out["segment"] = mine + wait
    peers = sorted(s for segment in costs.segments() if segment != own
                   and (s := costs.seconds(segment, MiB)) is not None)
    if peers:
        out[MEMORY] = peers[len(peers) // 2] + wait
    return out


def _rate_view(rate: Rate, view: type[RateView] = RateView, **more: float | None) -> RateView:
    """``rate`` as a ``view`` (a ``RateView``, or a ``LinkView`` with ``more``)."""
    per_byte = rate.per_unit()
    return view(mb_per_s=None if per_byte is None else
                (round(1e-6 / per_byte, 3) if per_byte > 0 else float("inf")),
                fixed_ms=round(rate.fixed_s * 1e3, 3), samples=rate.samples, **more)


class KeyPlaces:
    """Where recently located objects live: key -> its source (a segment, or None:
    disk only), each for ``ttl_s``; at most ``max_keys``, the oldest dropped first."""

    def __init__(self, max_keys: int = 1 << 16, ttl_s: float = 30.0,
                 clock=time.monotonic) -> None:
        self._max, self._ttl, self._clock = max_keys, ttl_s, clock
        self._lock = threading.Lock()
        self._places: OrderedDict[str, tuple[str | None, float]] = OrderedDict()

    def put(self, places: Mapping[str, str | None]) -> None:
        """Remember each key's source."""
        now = self._clock()
        with self._lock:
            for k, s in places.items():
                self._places.pop(k, None)
                self._places[k] = (s, now)
            while len(self._places) > self._max:
                self._places.popitem(last=False)

    def get(self, keys: Sequence[str]) -> tuple[dict[str, str | None], list[str]]:
        """``(known, unknown)``: the sources of the keys located within ``ttl_s``, and
        the other keys."""
        oldest = self._clock() - self._ttl
        known, unknown = {}, []
        with self._lock:
            for k in keys:
                hit = self._places.get(k)
                if hit is not None and hit[1] >= oldest:
                    known[k] = hit[0]
                else:
                    unknown.append(k)
        return known, unknown

    def __len__(self) -> int:
        with self._lock:
            return len(self._places)


def source_of(segments: Sequence[str], own: str | None) -> str | None:
    """The source a read of an object with in-memory replicas on ``segments`` uses:
    ``own`` if it holds one, else the first; None (disk) if there is none."""
    if own is not None and own in segments:
        return own
    return segments[0] if segments else None


def load_runs(sources: Sequence[str | None], page_bytes: int, costs: LoadCosts
              ) -> list[tuple[str, int, float | None]]:
    """A hit's ``load_runs``: ``sources[i]`` is where page ``i`` is read from (a
    segment, None: disk), ``page_bytes`` the bytes a rank loads per page; consecutive
    pages of one source are one run, named ``l3`` (a segment) or ``l3_disk``; its
    seconds as the module docstring says (None: no estimate)."""
    runs: list[tuple[str, int, float | None]] = []
    wait = costs.queue_wait()
    at = 0
    while at < len(sources):
        end = at
        while end < len(sources) and sources[end] == sources[at]:
            end += 1
        estimate = costs.seconds(sources[at], (end - at) * page_bytes)
        if estimate is not None and not runs:
            estimate += wait
        runs.append((MEMORY if sources[at] is not None else DISK, end - at, estimate))
        at = end
    return runs


def whole_run(pages: int, page_bytes: int, costs: LoadCosts
              ) -> list[tuple[str, int, float | None]]:
    """A hit of ``pages`` whose objects cannot be located (a dummy client): one ``l3``
    run, estimated from every get together, plus the queue's wait."""
    estimate = costs.overall.seconds(pages * page_bytes)
    return [(MEMORY, pages, None if estimate is None else estimate + costs.queue_wait())]
