"""raykv: a Ray-native distributed KV cache for LLM inference.

The public API. Everything a user calls is importable from here::

    from raykv import CacheClient, StorageConfig, PoolName, start_local

The repository's folders install as sub-packages of this one (``raykv.controllers``,
``raykv.cache_actors``, ``raykv.clusters``, ``raykv.example_engine``,
``raykv.integrations``), so a user's own ``controllers/`` or ``clusters/`` folder can
never shadow them. Engine integrations (``raykv.integrations.sglang``,
``raykv.integrations.vllm``) import their engine lazily: importing ``raykv`` never needs
SGLang or vLLM.
"""

from raykv.cache_actors.client import CacheClient
from raykv.cache_actors.errors import (
    NodeUnavailableError,
    StalePoolsError,
    StoreUnavailableError,
)
from raykv.cache_actors.host_pools import HostPool
from raykv.clusters.local import LocalCluster, start_local
from raykv.controllers.contract import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    StorageConfig,
)

__all__ = [
    "CacheClient",
    "HostPool",
    "LocalCluster",
    "NodeUnavailableError",
    "PoolHitPolicy",
    "PoolName",
    "PoolTransfer",
    "PoolTransferResult",
    "StalePoolsError",
    "StorageConfig",
    "StoreUnavailableError",
    "start_local",
]
