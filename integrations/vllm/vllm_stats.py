"""raykv's connector counters in vLLM's own connector stats: what ``vllm serve`` logs
(``KV Transfer metrics: ...``, every log interval) and exports on its Prometheus
endpoint (``vllm:raykv_connector_total`` by ``counter``, beside vLLM's engine labels).

Each side hands vLLM what its counters (``side.new_stats``) grew by since its last
``get_kv_connector_stats`` (``StatsDelta.take``, on the thread vLLM calls it from:
the scheduler's after each step's output, each worker's after each step); vLLM sums the
workers' and the scheduler's (``RayKVConnectorStats.aggregate``) and logs or exports the
sums (``reduce``, ``RayKVPromMetrics.observe``). A worker's block counters are its own
TP rank's: summed over an engine's ranks, a block loaded on every rank counts once per
rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raykv.integrations.vllm.load_choice import guard_counters
from raykv.integrations.vllm.load_times import LoadTimes
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

SHOWN = ("queries", "hit_blocks", "l2_hit_blocks", "asked_tokens", "l2_hit_tokens",
         "l3_hit_tokens", "loaded", "l2_loaded", "load_failed", "load_dropped", "saved",
         "l2_saved", "save_failed", "save_refused", "save_dropped", *guard_counters())
"""The counters vLLM logs and exports (blocks, tokens and the load guard's decisions;
``new_stats`` says what each counts); the microsecond sums stay in
``RayKVConnector.stats`` and ``raykv_connector``."""


@dataclass
class RayKVConnectorStats(KVConnectorStats):
    """``data``: counter name -> what it grew by in the interval (``SHOWN``, and from a
    worker its loads' sums per tier, ``LoadTimes.take_sums``: what the scheduler side's
    load guard reads in ``update_connector_output``, never logged or exported)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> RayKVConnectorStats:
        """This one with ``other``'s counts added (vLLM: over workers and intervals)."""
        for name, n in other.data.items():
            self.data[name] = self.data.get(name, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        """Every ``SHOWN`` counter's growth in the interval, 0 included."""
        return {name: self.data.get(name, 0) for name in SHOWN}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class StatsDelta:
    """What a side's ``stats`` (read, never written) grew by between two ``take``
    calls, from one thread, with the sums of ``loads`` recorded since (a worker's)."""

    def __init__(self, stats: Mapping[str, int], loads: LoadTimes | None = None) -> None:
        self._stats = stats
        self._loads = loads
        self._seen = dict.fromkeys(SHOWN, 0)

    def take(self) -> RayKVConnectorStats | None:
        """The growth since the last call (None: nothing grew)."""
        grown = self._loads.take_sums() if self._loads is not None else {}
        for name in SHOWN:
            now = self._stats[name]
            if now != self._seen[name]:
                grown[name] = now - self._seen[name]
                self._seen[name] = now
        return RayKVConnectorStats(data=grown) if grown else None


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
        for name, n in transfer_stats_data.items():
            if name in SHOWN and n > 0:
                self._counters[engine_idx][name].inc(n)
