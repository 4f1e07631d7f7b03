"""Data plane: shared host pools, the Mooncake backend, the per-node actor, the client."""

from raykv import lazy_getattr

_EXPORTS = {"CacheClient": "raykv.cache_actors.client",
            "HostPool": "raykv.cache_actors.host_pools",
            "NodeUnavailableError": "raykv.cache_actors.errors",
            "PoolHandle": "raykv.cache_actors.host_pools"}

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
