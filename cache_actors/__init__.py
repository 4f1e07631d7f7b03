"""The cache actors and the ranks' route to them. ``rank/`` runs in engine (rank)
processes, ``node/`` in each node's cache actor; the modules here run in both: the
local channel and its wire, the data-op names, errors, shared memory, host pools.

Exports are lazy (``raykv.lazy_getattr``); the ``TYPE_CHECKING`` imports name them for a
type checker."""

from typing import TYPE_CHECKING

from raykv import lazy_getattr

if TYPE_CHECKING:
    from raykv.cache_actors.errors import NodeUnavailableError as NodeUnavailableError
    from raykv.cache_actors.host_pools import HostPool as HostPool
    from raykv.cache_actors.host_pools import PoolHandle as PoolHandle
    from raykv.cache_actors.rank.client import CacheClient as CacheClient

_EXPORTS = {"CacheClient": "raykv.cache_actors.rank.client",
            "HostPool": "raykv.cache_actors.host_pools",
            "NodeUnavailableError": "raykv.cache_actors.errors",
            "PoolHandle": "raykv.cache_actors.host_pools"}

if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
