"""Data plane: shared host pools, the Mooncake backend, the per-node actor, the client."""

import importlib

_EXPORTS = {"CacheClient": "raykv.cache_actors.client",
            "HostPool": "raykv.cache_actors.host_pools",
            "NodeUnavailableError": "raykv.cache_actors.errors",
            "PoolHandle": "raykv.cache_actors.host_pools"}

__all__ = ["CacheClient", "HostPool", "NodeUnavailableError", "PoolHandle"]


def __getattr__(name: str):
    """The package's names, imported on first use (see ``raykv.__getattr__``)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'raykv.cache_actors' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
