"""Runs in every raykv process: pure logic (storage contract types, key scheme, pool
layout arithmetic, deployments, transfer plans, hit search; no Ray or Mooncake import),
plus ``controller``, the one module here that runs as an actor (``CacheController``,
the cluster's one controller)."""

from raykv.controllers.contract import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    StorageConfig,
)
from raykv.controllers.keys import KeyScheme, key_prefix, mha_suffix, mla_suffix
from raykv.controllers.naming import CONTROLLER_NAME, NAMESPACE, node_actor_name
from raykv.controllers.pool_layout import PoolLayout

__all__ = [
    "CONTROLLER_NAME",
    "NAMESPACE",
    "KeyScheme",
    "PoolHitPolicy",
    "PoolLayout",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "StorageConfig",
    "key_prefix",
    "mha_suffix",
    "mla_suffix",
    "node_actor_name",
]
