"""The warm-up of a node's new L2 pools: the hottest pages of a deployment's rank read
from L3 into the L2 pool an engine of it opens on a node where that pool is new, so the
engine's first requests hit L2 instead of crossing the network.

When. The node actor tells ``L2Warmup.opened`` of every L2 pool an engine opened
(``l2_open``). A pool it has not seen before (its name is new: the node joined, the
deployment or rank is new on it, or the node actor restarted and its L2 is empty) is
warmed on the warm-up's own thread, never on the engine's call, one pool at a time in
the order opened. Off when ``warm_bytes`` is 0.

What. The deployment's current copy (``fetch_deployment``: the rank's key suffix and
its ranks' nodes); then the peers' touch journals for the deployment's key prefix
(``ask(prefix, limit, prefer, wait_s)``: ``ask_peers``, node actors of other nodes, the
deployment's nodes first, bounded calls); from their entries of this rank's objects,
the runs ``warm_plan.warm_runs`` chooses within ``warm_bytes`` (the hottest); read run
after run, the coldest of them first so that the hottest are the most recently used
pages and the last L2 evicts, in batches of ``BATCH`` pages, by ``L2Pools.warm``: only
into free pages, no page of L2 evicted (the engine's own pages always win: its
reservations may evict warmed pages later, as any page).

Stops: every chosen page read (``done``), ``warm_s`` seconds after the open spent
(``time``), the pool without a free page or gone from the node (``no room``), nothing
to warm (``nothing``: no peer touched a page of this rank lately), a deployment the
controller does not know (``unknown deployment``: no rank of it registered yet), the
node shutting down (``stopped``), the controller or the peers not answering, a rank
outside its deployment (``error``). A run whose
page L3 no longer holds (or an engine is writing) ends there: its later pages are no
use without it; the next run follows.

Visible: ``stats`` (per warm-up its state, pages and bytes read, chosen, why it
stopped; totals), ``raykv status``, the metric of warmed bytes
(``NodeMetrics.record_warmed``).

Threads: ``opened`` on a ``pools`` thread of the node actor; warm-ups on
``raykv-warm``; ``stats`` on any; ``_lock`` guards ``_warmups`` and the totals.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import ray
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.node.touch_journal import Touch
from raykv.cache_actors.node.warm_plan import (
    MAX_PEERS,
    answer_limit,
    peers_to_ask,
    rank_objects,
    warm_runs,
)
from raykv.controllers.contract import PoolName
from raykv.controllers.deployments import Deployment
from raykv.controllers.naming import CONTROLLER_NAME
from raykv.controllers.node_records import Warmup, WarmupStats
from raykv.controllers.ownership import Owner, OwnerClaim

if TYPE_CHECKING:
    from raykv.cache_actors.node.l2_pools import L2Pools

log = logging.getLogger(__name__)

BATCH = 64
"""Pages one warm-up store call reads at most."""
PEER_WAIT_S = 5.0
"""Longest a warm-up waits for the controller's node list and then for its peers'
journals (all asked at once), in seconds (less when its time budget ends sooner)."""
KEPT = 64
"""Warm-ups ``stats`` keeps (the latest); an older pool opened again is warmed again,
into its free pages only."""

Ask = Callable[[str, int, Sequence[str], float], list[dict[str, Touch]]]
"""``ask(prefix, limit, prefer, wait_s)``: the peers' journal answers (``touches``) of
keys starting with ``prefix``, at most ``limit`` entries each, the nodes ``prefer``
asked first; within ``wait_s`` seconds (``ask_peers``)."""


class L2Warmup:
    """Warms the new L2 pools of one node (module docstring). ``l2``: the node's L2
    pools; ``ask``: the peers' journals (``Ask``); ``fetch_deployment(id)``: the
    controller's copy; ``record(owner, nbytes)``: warmed bytes, for the metrics;
    ``warm_bytes``: the most bytes one warm-up reads (0: off); ``warm_s``: the most
    seconds it runs from the open; ``clock``: ``time.monotonic``."""

    def __init__(self, l2: L2Pools, ask: Ask, fetch_deployment: Callable[[str], Deployment],
                 record: Callable[[Owner, int], None], warm_bytes: int, warm_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._l2, self._ask, self._fetch, self._record = l2, ask, fetch_deployment, record
        self.warm_bytes, self.warm_s, self._clock = warm_bytes, warm_s, clock
        self._lock = threading.Lock()
        self._warmups: OrderedDict[str, dict] = OrderedDict()  # pool -> its warm-up
        self._totals = {"pages": 0, "bytes": 0}
        self._stop = threading.Event()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="raykv-warm")

    def opened(self, handle: PoolHandle | None, rank: tuple[int, int],
               claim: OwnerClaim) -> PoolHandle | None:
        """An engine of ``claim``'s deployment opened the L2 pool ``handle`` of ``rank``
        (None: the node had no room): warm it later if it is new here. Never waits;
        returns ``handle``."""
        if handle is None or self.warm_bytes <= 0 or self._stop.is_set():
            return handle
        with self._lock:
            if handle.name in self._warmups:
                return handle
            self._warmups[handle.name] = {
                "deployment": claim.deployment_id, "rank": list(rank), "state": "queued",
                "pages": 0, "bytes": 0, "chosen": 0, "stopped": None, "seconds": 0.0}
            while len(self._warmups) > KEPT:
                self._warmups.popitem(last=False)
        try:
            self._thread.submit(self._run, handle, tuple(rank), claim,
                                self._clock() + self.warm_s)
        except RuntimeError:  # closed meanwhile
            self._set(handle.name, state="done", stopped="stopped")
        return handle

    def stats(self) -> WarmupStats:
        """``warm_bytes`` and ``warm_s`` (the budgets), the ``pages`` and ``bytes`` read
        by every warm-up, ``running`` (warm-ups queued or running) and ``warmups``: per
        pool (the latest ``KEPT``) its ``deployment``, ``rank``, ``state`` (queued,
        running, done), ``pages`` and ``bytes`` read, ``chosen`` (pages chosen to read),
        ``stopped`` (why it ended: module docstring) and ``seconds``."""
        with self._lock:
            warmups = {n: Warmup(**w) for n, w in self._warmups.items()}
            return WarmupStats(warm_bytes=self.warm_bytes, warm_s=self.warm_s, **self._totals,
                               running=sum(w.state != "done" for w in warmups.values()),
                               warmups=warmups)

    def close(self) -> None:
        """Stop: the warm-up under way ends after its current batch, none starts."""
        self._stop.set()
        self._thread.shutdown(wait=False, cancel_futures=True)

    # ---------------------------------------------------------------- helpers
    def _run(self, handle: PoolHandle, rank: tuple[int, int], claim: OwnerClaim,
             deadline: float) -> None:
        """One warm-up, to its end (never raises: what stopped it is in ``stats``)."""
        start = self._clock()
        self._set(handle.name, state="running")
        try:
            stopped = self._warm(handle, rank, claim, deadline)
        except Exception as e:  # the controller or the peers: no warm-up, nothing broken
            log.warning("L2 warm-up of %s failed: %s", handle.name, e)
            stopped = f"error: {type(e).__name__}"
        self._set(handle.name, state="done", stopped=stopped, seconds=self._clock() - start)

    def _warm(self, handle: PoolHandle, rank: tuple[int, int], claim: OwnerClaim,
              deadline: float) -> str:
        size = handle.layout.object_bytes
        try:
            dep = self._fetch(claim.deployment_id)
        except ValueError:  # not registered yet: no rank of it made a group query
            return "unknown deployment"
        (suffix,) = dep.key_scheme(*dep.check_rank(rank)).suffixes(PoolName.KV, "vllm", ["kv"])
        pages = min(self.warm_bytes // size, handle.layout.num_pages)
        if self._clock() >= deadline:
            return "time"
        wait = min(PEER_WAIT_S, deadline - self._clock())
        limit = answer_limit(pages, dep.tp_size * dep.pp_size)
        views = self._ask(claim.key_prefix, limit, list(dep.ranks.values()), wait)
        runs = warm_runs(views, rank_objects(claim.key_prefix, suffix, size), pages, limit)
        self._set(handle.name, chosen=sum(map(len, runs)))
        for run in reversed(runs):  # the hottest read last: the last of them L2 evicts
            for i in range(0, len(run), BATCH):
                if self._stop.is_set():
                    return "stopped"
                if self._clock() >= deadline:
                    return "time"
                part = run[i:i + BATCH]
                made, held, free = self._l2.warm(handle.name, part, claim, deadline)
                self._add(handle.name, claim.owner, made, made * size)
                if held < len(part) and not free:
                    return "no room"
                if held < len(part):
                    break  # L3 lost a page of this run (or an engine writes it)
        return "done" if runs else "nothing"

    def _set(self, pool: str, **fields) -> None:
        with self._lock:
            if pool in self._warmups:
                self._warmups[pool].update(fields)

    def _add(self, pool: str, owner: Owner, pages: int, nbytes: int) -> None:
        with self._lock:
            if pool in self._warmups:
                self._warmups[pool]["pages"] += pages
                self._warmups[pool]["bytes"] += nbytes
            self._totals["pages"] += pages
            self._totals["bytes"] += nbytes
        if nbytes:
            self._record(owner, nbytes)


def ask_peers(prefix: str, limit: int, prefer: Sequence[str],
              wait_s: float) -> list[dict[str, Touch]]:
    """``Ask`` over Ray from a node actor (its node and namespace: Ray's runtime
    context): the controller's node list, then the ``touches`` of up to ``MAX_PEERS``
    other node actors (``prefer``'s nodes first), all asked at once; answers not in
    within ``wait_s`` (in all) and failed calls are left out. Runs on a thread (waits on
    futures, never on an event loop)."""
    context = ray.get_runtime_context()
    node_id, namespace = context.get_node_id(), context.namespace
    end = time.monotonic() + wait_s
    controller = ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    nodes: dict[str, str] = controller.nodes.remote().future().result(wait_s)
    asked = []
    for node in peers_to_ask(nodes, prefer, node_id, MAX_PEERS):
        try:
            peer = ray.get_actor(nodes[node], namespace=namespace)
        except ValueError:  # gone since the list was made
            continue
        asked.append(peer.touches.remote(None, prefix, limit).future())
    views = []
    for future in asked:
        try:
            views.append(future.result(max(0.0, end - time.monotonic())))
        except Exception as e:  # a peer too slow or gone: its journal is left out
            log.debug("a peer's touches did not come: %s", e)
    return views
