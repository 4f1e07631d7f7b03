"""raykv's connector counters in vLLM's own connector stats: what ``vllm serve`` logs
(``KV Transfer metrics: ...``, every log interval) and exports on its Prometheus
endpoint (``vllm:raykv_connector_total`` by ``counter``, beside vLLM's engine labels).

Each side hands vLLM what its counters (``connector_stats.ConnectorStats``) grew by
since its last ``get_kv_connector_stats`` (``StatsDelta.take``, on the thread vLLM calls
it from: the scheduler's after each step's output, each worker's after each step); vLLM
sums the workers' and the scheduler's (``RayKVConnectorStats.aggregate``) and logs or
exports the sums (``reduce``, ``RayKVPromMetrics.observe``). A worker's block counters
are its own TP rank's: summed over an engine's ranks, a block loaded on every rank
counts once per rank. ``KVConnectorStats.data`` is vLLM's dict: it is made from a
``StatsGrowth`` by ``growth_to_vllm`` and read back by ``growth_from_vllm`` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raykv.integrations.vllm.connector_stats import (
    SHOWN,
    ConnectorStats,
    StatsGrowth,
    growth_from_vllm,
    growth_to_vllm,
    shown,
)
from raykv.integrations.vllm.load_times import LoadTimes
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)


@dataclass
class RayKVConnectorStats(KVConnectorStats):
    """``data``: a ``StatsGrowth`` as vLLM carries it (``growth_to_vllm``): counter name
    -> what it grew by in the interval, and from a worker its loads' sums per tier."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> RayKVConnectorStats:
        """This one with ``other``'s counts added (vLLM: over workers and intervals)."""
        self.data = growth_to_vllm(growth_from_vllm(self.data)
                                   + growth_from_vllm(other.data))
        return self

    def reduce(self) -> dict[str, int | float]:
        """Every ``SHOWN`` counter's growth in the interval, 0 included."""
        growth = growth_from_vllm(self.data)
        return {name: getattr(growth, name) for name in SHOWN}

    def is_empty(self) -> bool:
        return growth_from_vllm(self.data) == StatsGrowth()


class StatsDelta:
    """What a side's ``stats`` (read, never written) grew by between two ``take``
    calls, from one thread, with the sums of ``loads`` recorded since (a worker's)."""

    def __init__(self, stats: ConnectorStats, loads: LoadTimes | None = None) -> None:
        self._stats = stats
        self._loads = loads
        self._seen = StatsGrowth()

    def take(self) -> RayKVConnectorStats | None:
        """The growth since the last call (None: nothing grew)."""
        now = shown(self._stats)
        grown = now - self._seen
        self._seen = now
        if self._loads is not None:
            grown += self._loads.take_sums()
        return None if grown == StatsGrowth() else RayKVConnectorStats(
            data=growth_to_vllm(grown))


class RayKVPromMetrics(KVConnectorPromMetrics):
    """``vllm:raykv_connector`` on vLLM's Prometheus endpoint: one counter by vLLM's
    engine labels and ``counter`` (a ``SHOWN`` name)."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = self._counter_cls(
            name="vllm:raykv_connector", documentation="raykv connector counters (blocks "
            "and tokens; RayKVConnector's stats), by counter",
            labelnames=[*labelnames, "counter"])
        self._counters = {engine: {name: counter.labels(*values, name) for name in SHOWN}
                          for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        growth = growth_from_vllm(transfer_stats_data)
        for name in SHOWN:
            if (n := getattr(growth, name)) > 0:
                self._counters[engine_idx][name].inc(n)
