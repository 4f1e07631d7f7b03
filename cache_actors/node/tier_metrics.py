"""The store's tiers as Ray metrics: objects and bytes a node actor's gets served from
memory (``l3_memory``) and from a disk tier (``l3_disk``), and the objects refused for
a seal that did not verify or unreadable on disk, by reason
(``cache_actors.node.sealed_objects``).

``export`` is called by ``NodeMetrics``' exporter thread (``NodeMetrics.watch``): it
reads the counts (``MooncakeBackend.tier_stats``) and adds what grew since its last
look.
"""

from __future__ import annotations

from collections.abc import Callable

from ray.util import metrics
from raykv.controllers.node_records import LoadStats, TierStats


class TierMetrics:
    """``raykv_l3_served_objects`` / ``raykv_l3_served_bytes`` (tag ``tier``) and
    ``raykv_seal_refused_objects`` (tag ``reason``) of one node actor, from
    ``read()`` (None: no seals on this node, nothing to export); each named after the
    ``TierStats`` field it counts."""

    def __init__(self, node_id: str, read: Callable[[], TierStats | None]) -> None:
        self._read = read
        self._seen: dict[str, dict[str, int]] = {}
        self._metrics = {
            "served": metrics.Counter(
                "raykv_l3_served_objects", "Objects gets read from the store and served "
                "(seal verified), by tier: l3_memory, l3_disk (a node's disk tier), unknown",
                tag_keys=("node", "tier")),
            "served_bytes": metrics.Counter(
                "raykv_l3_served_bytes", "Bytes of the objects gets served, by tier",
                tag_keys=("node", "tier")),
            "refused": metrics.Counter(
                "raykv_seal_refused_objects", "Objects gets read but refused, their seal "
                "not verified (damaged, truncated or foreign) or unreadable on disk, by "
                "reason: format, length, mac, unreadable",
                tag_keys=("node", "reason")),
        }
        for m in self._metrics.values():
            m.set_default_tags({"node": node_id[:12]})

    def export(self) -> None:
        """Add to each metric what its count grew by since the last call."""
        now = self._read()
        if now is None:
            return
        for name, metric in self._metrics.items():
            tag = "reason" if name == "refused" else "tier"
            before = self._seen.get(name, {})
            counts: dict[str, int] = getattr(now, name)
            for label, total in counts.items():
                if (n := total - before.get(label, 0)) > 0:
                    metric.inc(n, tags={tag: label})
            self._seen[name] = dict(counts)


class LinkMetrics:
    """``raykv_link_bytes_per_second`` (tag ``segment``: a source segment ``host:port``,
    or ``l3_disk``) of one node actor: its estimate of each link's read rate
    (``LoadEstimates.stats``, from ``read()``); a link the node forgot reads 0, one not
    estimated yet is not set."""

    def __init__(self, node_id: str, read: Callable[[], LoadStats]) -> None:
        self._read = read
        self._shown: set[str] = set()
        self._gauge = metrics.Gauge(
            "raykv_link_bytes_per_second", "A node actor's estimate of the bytes per second "
            "its gets read from each source segment (host:port) or from disk (l3_disk): "
            "probes and measured gets, a moving average",
            tag_keys=("node", "segment"))
        self._gauge.set_default_tags({"node": node_id[:12]})

    def export(self) -> None:
        """Set each link's gauge; 0 for the links forgotten since the last call."""
        view = self._read()
        rates = {s: v.mb_per_s for s, v in view.links.items()}
        rates["l3_disk"] = view.l3_disk.mb_per_s
        now = {s for s, mb in rates.items() if mb is not None}
        for s in now:
            self._gauge.set(min(rates[s], 1e6) * 1e6, tags={"segment": s})
        for s in self._shown - now:
            self._gauge.set(0, tags={"segment": s})
        self._shown = now
