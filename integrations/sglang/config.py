"""SGLang's HiCache config in raykv terms (pure: no SGLang, no Ray import).

``storage_config`` reads SGLang's ``HiCacheStorageConfig`` by its field names, so it
runs (and is tested) without SGLang; ``BackendOptions`` holds the extra-config keys the
backend itself reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raykv.controllers.contract import PoolName, StorageConfig
from raykv.controllers.naming import NAMESPACE

SUPPORTED_POOLS = {p.value: p for p in PoolName}
"""SGLang pools raykv serves, by value; every other ``PoolName`` of SGLang is refused."""
STAGING_PAGES = 256
"""Pages staged per pool and direction (SGLang moves at most 128 pages per call)."""
MAMBA_STAGING_SLOTS = 16
"""Mamba slots staged per direction: they are large and move one per request (a call
with more goes through in rounds)."""
CONFIG_KEYS = ("ray_address", "ray_namespace", "ray_auth_mode", "ray_node_id", "zero_copy",
               "staging_pages", "extra_backend_tag", "timeout_s", "tenant", "model_revision")
"""extra_config keys this backend reads (SGLang's own keys pass through untouched)."""
STORAGE_KEYS = ("extra_backend_tag", "timeout_s", "tenant", "model_revision")
"""The keys of ``CONFIG_KEYS`` that ``storage_config`` hands to raykv's ``StorageConfig``.
The KV dtype and page size are not among them: SGLang's host pools carry them, and the
deployment registry refuses a rank whose pools' dtypes, page size or bytes per page
differ from its deployment's (``controllers.deployments.PoolSpec``), so with or without
a tenant a change of either is refused at attach, never read as the old bytes."""


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

    @classmethod
    def from_extra(cls, extra: dict | None) -> BackendOptions:
        extra = dict(extra or {})
        return cls(ray_address=extra.get("ray_address") or None,
                   namespace=extra.get("ray_namespace") or NAMESPACE,
                   auth_mode=extra.get("ray_auth_mode") or None,
                   node_id=extra.get("ray_node_id") or None,
                   zero_copy=bool(extra.get("zero_copy", True)),
                   allocator=extra.get("allocator"),
                   staging_pages=int(extra.get("staging_pages", STAGING_PAGES)),
                   interface_v1=bool(extra.get("interface_v1")))
