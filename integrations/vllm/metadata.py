"""What the two sides of raykv's vLLM connector send each other: the scheduler side's
``RayKVConnectorMetadata`` to every worker each step, a worker's ``LandedReports``
back (through vLLM's ``KVConnectorOutput.kv_cache_events``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.integrations.vllm.request_blocks import BlockTransfer
from vllm.distributed.kv_events import KVConnectorKVEvents
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    """What every worker does in one step: blocks to load before the forward, blocks
    to load off the step (``async_loads``: requests vLLM parks until every worker's
    ``get_finished`` names them), blocks to save after the forward (page hashes in
    hex; each worker tags them with its own TP rank), and
    ``failures_seen``: the blocks whose failed loads the scheduler side has learnt of
    since the last step (vLLM has rescheduled every request holding one of them from
    that block on, so KV computed from now on no longer reads them)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    async_loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    failures_seen: set[int] = field(default_factory=set)


class LandedReports(KVConnectorKVEvents):
    """Workers' ``(tier, page hash)`` reports of saves that landed
    (``kv_events.LandedBlocks``), as vLLM carries a connector's worker events to its
    scheduler side: vLLM adds every TP rank's reports into one container, so a block
    appears once per rank that reported it (``KVEventBook.landed`` counts them)."""

    def __init__(self, reports: list[tuple[str, str]] | None = None) -> None:
        self._reports = list(reports or [])
        self._workers = 1

    def add_events(self, events: list) -> None:
        self._reports += events

    def aggregate(self) -> LandedReports:
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list:
        return list(self._reports)

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._reports = []
