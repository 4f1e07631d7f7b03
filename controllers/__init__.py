"""Policy and control plane: contract types, key scheme, pool layout arithmetic."""

from raykv.controllers.contract import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    StorageConfig,
)
from raykv.controllers.keys import KeyPlan, key_prefix, mha_suffix, mla_suffix
from raykv.controllers.naming import CONTROLLER_NAME, NAMESPACE, node_actor_name
from raykv.controllers.pool_layout import PoolLayout

__all__ = [
    "CONTROLLER_NAME",
    "NAMESPACE",
    "KeyPlan",
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
