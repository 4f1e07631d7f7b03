"""Policy and control plane: contract types, key scheme, pool layout arithmetic."""

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
