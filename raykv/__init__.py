"""raykv: a Ray-native distributed KV cache for LLM inference.

The public API: everything a user calls is imported from here, and only from here::

    from raykv import CacheClient, StorageConfig, PoolName, start_local

The repository's folders install as sub-packages of this one (``raykv.controllers``,
``raykv.cache_actors``, ``raykv.clusters``, ``raykv.example_engine``,
``raykv.integrations``), so a user's own ``controllers/`` or ``clusters/`` folder can
never shadow them. Those sub-packages are internal: their modules may move or change
between releases. The engine integrations are loaded by the engines themselves, by
module path (``raykv.integrations.sglang``, ``raykv.integrations.vllm``: docs/engines.md);
they import their engine lazily, so importing ``raykv`` never needs SGLang or vLLM.

The names are imported on first use (see ``lazy_getattr``); a type checker sees them
through the ``TYPE_CHECKING`` imports below, which name the same modules as
``_EXPORTS`` (a unit test keeps the two equal). The package ships ``py.typed``.
"""

import importlib
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from raykv.cache_actors.errors import CircuitOpenError as CircuitOpenError
    from raykv.cache_actors.errors import DeadlineExceededError as DeadlineExceededError
    from raykv.cache_actors.errors import NodeUnavailableError as NodeUnavailableError
    from raykv.cache_actors.errors import StalePoolsError as StalePoolsError
    from raykv.cache_actors.errors import StoreUnavailableError as StoreUnavailableError
    from raykv.cache_actors.host_pools import HostPool as HostPool
    from raykv.cache_actors.host_pools import PoolHandle as PoolHandle
    from raykv.cache_actors.rank.client import CacheClient as CacheClient
    from raykv.cache_actors.rank.staging_pools import EngineMemory as EngineMemory
    from raykv.cache_actors.rank.staging_pools import StagedPool as StagedPool
    from raykv.cache_actors.rank.staging_pools import describe_kv_buffer as describe_kv_buffer
    from raykv.cache_actors.rank.staging_pools import staging_layout as staging_layout
    from raykv.clusters.local import LocalCluster as LocalCluster
    from raykv.clusters.local import local_settings as local_settings
    from raykv.clusters.local import start_local as start_local
    from raykv.controllers.contract import PoolHitPolicy as PoolHitPolicy
    from raykv.controllers.contract import PoolName as PoolName
    from raykv.controllers.contract import PoolTransfer as PoolTransfer
    from raykv.controllers.contract import PoolTransferResult as PoolTransferResult
    from raykv.controllers.contract import StorageConfig as StorageConfig
    from raykv.controllers.node_records import NodeStats as NodeStats
    from raykv.controllers.node_settings import NodeSettings as NodeSettings
    from raykv.controllers.pool_layout import GiB as GiB
    from raykv.controllers.pool_layout import KiB as KiB
    from raykv.controllers.pool_layout import MiB as MiB
    from raykv.controllers.pool_layout import PoolLayout as PoolLayout

try:
    __version__: str = version("raykv")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "CacheClient": "raykv.cache_actors.rank.client",
    "CircuitOpenError": "raykv.cache_actors.errors",
    "DeadlineExceededError": "raykv.cache_actors.errors",
    "EngineMemory": "raykv.cache_actors.rank.staging_pools",
    "GiB": "raykv.controllers.pool_layout",
    "HostPool": "raykv.cache_actors.host_pools",
    "KiB": "raykv.controllers.pool_layout",
    "LocalCluster": "raykv.clusters.local",
    "MiB": "raykv.controllers.pool_layout",
    "NodeSettings": "raykv.controllers.node_settings",
    "NodeStats": "raykv.controllers.node_records",
    "NodeUnavailableError": "raykv.cache_actors.errors",
    "PoolHandle": "raykv.cache_actors.host_pools",
    "PoolHitPolicy": "raykv.controllers.contract",
    "PoolLayout": "raykv.controllers.pool_layout",
    "PoolName": "raykv.controllers.contract",
    "PoolTransfer": "raykv.controllers.contract",
    "PoolTransferResult": "raykv.controllers.contract",
    "StagedPool": "raykv.cache_actors.rank.staging_pools",
    "StalePoolsError": "raykv.cache_actors.errors",
    "StorageConfig": "raykv.controllers.contract",
    "StoreUnavailableError": "raykv.cache_actors.errors",
    "describe_kv_buffer": "raykv.cache_actors.rank.staging_pools",
    "local_settings": "raykv.clusters.local",
    "staging_layout": "raykv.cache_actors.rank.staging_pools",
    "start_local": "raykv.clusters.local",
}


def lazy_getattr(package: str, exports: dict[str, str]) -> Callable[[str], Any]:
    """A PEP 562 module ``__getattr__`` for ``package``: each name of ``exports`` (name ->
    module) is imported on first use. raykv's packages export this way so that the
    processes Ray starts for raykv's own actors (controller, reconciler, supervisors),
    which unpickle classes from sub-packages, never pay for torch, which only ranks need
    (~3 s per process on a small machine).

    Install it under ``if not TYPE_CHECKING:`` beside ``TYPE_CHECKING`` imports of the
    same names: a type checker that sees a module ``__getattr__`` accepts any name, so
    a removed export would go unnoticed."""
    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)
    return __getattr__


if not TYPE_CHECKING:
    __getattr__ = lazy_getattr(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    return __all__
