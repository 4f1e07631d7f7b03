"""What the scheduler side of raykv's vLLM connector sends every worker each step."""

from __future__ import annotations

from dataclasses import dataclass, field

from raykv.integrations.vllm.plan import BlockTransfer
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class RayKVConnectorMetadata(KVConnectorMetadata):
    """What every worker does in one step: blocks to load before the forward, blocks to
    save after it (page hashes in hex; each worker tags them with its own TP rank)."""

    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
