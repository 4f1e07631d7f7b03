"""What ``raykv status --watch`` shows per node (pure: no Ray, no rich): the node actor's
counters in one status snapshot and what changed since the one before.

A snapshot is ``clusters.deploy.status``'s answer: ``nodes`` maps a node id to its node
actor's ``stats()`` (a ``NodeStats``; ``StatsFailed`` where they failed). A node actor
counts what reaches it: objects read from L3 (the store) into its L2 pools
(``get_objects``, its L3 hits), objects asked for that the store did not hold
(``get_error_-704``, misses), other failed reads (errors), and the bytes moved each way.
Pages an engine finds in its own L2 pool never reach the node actor, so no L2 hit is
counted here.
"""

from __future__ import annotations

from dataclasses import dataclass

from raykv.controllers.node_records import NodeStats, StatsFailed
from raykv.controllers.result_codes import OBJECT_NOT_FOUND

GB = 1e9
"""Bytes per GB in the rates (as the benchmarks')."""
MISS = f"get_error_{OBJECT_NOT_FOUND}"


@dataclass(frozen=True)
class NodeRow:
    """One node's line. Counts are since its node actor started; ``*_per_s`` and
    ``*_gbps`` are over the interval between two snapshots, None where there is no
    interval to judge (the first snapshot, a node new since the last one, a node actor
    that restarted and so counts from 0 again, or stats that failed). Bytes: ``put``
    left the node's pools for L3, ``get`` arrived in them from L3. ``pool_budget`` 0:
    no limit. ``error``: why the node's stats failed (every other figure then 0/None).
    """

    node: str
    error: str | None = None
    l3_hits: int = 0
    misses: int = 0
    errors: int = 0
    hits_per_s: float | None = None
    misses_per_s: float | None = None
    put_gbps: float | None = None
    get_gbps: float | None = None
    pools: int = 0
    pool_used: int = 0
    pool_budget: int = 0

    @property
    def hit_rate(self) -> float | None:
        """L3 hits over hits and misses since the node actor started; None before any."""
        asked = self.l3_hits + self.misses
        return self.l3_hits / asked if asked else None


def _counts(stats: NodeStats) -> dict[str, int]:
    """The counters ``node_rows`` reads from one node's ``stats()``."""
    c = stats.counters
    get_errors = sum(v for k, v in c.items() if k.startswith("get_error_"))
    return {"hits": c.get("get_objects", 0), "misses": c.get(MISS, 0),
            "errors": get_errors - c.get(MISS, 0), "put_bytes": c.get("put_bytes", 0),
            "get_bytes": c.get("get_bytes", 0)}


def node_rows(before: dict | None, after: dict, dt: float) -> list[NodeRow]:
    """One row per node of snapshot ``after``, in its order, with the rates since
    snapshot ``before`` taken ``dt`` seconds earlier (``before`` None: the first
    snapshot, no rates). ``ValueError`` if ``dt`` <= 0 with a ``before``."""
    if before is not None and dt <= 0:
        raise ValueError(f"dt must be > 0 seconds, got {dt}")
    previous = before["nodes"] if before is not None else {}
    rows = []
    for node_id, stats in after["nodes"].items():
        if isinstance(stats, StatsFailed):
            rows.append(NodeRow(node_id[:8], error=stats.error))
            continue
        now = _counts(stats)
        last = previous.get(node_id)
        then = _counts(last) if isinstance(last, NodeStats) else None
        if then is not None and any(now[k] < then[k] for k in now):
            then = None  # the node actor restarted: its counts began again at 0
        rows.append(NodeRow(
            node_id[:8], l3_hits=now["hits"], misses=now["misses"], errors=now["errors"],
            hits_per_s=None if then is None else (now["hits"] - then["hits"]) / dt,
            misses_per_s=None if then is None else (now["misses"] - then["misses"]) / dt,
            put_gbps=None if then is None else (now["put_bytes"] - then["put_bytes"]) / dt / GB,
            get_gbps=None if then is None else (now["get_bytes"] - then["get_bytes"]) / dt / GB,
            pools=len(stats.pools), pool_used=stats.host_pool_used,
            pool_budget=stats.host_pool_bytes))
    return rows
