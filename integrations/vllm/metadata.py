"""What the scheduler side of raykv's vLLM connector sends every worker each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.integrations.vllm.request_blocks import BlockTransfer
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
