"""The cache actors and the ranks' route to them. ``rank/`` runs in engine (rank)
processes, ``node/`` in each node's cache actor; the modules here run in both: the
local channel and its wire, the data-op names, errors, shared memory, host pools."""

from raykv import lazy_getattr

_EXPORTS = {"CacheClient": "raykv.cache_actors.rank.client",
            "HostPool": "raykv.cache_actors.host_pools",
            "NodeUnavailableError": "raykv.cache_actors.errors",
            "PoolHandle": "raykv.cache_actors.host_pools"}

__getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
