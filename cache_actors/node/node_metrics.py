"""What a node actor counts: one count per outcome, read by ``stats()`` and exported as
Ray metrics (tag ``node``). The only place a node actor counts: data calls, group
queries (``GroupQueries`` tells it how each was answered and what its store calls took)
and merged transfers (``TransferMerger`` tells it each store call's batches).

Per tenant and deployment. Per tier, L3 (the store: objects got = hits, failed gets =
misses, keys an existence check found or not, bytes moved) and L2 (the pools' bytes;
the L2 cache's page events, ``raykv_l2_pages``), the Ray metrics carry the ``tenant``
and ``deployment`` of the pool's owner (of the caller, for an existence check;
``(none)`` for none), beside ``pool``.
The L2 cache's counts (``L2Pools.counters``) are read by the exporter thread and what
grew since its last look exported (``watch_l2``): its data ops count nothing here.
Their label sets are bounded for the actor's life, whatever pools come and go: at
most ``MAX_POOL_LABELS`` pool names, ``MAX_DEPLOYMENT_LABELS`` deployments and
``MAX_TENANT_LABELS`` tenants get a label of their own, in the order they are first
seen; the rest are counted together under ``(other)`` (``LabelBound``). ``stats()``
keeps per-pool counts only of live pools.

Data calls only count, under ``_lock``: the Ray metric objects are updated from the
counts by an exporter thread every ``export_s`` seconds (``export``), not on the data
path, where a Ray metric update cost ~10 us each, several per call (measured here: a
32-object put's bookkeeping went from ~70 us to ~20 us). Ray ships metrics every few
seconds anyway, so the delay is not visible to a metrics scrape; ``stats()`` reads the
counts directly and is always current.

Thread-safe: data calls record from the Ray data threads, the local channel's threads,
the group query threads and callers holding the locks of ``GroupQueries`` and
``TransferMerger`` (this lock is taken last, never the other way round); the exporter
thread drains what they recorded.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from ray.util import metrics
from raykv.controllers.node_records import GroupQueryStats, MergedCallStats
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.ownership import Owner
from raykv.controllers.result_codes import ALREADY_PRESENT, EXISTS

EXPORT_S = 1.0
"""Seconds between two updates of the Ray metrics from the counts."""
GROUP_QUERY_COUNTS = ("recent", "inflight", "confirmed", "looked_up", "store_calls",
                      "deployment_fetches")
MERGED_CALL_COUNTS = ("calls", "batches", "largest")
L2_OBJECT_COUNTS = ("filled", "fill_failed", "warmed", "warm_failed", "l3_put_submitted",
                    "l3_put", "l3_put_retried", "l3_put_failed")
"""The node's L2 counts exported (``raykv_l2_objects``); each only grows."""
DRAIN_OUTCOMES = ("moved", "dropped", "left", "failed")
"""What became of the objects a drain chose or found (``raykv_drain_objects``/``_bytes``)."""
L2Counters = Callable[[], tuple[Mapping[str, int], Mapping[str, tuple[Owner, Mapping[str, int]]]]]
"""``L2Pools.counters``: the node's L2 counts, and per L2 pool its owner and page counts."""
MAX_POOL_LABELS = 64
MAX_DEPLOYMENT_LABELS = 32
MAX_TENANT_LABELS = 32
OTHER = "(other)"
"""The label of every value past a tag's bound (no tenant name can be it)."""
NONE = "(none)"
"""The ``tenant`` / ``deployment`` label of a pool or caller without one."""
Tags = tuple[str, str, str]
"""``(pool, tenant, deployment)`` labels."""
POOL_TAGS = ("pool", "tenant", "deployment")


class LabelBound:
    """The label of a tag's values: the value itself for the first ``limit`` distinct
    values seen, ``OTHER`` for any later one, ``NONE`` for None. Not thread-safe (its
    owner's lock)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str | None) -> str:
        if value is None:
            return NONE
        if value not in self._seen:
            if len(self._seen) >= self._limit:
                return OTHER
            self._seen.add(value)
        return value


def moved(op: str, code: int) -> bool:
    """Whether ``code`` of an ``op`` ("put" / "get") object means its bytes moved: a put
    stored it (0), a get read bytes (> 0)."""
    return code == 0 if op == "put" else code > 0


class NodeMetrics:
    """Counters of one node actor since it started (see ``counters`` and
    ``pool_counters`` for their names), each also a Ray metric, exported every
    ``export_s`` seconds by a thread of its own until ``close``."""

    def __init__(self, node_id: str, export_s: float = EXPORT_S) -> None:
        tags = {"node": node_id[:12]}
        owner_keys = ("tenant", "deployment")
        self._objects = metrics.Counter(
            "raykv_objects", "Objects moved or refused (L3 hits and misses of gets), by op, "
            "pool, outcome and the pool owner's tenant and deployment",
            tag_keys=("node", "op", "pool", "outcome", *owner_keys))
        self._bytes = metrics.Counter(
            "raykv_bytes", "Bytes moved, by op, pool and the pool owner's tenant and "
            "deployment", tag_keys=("node", "op", "pool", *owner_keys))
        self._lookups = metrics.Counter(
            "raykv_exists_keys", "Keys an existence check asked the store (L3) about, "
            "found (hit) or not (miss), by the caller's tenant and deployment",
            tag_keys=("node", "answer", *owner_keys))
        self._latency = metrics.Histogram(
            "raykv_call_seconds", "Store call latency in the node actor, by op",
            boundaries=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0],
            tag_keys=("node", "op"))
        self._pool_bytes = metrics.Gauge(
            "raykv_pool_bytes", "Bytes of the shared host pools (L2), by pool and the "
            "owner's tenant and deployment", tag_keys=("node", "pool", *owner_keys))
        self._group_queries = metrics.Counter(
            "raykv_group_queries", "Group existence queries answered here, by how: "
            "recent / inflight (shared by the ranks of a group), confirmed (from confirmed "
            "pages alone) or looked_up (existence checks of its own)",
            tag_keys=("node", "answer"))
        self._l2_pages = metrics.Counter(
            "raykv_l2_pages", "L2 cache page events (hits, misses, written, evicted, full, "
            "flushed, aborted), by the pool owner's tenant and deployment",
            tag_keys=("node", "event", *owner_keys))
        self._l2_objects = metrics.Counter(
            "raykv_l2_objects", "L2 cache objects read from L3 (filled, fill_failed; by the "
            "warm-up: warmed, warm_failed) and "
            "put to L3 behind the writer (l3_put_submitted, l3_put, l3_put_retried, "
            "l3_put_failed)", tag_keys=("node", "event"))
        self._drain_objects = metrics.Counter(
            "raykv_drain_objects", "Objects of drains of this node's segment: moved to "
            "other nodes, dropped (no room), left (deadline), failed; l2_flushed: L2 pages "
            "put to L3 by a drain", tag_keys=("node", "outcome"))
        self._drain_bytes = metrics.Counter(
            "raykv_drain_bytes", "Bytes of drains of this node's segment: moved, dropped, "
            "left, failed", tag_keys=("node", "outcome"))
        self._warmed = metrics.Counter(
            "raykv_l2_warmed_bytes", "Bytes the warm-up of new L2 pools read from L3, by the "
            "pool owner's tenant and deployment", tag_keys=("node", *owner_keys))
        for m in (self._objects, self._bytes, self._lookups, self._latency,
                  self._pool_bytes, self._group_queries, self._l2_pages, self._l2_objects,
                  self._drain_objects, self._drain_bytes, self._warmed):
            m.set_default_tags(tags)
        self._l2: L2Counters | None = None
        self._watched: list[Callable[[], None]] = []
        self._l2_seen: tuple[Mapping[str, int], dict[str, Mapping[str, int]]] = ({}, {})
        self._export_lock = threading.Lock()  # one export at a time (the L2 counts seen)
        self._pool_labels = LabelBound(MAX_POOL_LABELS)
        self._deployment_labels = LabelBound(MAX_DEPLOYMENT_LABELS)
        self._tenant_labels = LabelBound(MAX_TENANT_LABELS)
        self._pools: dict[str, tuple[Tags, int]] = {}  # live pool -> its labels, bytes
        self._gauges: Counter[Tags] = Counter()  # labels -> bytes of live pools
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._pool_counts: dict[str, Counter[str]] = {}
        self._group = dict.fromkeys(GROUP_QUERY_COUNTS, 0) | {"store_seconds": 0.0}
        self._merged = dict.fromkeys(MERGED_CALL_COUNTS, 0)
        # Not yet exported: (metric, tags) -> increment, and (op, seconds) latencies.
        self._pending: Counter[tuple[metrics.Counter, tuple[tuple[str, str], ...]]] = Counter()
        self._latencies: list[tuple[str, float]] = []
        self._stop = threading.Event()
        threading.Thread(target=self._export_loop, args=(export_s,),
                         name="raykv-metrics", daemon=True).start()

    def record_move(self, op: str, batch: ObjectBatch, codes: list[int],
                    seconds: float) -> None:
        """One ``op`` ("put" / "get") call over ``batch`` that took ``seconds``: per
        object, ``ok`` if its bytes moved (``moved``), ``present`` if it was
        ``ALREADY_PRESENT``, else ``error_<code>``."""
        ok = [moved(op, c) for c in codes]
        pools = batch.pools
        outcomes: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[str] = Counter()
        if all(ok) and pools and pools.count(pools[0]) == len(pools):  # the common case
            outcomes[(pools[0], "ok")] = len(pools)
            nbytes[pools[0]] = sum(batch.sizes)
        else:
            for good, code, size, pool in zip(ok, codes, batch.sizes, pools, strict=True):
                if good:
                    outcome = "ok"
                    nbytes[pool] += size
                elif code == ALREADY_PRESENT:
                    outcome = "present"
                else:
                    outcome = f"error_{code}"
                outcomes[(pool, outcome)] += 1
        with self._lock:
            for (pool, outcome), n in outcomes.items():
                self._pool_counts.setdefault(pool, Counter())[f"{op}_{outcome}"] += n
                name = {"ok": f"{op}_objects", "present": f"{op}_present"}.get(
                    outcome, f"{op}_{outcome}")
                self._counts[name] += n
                p, tenant, dep = self._tags_of(pool)
                self._pending[(self._objects, (("op", op), ("pool", p), ("outcome", outcome),
                                               ("tenant", tenant), ("deployment", dep)))] += n
            self._counts[f"{op}_bytes"] += sum(nbytes.values())
            for pool, n in nbytes.items():
                if n:
                    p, tenant, dep = self._tags_of(pool)
                    self._pending[(self._bytes, (("op", op), ("pool", p), ("tenant", tenant),
                                                 ("deployment", dep)))] += n
            self._latencies.append((op, seconds))

    def _tags_of(self, pool: str) -> Tags:
        """With ``_lock`` held: the labels of pool ``pool`` (one no longer here: its
        name's label and no owner)."""
        known = self._pools.get(pool)
        return known[0] if known is not None else (self._pool_labels(pool), NONE, NONE)

    def _owner_tags(self, owner: Owner | None) -> tuple[str, str]:
        """With ``_lock`` held: the ``tenant`` and ``deployment`` labels of ``owner``."""
        if owner is None:
            return NONE, NONE
        return self._tenant_labels(owner.tenant), self._deployment_labels(owner.deployment_id)

    def record_exists(self, seconds: float, codes: Sequence[int] = (),
                      owner: Owner | None = None) -> None:
        """One ``exists`` call of ``owner`` (None: a caller without one) that took
        ``seconds`` and answered ``codes`` (1: found; counted as ``exists_calls``)."""
        hits = codes.count(EXISTS)
        misses = len(codes) - hits
        with self._lock:
            self._counts["exists_calls"] += 1
            self._latencies.append(("exists", seconds))
            tenant, dep = self._owner_tags(owner)
            for answer, n in (("hit", hits), ("miss", misses)):
                if n:
                    self._pending[(self._lookups, (("answer", answer), ("tenant", tenant),
                                                   ("deployment", dep)))] += n

    def record_group_store_call(self, seconds: float) -> None:
        """One store call (an existence check) of the group queries that took ``seconds``."""
        with self._lock:
            self._group["store_calls"] += 1
            self._group["store_seconds"] += seconds
            self._latencies.append(("group_exists", seconds))

    def record_deployment_fetch(self) -> None:
        """One deployment copy fetched from the controller (``DeploymentCopies``)."""
        with self._lock:
            self._group["deployment_fetches"] += 1

    def record_group_query(self, how: str) -> None:
        """One group query answered ``how``: ``"recent"``, ``"inflight"``,
        ``"confirmed"`` or ``"looked_up"`` (see ``GroupQueries``)."""
        with self._lock:
            self._group[how] += 1
            self._pending[(self._group_queries, (("answer", how),))] += 1

    def record_warmed(self, owner: Owner | None, nbytes: int) -> None:
        """A warm-up read ``nbytes`` from L3 into an L2 pool of ``owner``
        (``cache_actors.node.l2_warmup``; ``stats()`` shows the warm-up's own counts)."""
        with self._lock:
            tenant, dep = self._owner_tags(owner)
            self._pending[(self._warmed, (("tenant", tenant), ("deployment", dep)))] += nbytes

    def record_merged_call(self, batches: int) -> None:
        """One put/get store call that carried ``batches`` ranks' batches."""
        with self._lock:
            m = self._merged
            m["calls"] += 1
            m["batches"] += batches
            m["largest"] = max(m["largest"], batches)

    def record_drain(self, report: Mapping[str, object]) -> None:
        """A drain ended with ``report`` (``SegmentDrain.run``'s): its ``objects_`` and
        ``bytes_`` ``moved`` / ``dropped`` / ``left`` / ``failed`` and ``l2_pages``
        counted (``drain_<outcome>_objects`` / ``_bytes``, ``drain_l2_flushed_objects``)."""
        counts = {(f"objects_{o}", o): self._drain_objects for o in DRAIN_OUTCOMES} | {
            (f"bytes_{o}", o): self._drain_bytes for o in DRAIN_OUTCOMES} | {
            ("l2_pages", "l2_flushed"): self._drain_objects}
        with self._lock:
            for (field, outcome), metric in counts.items():
                if n := int(report.get(field, 0)):
                    unit = "bytes" if metric is self._drain_bytes else "objects"
                    self._counts[f"drain_{outcome}_{unit}"] += n
                    self._pending[(metric, (("outcome", outcome),))] += n

    def pool_size(self, name: str, nbytes: int, owner: Owner | None = None) -> None:
        """Pool ``name`` of ``owner`` now holds ``nbytes`` (0: gone, and its per-pool
        counts are dropped); its gauge is set at once (rare) and again by every
        ``export`` (Ray's export drops a gauge not set for two of its report intervals,
        ~20 s). Pools past the label bounds share their gauge, which holds their sum."""
        with self._lock:
            old = self._pools.pop(name, None)
            changed = []
            if old is not None:
                self._gauges[old[0]] -= old[1]
                changed.append(old[0])
            if nbytes:
                tags = (self._pool_labels(name), *self._owner_tags(owner))
                self._pools[name] = (tags, nbytes)
                self._gauges[tags] += nbytes
                changed.append(tags)
            else:
                self._pool_counts.pop(name, None)
            for tags in dict.fromkeys(changed):
                value = self._gauges[tags]
                if not value:
                    del self._gauges[tags]
                self._pool_bytes.set(value, tags=dict(zip(POOL_TAGS, tags, strict=True)))

    def watch_l2(self, counters: L2Counters) -> None:
        """Export the node's L2 counts too: each ``export`` reads ``counters()`` and adds
        what grew since the last one (a pool new since: all of its counts) to
        ``raykv_l2_pages`` and ``raykv_l2_objects``."""
        self._l2 = counters

    def _l2_grown(self) -> None:
        """With ``_export_lock`` held: what the L2 counts grew by since the last look,
        into the pending increments."""
        if self._l2 is None:
            return
        node, pools = self._l2()
        node_seen, pools_seen = self._l2_seen
        with self._lock:
            for event in L2_OBJECT_COUNTS:
                if (n := node.get(event, 0) - node_seen.get(event, 0)) > 0:
                    self._pending[(self._l2_objects, (("event", event),))] += n
            for name, (owner, counts) in pools.items():
                before = pools_seen.get(name, {})
                tenant, dep = self._owner_tags(owner)
                for event, total in counts.items():
                    if (n := total - before.get(event, 0)) > 0:
                        self._pending[(self._l2_pages, (("event", event), ("tenant", tenant),
                                                        ("deployment", dep)))] += n
        self._l2_seen = ({k: node.get(k, 0) for k in L2_OBJECT_COUNTS},
                         {name: dict(counts) for name, (_, counts) in pools.items()})

    def watch(self, export: Callable[[], None]) -> None:
        """Call ``export`` (another part's metrics, e.g. ``TierMetrics.export``) with
        every ``export``."""
        self._watched.append(export)

    def export(self) -> None:
        """Hand what was recorded since the last call (and what the L2 counts grew by) to
        the Ray metrics (the exporter thread's job; callable from any thread)."""
        with self._export_lock:
            self._l2_grown()
            for export in self._watched:
                export()
            with self._lock:
                pending, self._pending = self._pending, Counter()
                latencies, self._latencies = self._latencies, []
                gauges = dict(self._gauges)
            for (metric, tags), n in pending.items():
                metric.inc(n, tags=dict(tags))
            for op, seconds in latencies:
                self._latency.observe(seconds, tags={"op": op})
            for tags, value in gauges.items():  # Ray's export drops a gauge not set lately
                self._pool_bytes.set(value, tags=dict(zip(POOL_TAGS, tags, strict=True)))

    def _export_loop(self, export_s: float) -> None:
        while not self._stop.wait(export_s):
            self.export()

    def close(self) -> None:
        """Export what is left and stop the exporter thread."""
        self._stop.set()
        self.export()

    def counters(self) -> dict[str, int]:
        """Per node: ``put_objects`` / ``get_objects`` (moved), ``put_present``,
        ``put_bytes`` / ``get_bytes``, ``<op>_error_<code>``, ``exists_calls``, the drains'
        ``drain_<outcome>_objects`` / ``_bytes`` (``record_drain``)."""
        with self._lock:
            return dict(self._counts)

    def pool_counters(self, pool: str) -> dict[str, int]:
        """Per pool: ``put_ok``, ``put_present``, ``get_ok``, ``<op>_error_<code>``."""
        with self._lock:
            return dict(self._pool_counts.get(pool, {}))

    def group_queries(self) -> GroupQueryStats:
        """Group queries answered here: from a recent answer (another rank's:
        ``recent``), by joining an existence check in flight (``inflight``), from confirmations
        alone (``confirmed``), with existence checks of their own (``looked_up``); the store calls
        of their checks (``store_calls``) and the seconds they took
        (``store_seconds``); the deployment copies fetched from the controller for them
        (``deployment_fetches``: one per deployment and version, at its first query here
        unless a rank's registration had it copied before)."""
        with self._lock:
            return GroupQueryStats(**self._group)

    def merged_calls(self) -> MergedCallStats:
        """Put/get store calls made (``calls``), the ranks' batches they carried
        (``batches``) and the most batches in one call (``largest``)."""
        with self._lock:
            return MergedCallStats(**self._merged)
