"""What a node actor counts: one count per outcome, read by ``stats()`` and exported as
Ray metrics (tag ``node``) from the same place.

Thread-safe: data calls record from the Ray data threads, the local channel's threads and
the group-query checker threads at once; ``_lock`` guards the counters that ``stats()``
reads (Ray's metric objects are thread-safe themselves).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from ray.util import metrics
from raykv.cache_actors.mooncake_codes import ALREADY_PRESENT
from raykv.controllers.object_batch import ObjectBatch


class NodeMetrics:
    """Counters of one node actor since it started (see ``counters`` and
    ``pool_counters`` for their names), each also a Ray metric."""

    def __init__(self, node_id: str) -> None:
        tags = {"node": node_id[:12]}
        self._objects = metrics.Counter(
            "raykv_objects", "Objects moved or refused, by op, pool and outcome",
            tag_keys=("node", "op", "pool", "outcome"))
        self._bytes = metrics.Counter("raykv_bytes", "Bytes moved, by op and pool",
                                      tag_keys=("node", "op", "pool"))
        self._latency = metrics.Histogram(
            "raykv_call_seconds", "Store call latency in the node actor, by op",
            boundaries=[1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0],
            tag_keys=("node", "op"))
        self._pool_bytes = metrics.Gauge("raykv_pool_bytes", "Bytes of each shared host pool",
                                         tag_keys=("node", "pool"))
        self._group_queries = metrics.Counter(
            "raykv_group_queries", "Group existence queries answered here, by how: "
            "recent / inflight (shared by the ranks of a group), confirmed (from confirmed "
            "pages alone) or checked (own store check)",
            tag_keys=("node", "answer"))
        for m in (self._objects, self._bytes, self._latency, self._pool_bytes,
                  self._group_queries):
            m.set_default_tags(tags)
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._pool_counts: dict[str, Counter[str]] = {}

    def record_move(self, op: str, batch: ObjectBatch, codes: list[int], seconds: float,
                    moved: Callable[[int], bool]) -> None:
        """One ``op`` ("put" / "get") call over ``batch``: per object, ``ok`` if its bytes
        ``moved(code)``, ``present`` if it was ``ALREADY_PRESENT``, else ``error_<code>``."""
        outcomes: Counter[tuple[str, str]] = Counter()
        nbytes: Counter[str] = Counter()
        for code, size, pool in zip(codes, batch.sizes, batch.pools, strict=True):
            if moved(code):
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
            self._counts[f"{op}_bytes"] += sum(nbytes.values())
        for (pool, outcome), n in outcomes.items():
            self._objects.inc(n, tags={"op": op, "pool": pool, "outcome": outcome})
        for pool, n in nbytes.items():
            if n:
                self._bytes.inc(n, tags={"op": op, "pool": pool})
        self._latency.observe(seconds, tags={"op": op})

    def record_exists(self, seconds: float) -> None:
        """One ``exists`` call (counted as ``exists_calls``)."""
        with self._lock:
            self._counts["exists_calls"] += 1
        self._latency.observe(seconds, tags={"op": "exists"})

    def record_group_check(self, seconds: float) -> None:
        """One store call of the group queries (exported only: ``GroupQueries.stats``
        counts them for ``stats()``)."""
        self._latency.observe(seconds, tags={"op": "group_exists"})

    def record_group_query(self, how: str) -> None:
        """One group query answered ``how`` (exported only, as above)."""
        self._group_queries.inc(tags={"answer": how})

    def pool_size(self, name: str, nbytes: int) -> None:
        """Pool ``name`` now holds ``nbytes`` (0: gone)."""
        self._pool_bytes.set(nbytes, tags={"pool": name})

    def counters(self) -> dict[str, int]:
        """Per node: ``put_objects`` / ``get_objects`` (moved), ``put_present``,
        ``put_bytes`` / ``get_bytes``, ``<op>_error_<code>``, ``exists_calls``."""
        with self._lock:
            return dict(self._counts)

    def pool_counters(self, pool: str) -> dict[str, int]:
        """Per pool: ``put_ok``, ``put_present``, ``get_ok``, ``<op>_error_<code>``."""
        with self._lock:
            return dict(self._pool_counts.get(pool, {}))
