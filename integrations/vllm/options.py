"""``kv_connector_extra_config`` of raykv's vLLM connector, parsed and checked (pure: no
vLLM, no Ray; the connector passes in the few values of vLLM's config it needs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from raykv.controllers.contract import DEFAULT_TIMEOUT_S, StorageConfig
from raykv.controllers.naming import NAMESPACE

KNOWN_KEYS = frozenset({"model_name", "extra_backend_tag", "namespace", "ray_address",
                        "pool_blocks", "timeout_s", "debug_corrupt_loads"})


def default_backend_tag(tp_size: int, pp_size: int) -> str:
    """``vllm-tp{TP}``, with ``-pp{PP}`` when PP > 1: blocks of another TP or PP size are
    other bytes, so they get other keys."""
    tag = f"vllm-tp{tp_size}"
    if pp_size > 1:
        tag += f"-pp{pp_size}"
    return tag


@dataclass(frozen=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of ``RayKVConnector`` (every key optional).

    - ``model_name``: the model part of the key prefix (default: vLLM's served model
      name). Engines that must share blocks need the same model name and tag.
    - ``extra_backend_tag``: the first part of the key prefix (default ``vllm-tp{TP}``,
      ``-pp{PP}`` added when PP > 1: blocks of another TP size are other bytes).
    - ``namespace``: the Ray namespace raykv runs in (default ``raykv``).
    - ``ray_address``: the Ray cluster to join from a process that is not a Ray worker
      (vLLM's multiprocess engine core and TP worker processes); default
      ``$RAY_ADDRESS``, else the cluster of the Ray actor that started the engine, else
      ``auto`` (see ``raykv.integrations.ray_join.join_ray``).
    - ``pool_blocks``: blocks in each TP rank's shared staging pool (default 64); larger
      loads and saves go through it in chunks of this many blocks.
    - ``timeout_s``: the deadline of each call to raykv, in seconds (default
      ``DEFAULT_TIMEOUT_S``, 5): a hung or stopped node actor then costs a failed load
      (recomputed under ``kv_load_failure_policy="recompute"``) or a lost save, and the
      scheduler's hit query a miss, never a stalled engine.
    - ``debug_corrupt_loads``: test only: overwrite every loaded block with random
      values (shows that loaded KV is really used).
    """

    model_name: str
    extra_backend_tag: str
    namespace: str = NAMESPACE
    ray_address: str | None = None
    pool_blocks: int = 64
    timeout_s: float = DEFAULT_TIMEOUT_S
    debug_corrupt_loads: bool = False

    @classmethod
    def parse(cls, extra_config: Mapping[str, Any] | None, *, tp_size: int, pp_size: int,
              served_model: str) -> ConnectorOptions:
        """The options of ``extra_config`` (vLLM's ``kv_connector_extra_config``; None:
        all defaults) for an engine of ``tp_size`` x ``pp_size`` ranks serving
        ``served_model`` (vLLM's served model name, else its model). ``ValueError`` on an
        unknown key, ``pool_blocks`` < 1 or a bad ``timeout_s``."""
        extra = dict(extra_config or {})
        unknown = sorted(set(extra) - KNOWN_KEYS)
        if unknown:
            raise ValueError(f"RayKVConnector: unknown kv_connector_extra_config keys "
                             f"{unknown}; known: {sorted(KNOWN_KEYS)}")
        model = extra.get("model_name") or served_model
        pool_blocks = int(extra.get("pool_blocks", 64))
        if pool_blocks < 1:
            raise ValueError(f"RayKVConnector: pool_blocks must be >= 1, got {pool_blocks}")
        tag = default_backend_tag(tp_size, pp_size)
        return cls(model_name=str(model),
                   extra_backend_tag=str(extra.get("extra_backend_tag", tag)),
                   namespace=str(extra.get("namespace", NAMESPACE)),
                   ray_address=extra.get("ray_address"), pool_blocks=pool_blocks,
                   timeout_s=StorageConfig(extra_config=extra).timeout_s,  # validated
                   debug_corrupt_loads=bool(extra.get("debug_corrupt_loads", False)))

    def storage_config(self, *, tp_rank: int, tp_size: int, pp_rank: int,
                       pp_size: int) -> StorageConfig:
        """The ``StorageConfig`` of one rank's (or, rank 0, the scheduler's) raykv
        client: these options' model, key tag and deadline."""
        return StorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                             pp_size=pp_size, model_name=self.model_name,
                             extra_config={"extra_backend_tag": self.extra_backend_tag,
                                           "timeout_s": self.timeout_s})
