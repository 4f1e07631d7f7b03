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

import importlib

_EXPORTS = {
    "CacheClient": "raykv.cache_actors.rank.client",
    "HostPool": "raykv.cache_actors.host_pools",
    "LocalCluster": "raykv.clusters.local",
    "NodeUnavailableError": "raykv.cache_actors.errors",
    "PoolHitPolicy": "raykv.controllers.contract",
    "PoolName": "raykv.controllers.contract",
    "PoolTransfer": "raykv.controllers.contract",
    "PoolTransferResult": "raykv.controllers.contract",
    "StalePoolsError": "raykv.cache_actors.errors",
    "StorageConfig": "raykv.controllers.contract",
    "StoreUnavailableError": "raykv.cache_actors.errors",
    "start_local": "raykv.clusters.local",
}


def lazy_getattr(package: str, exports: dict[str, str]):
    """A PEP 562 module ``__getattr__`` for ``package``: each name of ``exports`` (name ->
    module) is imported on first use. raykv's packages export this way so that the
    processes Ray starts for raykv's own actors (controller, reconciler, supervisors),
    which unpickle classes from sub-packages, never pay for torch, which only ranks need
    (~3 s per process on a small machine)."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)
    return __getattr__


__getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    return __all__
