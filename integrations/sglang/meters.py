"""What the SGLang backend counts (pure, no SGLang import): its own counters
(``RayKVStore.raykv_stats``) and, with ``enable_storage_metrics``, SGLang's storage
metrics since the last ``get_stats`` (pages and GB/s of each prefetch and backup).

Threads: SGLang's storage threads record; ``get_stats`` drains from SGLang's metrics
thread (list appends and a copy-then-clear, each atomic under the GIL, as before).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping


class BackendMeters:
    """``counters``: counts by name (``set_pages``, ``get_pages``, ``<call>_failures``,
    ...). ``storage_metrics``: whether SGLang's metrics are kept."""

    def __init__(self, storage_metrics: bool) -> None:
        self.counters: Counter[str] = Counter()
        self._storage_metrics = storage_metrics
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}

    def record(self, write: bool, out: Mapping, served: Mapping, seconds: float) -> None:
        """A v2 call's outcome ``out`` (role -> one bool per page) that took ``seconds``;
        ``served``: role -> its pool (``layout.object_sizes`` give a page's bytes; a
        role no longer served counts pages, not bytes)."""
        pages = sum(sum(v) for v in out.values())
        nbytes = sum(sum(v) * sum(served[n].layout.object_sizes)
                     for n, v in out.items() if n in served)
        self.counters[f"{'set' if write else 'get'}_pages"] += pages
        if self._storage_metrics:
            kind = "backup" if write else "prefetch"
            self._metrics[f"{kind}_pgs"].append(pages)
            self._metrics[f"{kind}_bandwidth"].append(nbytes / max(seconds, 1e-9) / 1e9)

    def drain_into(self, metrics: object) -> object:
        """Hand what was recorded since the last call to ``metrics`` (SGLang's
        ``StorageMetrics``: one list attribute per key) and forget it; ``metrics``."""
        for k, v in self._metrics.items():
            getattr(metrics, k).extend(v)
            v.clear()
        return metrics
