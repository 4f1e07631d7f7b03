"""The write-behind's backlog as a Ray gauge: ``raykv_l2_write_behind_objects``, the
objects of one node's L2 handed to the write-behind whose put to L3 has not ended
(queued, in a put, or waiting for a retry: ``l3_put_submitted - l3_put -
l3_put_failed`` of ``L2Pools.counters``). Their pages are dirty (never evicted) until
it ends, so a backlog that grows means L3 puts slower than the engines commit.

``export`` is called by ``NodeMetrics``' exporter thread (``NodeMetrics.watch``) and
sets the gauge each time (Ray's export drops a gauge not set for two of its report
intervals).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from ray.util import metrics


def backlog(counts: Mapping[str, int]) -> int:
    """Objects handed to the write-behind whose put has not ended, from the node's L2
    counts (``L2Pools.counters``' first half)."""
    return (counts.get("l3_put_submitted", 0) - counts.get("l3_put", 0)
            - counts.get("l3_put_failed", 0))


class BacklogMetrics:
    """``raykv_l2_write_behind_objects`` (tag ``node``) from ``counters()``
    (``L2Pools.counters``)."""

    def __init__(self, node_id: str, counters: Callable[[], tuple[Mapping[str, int],
                                                                 Mapping]]) -> None:
        self._counters = counters
        self._gauge = metrics.Gauge(
            "raykv_l2_write_behind_objects", "Objects of the node's L2 whose put to L3 "
            "behind the writer has not ended (the write-behind's backlog; their pages "
            "stay dirty)", tag_keys=("node",))
        self._gauge.set_default_tags({"node": node_id[:12]})

    def export(self) -> None:
        """Set the gauge to the backlog now."""
        self._gauge.set(backlog(self._counters()[0]))
