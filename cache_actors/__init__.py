"""Data plane: shared host pools, the Mooncake backend, the per-node actor, the client."""

from cache_actors.client import CacheClient, NodeUnavailableError
from cache_actors.host_pools import HostPool, PoolHandle

__all__ = ["CacheClient", "HostPool", "NodeUnavailableError", "PoolHandle"]
