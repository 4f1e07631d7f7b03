"""How a node actor estimates loads: it measures its own gets and probes its links, and
fills a group answer's ``load_runs`` (``PoolTransferResult``) from what it measured.

``LoadEstimates`` stands between the node's ``TransferMerger`` and its store backend
(``put`` / ``get``): each store call is counted in flight while it runs and timed (the
queue: ``cache_actors.node.load_costs.LoadCosts.queue_wait``), and each get's served keys,
bytes and seconds, and apart those whose bytes failed to arrive (a transfer or RPC
failure: a bound, ``load_costs.observe``; a miss is not measured), are queued (at most
``MAX_PENDING``, the oldest dropped) for the background thread, which attributes the
bytes to the segments the objects were read from: the sources of keys located within
``KeyPlaces``' TTL are known; the others (at most ``SAMPLE_KEYS`` of the get, evenly
spread, their bytes scaled to the get's) cost one locate (``batch_get_replica_desc``)
per get, on the background thread, never on the get's path. An object with no in-memory
replica was served from disk (``l3_disk``).

A group answer with a hit (``answer`` wraps the reply) gets its ``load_runs``: the
first object of each hit page (the first family's first buffer) is located, one locate
per answer for the keys ``KeyPlaces`` does not know, on one of ``LOCATE_THREADS``
threads of its own (never on an I/O thread or the actor's event loop, never queued
behind transfers); each page's source is the node's own
segment if it holds a replica, else the first that does (``source_of``); the bytes of a
page are the most any rank of the group loads per page of KV and the queried pools
(``Deployment.page_bytes``). A miss and an answer already estimated (ranks share
answers: the first rank's estimate is every rank's, so all of an engine's ranks weigh
the same runs) cost nothing. Where the node cannot locate (a dummy client) the hit is
one ``l3`` run estimated from every get together (``whole_run``).

Probes (``cache_actors.node.link_probe``), on the background thread, when ``start`` was
called and the node can locate: its own probe objects are put at start and again
whenever a round finds them gone; a round probes at most ``PROBE_LINKS`` segments the
node used (read from, or found a hit's objects on: never probed first, then those
probed longest ago and used since, at most once per ``PROBE_EVERY_S`` each) and, once
per ``PROBE_EVERY_S`` (at start, and every ``COLD_RETRY_S`` while no peer is known or
a node of the list has not told its segment yet),
up to ``COLD_LINKS`` peers of the cluster's node
list it never used nor probed (a cold start's estimates), within ``PROBE_ROUND_S``.
Rounds run at start, when a segment new to the node is seen (a locate of a hit or a get
found it) and every ``PROBE_EVERY_S``. So 128 nodes never probe all to all: a link is
probed again only while used, per node at most ``PROBE_LINKS + COLD_LINKS`` links a
round, each ~0.53 MB read, and one locate per round. A segment whose probe objects are
gone is forgotten (its node left) until seen again.

Threads: ``put`` / ``get`` on data threads; ``answer``'s wrapper where the answer is
known (group query thread, channel I/O thread, event loop) and its locate on a locate thread;
the background thread does the rest. State: ``LoadCosts`` and ``KeyPlaces`` (locked
themselves), the queue and the waiting answers under ``_lock``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from raykv.cache_actors.node.group_queries import Done, GroupQueries
from raykv.cache_actors.node.link_probe import LinkProbe
from raykv.cache_actors.node.load_costs import (
    KeyPlaces,
    LoadCosts,
    load_runs,
    observe,
    source_of,
    whole_run,
)
from raykv.cache_actors.node.store_backend import StoreBackend
from raykv.controllers.contract import PoolName, PoolTransferResult
from raykv.controllers.deployments import Deployment, PoolQuery
from raykv.controllers.families import group_families
from raykv.controllers.node_records import LoadStats
from raykv.controllers.result_codes import RPC_FAIL, TRANSFER_FAIL

log = logging.getLogger(__name__)

MAX_PENDING = 256
SAMPLE_KEYS = 256
PROBE_EVERY_S = 60.0
PROBE_LINKS = 8
PROBE_ROUND_S = 5.0
COLD_LINKS = 8
COLD_RETRY_S = 5.0
LOCATE_THREADS = 2
FAILED_MOVES = (TRANSFER_FAIL, RPC_FAIL)
"""Get codes of objects whose bytes failed to arrive (not misses): measured as a bound."""


def page_bytes(dep: Deployment, queries: Sequence[PoolQuery]) -> int:
    """The most bytes any rank of ``dep`` loads per page of KV and ``queries``' pools
    (0 where the deployment recorded none)."""
    roles = {PoolName.KV.value} | {q.role.value for q in queries}
    return max((sum(sum(per.get(r, ())) for r in roles) for per in dep.page_bytes.values()),
               default=0)


class LoadEstimates:
    """See the module docstring: over ``backend``."""

    def __init__(self, backend: StoreBackend) -> None:
        self._backend = backend
        self._executor = ThreadPoolExecutor(LOCATE_THREADS,
                                            thread_name_prefix="raykv-load-locate")
        self.costs = LoadCosts()
        self.places = KeyPlaces()
        self._lock = threading.Lock()
        self._pending: deque[tuple[list[str], list[int], float, bool]] = deque(maxlen=MAX_PENDING)
        self._waiting: dict[int, tuple[PoolTransferResult, list[Done]]] = {}
        self._parts: dict[tuple, tuple[str, str]] = {}  # single dict ops: atomic
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------- store calls
    def _timed(self, call: Callable[[list[str], list[int], list[int]], list[int]],
               keys: list[str], ptrs: list[int], sizes: list[int]
               ) -> tuple[list[int], float]:
        handle = self.costs.call_started()
        t = time.perf_counter()
        try:
            codes = call(keys, ptrs, sizes)
        finally:
            took = time.perf_counter() - t
            self.costs.call_ended(handle, took)
        return codes, took

    def put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """The backend's ``put``, counted in the queue."""
        return self._timed(self._backend.put, keys, ptrs, sizes)[0]

    def get(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[int]:
        """The backend's ``get``, counted in the queue and measured: its served objects
        and, as a bound, those whose bytes failed to arrive (``FAILED_MOVES``)."""
        codes, took = self._timed(self._backend.get, keys, ptrs, sizes)
        served = [i for i, n in enumerate(codes) if n >= 0]
        failed = [i for i, n in enumerate(codes) if n in FAILED_MOVES]
        for picked, nbytes, bound in ((served, codes, False), (failed, sizes, True)):
            if picked:
                self._pending.append(([keys[i] for i in picked],
                                      [nbytes[i] for i in picked], took, bound))
                self._wake.set()
        return codes

    def _measure(self, keys: list[str], sizes: list[int], seconds: float,
                 failed: bool) -> None:
        """Background: fold one get in (see the module docstring)."""
        total = sum(sizes)
        if not self._backend.can_locate:
            observe(self.costs.overall, total, seconds, failed)
            return
        step = -(-len(keys) // SAMPLE_KEYS)
        sample, nbytes = keys[::step], sizes[::step]
        sources = self._sources(sample)
        if sources is None:
            observe(self.costs.overall, total, seconds, failed)
            return
        scale = total / max(1, sum(nbytes))
        by_segment: dict[str, int] = {}
        disk = 0
        for source, n in zip(sources, nbytes, strict=True):
            if source is None:
                disk += n
            else:
                by_segment[source] = by_segment.get(source, 0) + n
        self.costs.observed({s: round(n * scale) for s, n in by_segment.items()},
                            round(disk * scale), seconds, failed)

    def _sources(self, keys: list[str]) -> list[str | None] | None:
        """Each key's source (``KeyPlaces``, else one locate of the others; new
        segments wake the probe); None if the locate failed."""
        known, unknown = self.places.get(keys)
        if unknown:
            found = self._backend.locate(unknown)
            if found is None:
                return None
            own = self._backend.own_segment
            located = {k: source_of(list(s), own) for k, s in zip(unknown, found, strict=True)}
            self.places.put(located)
            known |= located
            if self.costs.seen({s for s in located.values() if s is not None}):
                self._wake.set()
        return [known[k] for k in keys]

    # ------------------------------------------------------- group answers
    def submit(self, groups: GroupQueries, dep: Deployment, keys: Sequence[str],
               queries: Sequence[PoolQuery], rank: Sequence[int], reply: Done,
               engine: str) -> None:
        """``groups.submit`` of a group query, its reply wrapped by ``answer``."""
        groups.submit(dep, keys, queries, tuple(rank), self.answer(reply, dep, keys, queries),
                      engine)

    def answer(self, reply: Done, dep: Deployment, keys: Sequence[str],
               queries: Sequence[PoolQuery]) -> Done:
        """``reply`` for a group query of ``dep`` for page ``keys`` and pools
        ``queries``, called once the answer has its ``load_runs`` (see the module
        docstring); an error or a miss goes through at once."""
        def done(result: PoolTransferResult | None, error: BaseException | None) -> None:
            if error is not None or result is None or not result.kv_hit_pages \
                    or result.load_runs:
                reply(result, error)
                return
            with self._lock:
                waiting = self._waiting.get(id(result))
                if waiting is not None:  # another rank's reply is estimating it
                    waiting[1].append(reply)
                    return
                self._waiting[id(result)] = (result, [reply])
            names = None
            try:  # a locate to make: on a locate thread
                if self._backend.can_locate:
                    names = self._names(dep, keys, queries, result.kv_hit_pages)
                    if self.places.get(names)[1]:
                        self._executor.submit(self._estimate, result, dep, queries, names)
                        return
            except Exception:  # closed, or a bug: estimated here (or replied without)
                log.exception("a group answer's estimate could not be handed over")
            self._estimate(result, dep, queries, names)
        return done

    def _names(self, dep: Deployment, keys: Sequence[str], queries: Sequence[PoolQuery],
               pages: int) -> list[str]:
        """The first object of each of the first ``pages`` pages of ``keys`` (the key's
        parts kept per deployment version and pools: at most 1,024, then made anew)."""
        at = (dep.deployment_id, dep.version, tuple(queries))
        parts = self._parts.get(at)
        if parts is None:
            families = group_families(dep, queries)
            parts = (families.prefix, families.families[0].suffixes[0])
            if len(self._parts) >= 1024:
                self._parts.clear()
            self._parts[at] = parts
        prefix, suffix = parts
        return [prefix + h + suffix for h in keys[:pages]]

    def _estimate(self, result: PoolTransferResult, dep: Deployment,
                  queries: Sequence[PoolQuery], names: list[str] | None) -> None:
        """Fill ``result.load_runs`` (``names``: the hit pages' first objects, None: not
        to be located), then reply to every caller waiting on it (without runs if
        estimating failed: the answer itself stands)."""
        try:
            nbytes, pages = page_bytes(dep, queries), result.kv_hit_pages
            sources = None if names is None else self._sources(names)
            result.load_runs = whole_run(pages, nbytes, self.costs) if sources is None \
                else load_runs(sources, nbytes, self.costs)
        except Exception:
            log.exception("estimating a group answer's loads failed")
        with self._lock:
            _, replies = self._waiting.pop(id(result))
        for reply in replies:
            reply(result, None)

    # ------------------------------------------------------- background
    def start(self, peers: Callable[[], tuple[list[str], bool]] | None = None) -> None:
        """Start the background thread (measurements; probes where the node can
        locate); ``peers()``: the segments of the cluster's other nodes and whether
        every listed node told its own (on that thread, every ``PROBE_EVERY_S``, or
        ``COLD_RETRY_S`` while one has not; None: none but those this node reads)."""
        self._thread = threading.Thread(target=self._background, args=(peers,),
                                        name="raykv-load-estimates", daemon=True)
        self._thread.start()

    def _background(self, peers: Callable[[], tuple[list[str], bool]] | None) -> None:
        probe = None
        if self._backend.can_locate:  # with no segment of its own it still reads peers'
            try:
                probe = LinkProbe(self._backend)
                if self._backend.own_segment:
                    self.costs.seen([self._backend.own_segment])
            except Exception:
                log.exception("the link probe could not start: links are measured by "
                              "gets alone")
        published = False
        next_round = next_cold = time.monotonic()
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_round - time.monotonic()))
            self._wake.clear()
            while self._pending:
                try:
                    self._measure(*self._pending.popleft())
                except Exception:
                    log.exception("measuring a get failed")
            if probe is None:
                next_round = time.monotonic() + PROBE_EVERY_S
                continue
            try:
                published = published or probe.publish()
                due = self.costs.probe_due(PROBE_EVERY_S, PROBE_LINKS)
                if time.monotonic() >= next_cold:  # peers never used: a few an interval
                    try:
                        found, told = ([], True) if peers is None else peers()
                        self.costs.known(found)
                    except Exception as e:  # the controller away: look again soon
                        found, told = [], False
                        log.warning("the cluster's node list did not come: %s", e)
                    # no peer known yet, or a listed peer not told yet (the cluster
                    # starting, a node joining): look again soon
                    soon = peers is not None and not (found and told)
                    next_cold = time.monotonic() + (COLD_RETRY_S if soon else PROBE_EVERY_S)
                    due += self.costs.cold(COLD_LINKS)
                if due:
                    measured, absent = probe.measure(due, time.monotonic() + PROBE_ROUND_S)
                    for segment, (per_byte, fixed_s) in measured.items():
                        self.costs.probed(segment, per_byte, fixed_s)
                    if self._backend.own_segment in absent:
                        published = False  # evicted or removed: put again next round
                    self.costs.forget(s for s in absent if s != self._backend.own_segment)
            except Exception:
                log.exception("a probe round failed")
            if self.costs.probe_due(PROBE_EVERY_S, 1):
                next_round = time.monotonic() + 1.0  # more due, or a failure: soon again
            else:
                next_round = min(next_cold, time.monotonic() + PROBE_EVERY_S)

    def stats(self) -> LoadStats:
        """``LoadCosts.view`` with ``located_keys`` (``KeyPlaces`` entries)."""
        return self.costs.view(len(self.places))

    def close(self) -> None:
        """Stop the background thread: it ends after its current round, waited for at
        most ``PROBE_ROUND_S`` (the store client closes next)."""
        self._stop.set()
        self._wake.set()
        self._executor.shutdown(wait=False)
        if self._thread is not None:
            self._thread.join(PROBE_ROUND_S)
