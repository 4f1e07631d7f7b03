"""The storage contract types, named as in SGLang HiCache.

These are plain data: no Ray, no Mooncake. A ``CacheClient`` speaks them; the
controller and the hit resolution read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from raykv.controllers.tenancy import check_tenant


class PoolName(StrEnum):
    """The host pools a deployment may register. ``kv`` is the anchor pool."""

    KV = "kv"
    MAMBA = "mamba"
    SWA = "swa"
    INDEXER = "indexer"
    DRAFT = "draft"


class PoolHitPolicy(StrEnum):
    """How a pool decides whether a prefix of ``n`` pages is restorable.

    ``all_pages``: every page of the prefix must exist (KV, indexer, draft).
    ``trailing_pages``: only the last pages of the prefix must exist (Mamba, SWA state).
    """

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


DEFAULT_TIMEOUT_S = 5.0
"""Default deadline of one data call, in seconds. A healthy call takes 0.1-100 ms (one
batch of up to a few hundred MiB over TCP); Mooncake itself gives up on a dead peer after
~10-20 s (when the master expires it). Five seconds is long enough that a busy node never
trips it, and short enough that an engine waiting on a hung node actor (vLLM's scheduler
calls synchronously) stalls for one visible hiccup, not for good."""
MAX_TIMEOUT_S = 600.0
MAX_GROUP_RANKS = 1024
"""Ranks of one TP x PP group, at most (so each of ``tp_size``, ``pp_size`` and
``attn_cp_size`` too): 16 times the largest groups served today (TP 8 x PP 8). A group's
home node lists every rank of it for each hit query, so the size of that list is bounded
before a registration or a group query may ask for one."""
IDENTITY_KEYS: dict[str, type] = {"model_revision": str, "kv_dtype": str, "page_size": int}
"""The ``extra_config`` keys that describe the bytes a rank stores, and their types."""
LOOKUP_HOMES = ("node", "deployment")
"""Where a rank's group queries go (``extra_config['lookup_home']``): its own node's
actor, or its deployment's home node's (``deployments.lookup_home``)."""
MAX_ENGINE_ID = 128
"""Characters of an ``extra_config['engine_id']``, at most."""


def check_engine_id(engine: object, what: str, *, unnamed: bool) -> None:
    """``ValueError`` naming ``what`` unless ``engine`` is a str of at most
    ``MAX_ENGINE_ID`` characters, not empty unless ``unnamed`` ("" stands for no engine
    named on the wire)."""
    if type(engine) is not str or not (unnamed or engine) or len(engine) > MAX_ENGINE_ID:
        least = 0 if unnamed else 1
        raise ValueError(f"{what} must be a str of {least} to {MAX_ENGINE_ID} characters, "
                         f"got {engine!r:.200}")


@dataclass
class StorageConfig:
    """Fields of SGLang's ``HiCacheStorageConfig``.

    ``extra_config`` keys understood by raykv: ``extra_backend_tag`` (str, first part of
    every key prefix); ``tenant`` (str, see ``controllers.tenancy``; default none);
    ``model_revision`` (str: the weights' revision, e.g. a commit), ``kv_dtype`` (str:
    the KV cache's dtype, e.g. ``"bfloat16"``, ``"fp8_e4m3"``) and ``page_size`` (int:
    tokens per page), each optional: with them the *identity* of the bytes
    (``controllers.keys.Identity``) is part of a tenant's key prefix, and the deployment
    registry refuses a rank whose identity differs from that of the deployment registered
    under its key prefix;
    ``timeout_s`` (float > 0, default ``DEFAULT_TIMEOUT_S``): the
    deadline of every data call this rank makes to a node actor (exists, put, get, group
    hit), see ``timeout_s``; ``lookup_home`` (``"node"`` or ``"deployment"``): which
    node actor answers this rank's group queries (``deployments.lookup_home``);
    ``engine_id`` (str of 1..``MAX_ENGINE_ID`` characters): the engine this rank is part
    of, the same on every rank of one TP x PP group and different for each replica of
    the deployment: group answers are shared only by ranks naming the same engine (see
    ``engine_id``).
    ``ValueError`` for a value of the wrong type.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    is_mla_model: bool = False
    enable_storage_metrics: bool = False
    is_page_first_layout: bool = True
    model_name: str | None = None
    extra_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_parallel(self)
        timeout = (self.extra_config or {}).get("timeout_s", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or \
                not 0 < timeout <= MAX_TIMEOUT_S:
            raise ValueError(f"extra_config['timeout_s'] must be a number of seconds in "
                             f"(0, {MAX_TIMEOUT_S}], got {timeout!r}")
        extra = self.extra_config or {}
        check_tenant(extra.get("tenant"))
        if extra.get("lookup_home") not in (None, *LOOKUP_HOMES):
            raise ValueError(f"extra_config['lookup_home'] must be one of {LOOKUP_HOMES}, "
                             f"got {extra['lookup_home']!r}")
        if extra.get("engine_id") is not None:
            check_engine_id(extra["engine_id"], "extra_config['engine_id']", unnamed=False)
        for key, kind in IDENTITY_KEYS.items():
            value = extra.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, kind)
                                      or (kind is int and value < 1)):
                want = "a positive int" if kind is int else "a string"
                raise ValueError(f"extra_config[{key!r}] must be {want}, got {value!r}")

    @property
    def extra_backend_tag(self) -> str | None:
        return (self.extra_config or {}).get("extra_backend_tag") or None

    @property
    def tenant(self) -> str | None:
        """The tenant this rank serves (``controllers.tenancy``), None without one."""
        return (self.extra_config or {}).get("tenant") or None

    @property
    def model_revision(self) -> str | None:
        """The revision of the model's weights, None if not given."""
        return (self.extra_config or {}).get("model_revision") or None

    @property
    def kv_dtype(self) -> str | None:
        """The KV cache's dtype name, None if not given."""
        return (self.extra_config or {}).get("kv_dtype") or None

    @property
    def page_size(self) -> int | None:
        """Tokens per page, None if not given."""
        return (self.extra_config or {}).get("page_size")

    @property
    def lookup_home(self) -> str | None:
        """``"node"``, ``"deployment"`` or None (not given: the rule of
        ``deployments.lookup_home``)."""
        return (self.extra_config or {}).get("lookup_home")

    @property
    def engine_id(self) -> str | None:
        """The engine (one TP x PP group) this rank serves, None if not given. The ranks
        of one engine asking one node actor about the same keys get one answer; without
        an engine id every rank of the deployment asking there counts as one group, so
        two replicas asking the same keys within the answer window can each get an
        answer the other's ranks asked for, and one replica's ranks then differ (an
        engine that reduces the hit among its ranks itself, as SGLang does with a MIN
        all-reduce, or whose scheduler alone asks, as vLLM's, needs none)."""
        return (self.extra_config or {}).get("engine_id")

    @property
    def timeout_s(self) -> float:
        """Seconds a data call may take before it fails with the retryable
        ``DeadlineExceededError`` (the engine then treats it as a miss / a failed load)."""
        return float((self.extra_config or {}).get("timeout_s", DEFAULT_TIMEOUT_S))


@dataclass
class PoolTransfer:
    """One pool's part of a v2 batch call.

    ``host_indices`` are token-slot indices into the pool (``len(keys) * page_size`` of
    them, each page's slots contiguous and page-aligned). A sidecar transfer names the
    pool whose indices it reuses in ``indices_from_pool`` and leaves ``host_indices`` None.
    """

    name: PoolName
    keys: list[str] | None = None
    host_indices: Any = None
    hit_policy: PoolHitPolicy = PoolHitPolicy.ALL_PAGES
    indices_from_pool: PoolName | None = None


@dataclass
class PoolTransferResult:
    """What a v2 exists query found.

    ``kv_hit_pages``: the longest prefix (in pages) that KV and every extra pool can
    restore together. ``extra_pool_hit_pages``: per extra pool, the pages it must load
    for that prefix. ``restorable_prefix_pages``: every prefix length (pages, ascending)
    that all pools can restore. ``load_runs``: the hit's pages in prefix order as runs
    ``(tier, pages, seconds)`` of one tier each, with the answering node's estimate of
    the seconds their load takes (None: no estimate); ``controllers.load_guard``'s
    ``LoadRun``, as it travels. Empty when the node gave no estimates.
    """

    kv_hit_pages: int = 0
    extra_pool_hit_pages: dict[PoolName, int] = field(default_factory=dict)
    restorable_prefix_pages: list[int] = field(default_factory=list)
    load_runs: list[tuple[str, int, float | None]] = field(default_factory=list)


def check_parallel(config: StorageConfig) -> None:
    """``ValueError`` unless ``config``'s sizes are ints in ``[1, MAX_GROUP_RANKS]``,
    ``tp_size * pp_size`` is at most ``MAX_GROUP_RANKS``, and each rank an int in
    ``[0, size)``. Run when a ``StorageConfig`` is made and again where one arrives from
    another process (the controller's registration: an object unpickled by Ray was never
    checked)."""
    for rank, size, what in (
        (config.tp_rank, config.tp_size, "tp"),
        (config.pp_rank, config.pp_size, "pp"),
        (config.attn_cp_rank, config.attn_cp_size, "attn_cp"),
    ):
        for name, value in ((f"{what}_size", size), (f"{what}_rank", rank)):
            if type(value) is not int:
                raise ValueError(f"{name} must be an int, got {value!r}")
        if not 1 <= size <= MAX_GROUP_RANKS:
            raise ValueError(f"{what}_size must be in [1, {MAX_GROUP_RANKS}] "
                             f"(MAX_GROUP_RANKS), got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"{what}_rank {rank} is out of range for {what}_size {size}")
    if config.tp_size * config.pp_size > MAX_GROUP_RANKS:
        raise ValueError(f"tp_size {config.tp_size} x pp_size {config.pp_size} is over "
                         f"MAX_GROUP_RANKS={MAX_GROUP_RANKS} ranks in one group")
