"""A vLLM connector side's counters (``connector_stats.ConnectorStats``) and loads as Ray
metrics: ``raykv_connector``, by ``counter`` (its field name), ``role``
(``scheduler`` / ``worker``), ``tp_rank`` and ``model`` (the connector's
``model_name``): a bounded label set (one series per counter and side); the hit rate
by tier, token-weighted, with its denominator (``raykv_hit_tokens`` by ``tier``,
``raykv_asked_tokens``: the scheduler's ``l2_hit_tokens``, ``l3_hit_tokens`` and
``asked_tokens``), and each load's seconds and bytes by tier (``raykv_load_seconds``,
``raykv_load_bytes``: histograms, from the worker's ``LoadTimes``), the load guard's
decisions (``raykv_load_guard_decisions`` by ``decision`` and ``reason``,
``raykv_load_guard_skipped_tokens`` by ``tier``: the scheduler's ``guard_*`` counters,
``load_choice``), each also by the engine's ``tenant`` (``(none)`` without one) and
``deployment``.

The sides count in their ``ConnectorStats`` and record loads, on vLLM's threads; a
thread of this module reads them every ``export_s`` seconds and hands Ray what grew
since its last look, so no vLLM step makes a Ray metric call. Made once the side is
attached (its process then is in the Ray cluster, whose metrics agent on this node
exports it).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import asdict

from raykv.integrations.token_metrics import token_counters
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv.integrations.vllm.load_choice import (
    DECISIONS,
    GUARD_TIERS,
    decision_key,
    skipped_key,
)
from raykv.integrations.vllm.load_times import TIERS, LoadTimes

EXPORT_S = 5.0
"""Seconds between two looks at the counters (Ray ships metrics every few seconds)."""
LOAD_SECONDS = [1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0]
"""``raykv_load_seconds``' bucket bounds, in seconds."""
LOAD_BYTES = [float(1 << n) for n in range(16, 31, 2)]
"""``raykv_load_bytes``' bucket bounds: 64 KiB to 1 GiB, by fours."""


class ConnectorMetrics:
    """Exports ``stats`` (read, never written) with ``tags`` (``role``, ``tp_rank``,
    ``model``), and ``loads`` (drained) with ``owner`` (``tenant``, ``deployment``)
    too, by a thread of its own until ``close``."""

    def __init__(self, stats: ConnectorStats, tags: Mapping[str, str],
                 export_s: float = EXPORT_S, *, owner: Mapping[str, str] | None = None,
                 loads: LoadTimes | None = None) -> None:
        from ray.util import metrics

        self._stats = stats
        self._loads = loads
        self._counter = metrics.Counter(
            "raykv_connector", "vLLM connector counters (RayKVConnector's stats), by "
            "counter, side (role), TP rank and model", tag_keys=(
                "counter", "role", "tp_rank", "model"))
        self._counter.set_default_tags(dict(tags))
        owned = dict(owner or {"tenant": "(none)", "deployment": "(none)"})
        owned["model"] = tags["model"]
        self._asked, self._hit, self._decisions, self._skipped = token_counters(owned)
        self._seconds = metrics.Histogram(
            "raykv_load_seconds", "Seconds of one request's load on a worker, by the "
            "slowest tier it read (l2, l3)", boundaries=LOAD_SECONDS,
            tag_keys=("tier", "tenant", "deployment", "model", "tp_rank"))
        self._bytes = metrics.Histogram(
            "raykv_load_bytes", "Bytes of one request's load on a worker, by the slowest "
            "tier it read (l2, l3)", boundaries=LOAD_BYTES,
            tag_keys=("tier", "tenant", "deployment", "model", "tp_rank"))
        self._guard = {decision_key(d, r): (self._decisions, {"decision": d, "reason": r})
                       for d, r in DECISIONS} | {
            skipped_key(t): (self._skipped, {"tier": t}) for t in GUARD_TIERS}
        for m in (self._seconds, self._bytes):
            m.set_default_tags(owned | {"tp_rank": tags["tp_rank"]})
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()  # one export at a time
        self._stop = threading.Event()
        threading.Thread(target=self._loop, args=(export_s,),
                         name="raykv-connector-metrics", daemon=True).start()

    def export(self) -> None:
        """Hand Ray what each counter grew by since the last export, and the loads
        recorded since (any thread)."""
        with self._lock:
            now = asdict(self._stats)  # counter name -> total (its fields never change)
            for name, total in now.items():
                if (grown := total - self._seen.get(name, 0)) > 0:
                    self._counter.inc(grown, tags={"counter": name})
                    if name == "asked_tokens":
                        self._asked.inc(grown)
                    elif name.endswith("_hit_tokens") and name[:2] in TIERS:
                        self._hit.inc(grown, tags={"tier": name[:2]})
                    elif name in self._guard:
                        metric, tags = self._guard[name]
                        metric.inc(grown, tags=tags)
            self._seen = now
            for tier, seconds, nbytes in self._loads.drain() if self._loads else ():
                self._seconds.observe(seconds, tags={"tier": tier})
                self._bytes.observe(nbytes, tags={"tier": tier})

    def _loop(self, export_s: float) -> None:
        while not self._stop.wait(export_s):
            self.export()

    def close(self) -> None:
        """Export what is left and end the thread."""
        self._stop.set()
        self.export()
