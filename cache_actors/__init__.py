"""Data plane: shared host pools, the Mooncake backend, the per-node actor, the client."""

from raykv.cache_actors.client import CacheClient
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.host_pools import HostPool, PoolHandle

__all__ = ["CacheClient", "HostPool", "NodeUnavailableError", "PoolHandle"]
