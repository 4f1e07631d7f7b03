"""A vLLM connector side's counters (``side.new_stats``) as one Ray metric,
``raykv_connector``, by ``counter`` (its name in ``new_stats``), ``role``
(``scheduler`` / ``worker``), ``tp_rank`` and ``model`` (the connector's
``model_name``): a bounded label set (one series per counter and side).

The sides count in their plain dict as before, on vLLM's threads; a thread of this
module reads that dict every ``export_s`` seconds and hands Ray what grew since its last
look, so no vLLM step makes a Ray metric call. Made once the side is attached (its
process then is in the Ray cluster, whose metrics agent on this node exports it).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

EXPORT_S = 5.0
"""Seconds between two looks at the counters (Ray ships metrics every few seconds)."""


class ConnectorMetrics:
    """Exports ``stats`` (read, never written) with ``tags`` (``role``, ``tp_rank``,
    ``model``) by a thread of its own until ``close``."""

    def __init__(self, stats: Mapping[str, int], tags: Mapping[str, str],
                 export_s: float = EXPORT_S) -> None:
        from ray.util import metrics

        self._stats = stats
        self._counter = metrics.Counter(
            "raykv_connector", "vLLM connector counters (RayKVConnector's stats), by "
            "counter, side (role), TP rank and model", tag_keys=(
                "counter", "role", "tp_rank", "model"))
        self._counter.set_default_tags(dict(tags))
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()  # one export at a time
        self._stop = threading.Event()
        threading.Thread(target=self._loop, args=(export_s,),
                         name="raykv-connector-metrics", daemon=True).start()

    def export(self) -> None:
        """Hand Ray what each counter grew by since the last export (any thread)."""
        with self._lock:
            now = dict(self._stats)  # its keys never change: a copy is safe meanwhile
            for name, total in now.items():
                if (grown := total - self._seen.get(name, 0)) > 0:
                    self._counter.inc(grown, tags={"counter": name})
            self._seen = now

    def _loop(self, export_s: float) -> None:
        while not self._stop.wait(export_s):
            self.export()

    def close(self) -> None:
        """Export what is left and end the thread."""
        self._stop.set()
        self.export()
