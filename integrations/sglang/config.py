"""SGLang's HiCache config in raykv terms (pure: no SGLang, no Ray import).

``storage_config`` reads SGLang's ``HiCacheStorageConfig`` by its field names, so it
runs (and is tested) without SGLang; ``BackendOptions`` holds the extra-config keys the
backend itself reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from raykv.controllers.contract import PoolName, StorageConfig
from raykv.controllers.load_guard import GuardSettings
from raykv.controllers.naming import NAMESPACE

SUPPORTED_POOLS = {p.value: p for p in PoolName}
"""SGLang pools raykv serves, by value; every other ``PoolName`` of SGLang is refused."""
STAGING_PAGES = 256
"""Pages staged per pool and direction (SGLang moves at most 128 pages per call)."""
MAMBA_STAGING_SLOTS = 16
"""Mamba slots staged per direction: they are large and move one per request (a call
with more goes through in rounds)."""
CONFIG_KEYS = ("ray_address", "namespace", "ray_namespace", "ray_auth_mode", "ray_node_id",
               "zero_copy", "staging_pages", "extra_backend_tag", "timeout_s", "tenant",
               "model_revision", "lookup_home", "engine_id", "load_guard",
               "prefill_tokens_per_s")
"""extra_config keys this backend reads (``ray_namespace``: the older name of
``namespace``, kept as its alias)."""
STORAGE_KEYS = ("extra_backend_tag", "timeout_s", "tenant", "model_revision", "lookup_home",
                "engine_id")
"""The keys of ``CONFIG_KEYS`` that ``storage_config`` hands to raykv's ``StorageConfig``.
The KV dtype and page size are not among them: SGLang's host pools carry them, and the
deployment registry refuses a rank whose pools' dtypes, page size or bytes per page
differ from its deployment's (``controllers.deployments.PoolSpec``), so with or without
a tenant a change of either is refused at attach, never read as the old bytes."""
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys", "tp_lcm_size")
"""extra_config keys SGLang 0.5.23 reads itself for any dynamic backend (its storage
backend factory, cache controller and host pools; the prefetch keys and
``tp_lcm_size`` SGLang usually removes before the backend sees the config): they pass."""


def check_keys(extra: dict) -> None:
    """``ValueError`` naming every key of ``extra`` that neither this backend nor SGLang
    reads (a typo, or another backend's key such as MooncakeStore's
    ``master_server_address``), with the keys that are valid."""
    unknown = sorted(set(extra) - set(CONFIG_KEYS) - set(SGLANG_KEYS))
    if unknown:
        raise ValueError(f"raykv: unknown --hicache-storage-backend-extra-config keys "
                         f"{unknown}; raykv's: {sorted(CONFIG_KEYS)}; SGLang's own: "
                         f"{sorted(SGLANG_KEYS)}")


def storage_config(config: Any) -> StorageConfig:
    """raykv's ``StorageConfig`` for SGLang's ``HiCacheStorageConfig`` ``config``;
    ``ValueError`` naming what raykv cannot serve (decode context parallelism, heads
    split across ranks). Host layouts are checked per pool at registration (SGLang sets
    ``is_page_first_layout`` only for ``page_first``, not for the also servable
    ``page_first_direct``). The tenant's secret comes from ``$RAYKV_TENANT_SECRET`` of
    the SGLang process, never from the config."""
    problems = []
    if getattr(config, "dcp_size", 1) > 1:
        problems.append(f"dcp_size={config.dcp_size} (decode context parallel keys are not "
                        "supported)")
    if getattr(config, "should_split_heads", False):
        problems.append("should_split_heads=True (heads split across a TP LCM group)")
    if problems:
        raise ValueError("raykv cannot serve this SGLang HiCache config: " + "; ".join(problems))
    extra = dict(config.extra_config or {})
    return StorageConfig(
        tp_rank=config.tp_rank, tp_size=config.tp_size, pp_rank=config.pp_rank,
        pp_size=config.pp_size, attn_cp_rank=config.attn_cp_rank,
        attn_cp_size=config.attn_cp_size, is_mla_model=config.is_mla_model,
        enable_storage_metrics=config.enable_storage_metrics,
        is_page_first_layout=config.is_page_first_layout, model_name=config.model_name,
        extra_config={k: extra[k] for k in STORAGE_KEYS if k in extra})


@dataclass(frozen=True)
class BackendOptions:
    """The extra-config keys ``RayKVStore`` reads (see its docstring)."""

    ray_address: str | None = None
    namespace: str = NAMESPACE
    auth_mode: str | None = None
    node_id: str | None = None
    zero_copy: bool = True
    allocator: str | None = None
    staging_pages: int = STAGING_PAGES
    interface_v1: bool = False
    load_guard: GuardSettings = field(default_factory=GuardSettings)
    prefill_s_per_token: float | None = None

    @classmethod
    def from_extra(cls, extra: dict | None) -> BackendOptions:
        """The options of SGLang's extra config ``extra`` (None: all defaults).
        ``ValueError`` on a key nobody reads (``check_keys``) or on ``namespace`` and
        its alias ``ray_namespace`` naming different namespaces, on a ``load_guard``
        that is not ``auto``, ``off`` or a number of tokens, and on a
        ``prefill_tokens_per_s`` that is not a positive number."""
        extra = dict(extra or {})
        check_keys(extra)
        names = {extra[k] for k in ("namespace", "ray_namespace") if extra.get(k)}
        if len(names) > 1:
            raise ValueError(f"raykv: \"namespace\" ({extra['namespace']!r}) and its alias "
                             f"\"ray_namespace\" ({extra['ray_namespace']!r}) differ: give "
                             "one")
        return cls(ray_address=extra.get("ray_address") or None,
                   namespace=names.pop() if names else NAMESPACE,
                   auth_mode=extra.get("ray_auth_mode") or None,
                   node_id=extra.get("ray_node_id") or None,
                   zero_copy=bool(extra.get("zero_copy", True)),
                   allocator=extra.get("allocator"),
                   staging_pages=int(extra.get("staging_pages", STAGING_PAGES)),
                   interface_v1=bool(extra.get("interface_v1")),
                   load_guard=_load_guard(extra.get("load_guard")),
                   prefill_s_per_token=_prefill_rate(extra.get("prefill_tokens_per_s")))


def _load_guard(value: object) -> GuardSettings:
    """``GuardSettings.parse`` with the key named in its error."""
    try:
        return GuardSettings.parse(value)
    except ValueError as e:
        raise ValueError(f"raykv: --hicache-storage-backend-extra-config {e}") from None


def _prefill_rate(value: object) -> float | None:
    """Seconds per token of ``prefill_tokens_per_s`` (None: not given); ``ValueError``
    unless a positive finite number (or a string of one)."""
    if value is None:
        return None
    rate = value
    if isinstance(value, str):
        try:
            rate = float(value)
        except ValueError:
            rate = None
    if isinstance(rate, bool) or not isinstance(rate, int | float) or \
            not math.isfinite(rate) or rate <= 0:
        raise ValueError(f"raykv: --hicache-storage-backend-extra-config "
                         f"prefill_tokens_per_s {value!r}: expected a positive number of "
                         "prompt tokens the engine prefills per second")
    return 1.0 / rate
