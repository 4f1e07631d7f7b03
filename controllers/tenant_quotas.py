"""Per-tenant host-memory quotas of a node (pure: no Ray, no Mooncake).

A *quota* bounds the bytes of host pools (L2) one tenant's deployments hold on one node:
every pool whose owner names the tenant counts, staging pools and adopted engine pools
included, each pool once, as the node's ``host_pool_bytes`` budget counts them. A pool
that would put its tenant over its quota is refused at creation (or adoption), before
anything is allocated; other tenants are unaffected. A tenant without a quota is
bounded by the node's ``host_pool_bytes`` alone.

Pools without a tenant (a deployment without one, and legacy pools without an owner)
need no secret to make, so they share one bound of their own (``untenanted_bound``):
``NodeSettings.untenanted_pool_bytes``, by default ``UNTENANTED_SHARE`` of the node's
memory in embedded mode (standalone: ``host_pool_bytes`` bounds every pool already). A
pool that would take them over it is refused as a tenant's over its quota is; pools of
tenants are unaffected, so callers without a tenant cannot take the node's memory from
them.
"""

from __future__ import annotations

from collections.abc import Mapping

from raykv.controllers.tenancy import check_tenant

UNTENANTED_SHARE = 0.5
"""Of a node's memory, what its pools without a tenant may hold together by default
(embedded mode)."""


def untenanted_bound(setting: int | None, standalone: bool, memory_bytes: int) -> int:
    """The most bytes a node's pools without a tenant may hold together (0: no bound of
    their own): ``setting`` when given (0: none), else ``UNTENANTED_SHARE`` of
    ``memory_bytes`` (the node's memory) in embedded mode and none in standalone mode,
    where ``host_pool_bytes`` bounds every pool."""
    if setting is not None:
        return setting
    return 0 if standalone else int(memory_bytes * UNTENANTED_SHARE)


def check_untenanted_fits(bound: int, pool: str, nbytes: int, used: int) -> None:
    """``ValueError`` naming the numbers if pool ``pool`` of ``nbytes`` would take the
    pools without a tenant (which hold ``used`` bytes here) over ``bound`` (0: none)."""
    if bound and used + nbytes > bound:
        raise ValueError(
            f"the pools without a tenant are over their bound on this node: pool {pool!r} "
            f"needs {nbytes} bytes, they use {used} of {bound} bytes ({bound - used} left); "
            "destroy one of them, make the pool smaller, run the deployment under a "
            "tenant, or raise the bound (`raykv up --untenanted-pool-size`, "
            "local_settings(untenanted_pool_bytes=...))")


def check_tenant_quotas(quotas: object) -> dict[str, int]:
    """``quotas`` as a dict of tenant name -> bytes (each a valid tenant name and an
    ``int`` > 0), else ``ValueError`` naming the bad entry."""
    if not isinstance(quotas, Mapping):
        raise ValueError(f"tenant quotas must be a mapping of tenant -> bytes, got "
                         f"{type(quotas).__name__}")
    out = {}
    for tenant, nbytes in quotas.items():
        check_tenant(tenant)
        if type(nbytes) is not int or nbytes <= 0:
            raise ValueError(f"the quota of tenant {tenant!r} must be a number of bytes > 0, "
                             f"got {nbytes!r}")
        out[tenant] = nbytes
    return out


def check_fits(quotas: Mapping[str, int], tenant: str | None, pool: str, nbytes: int,
               used: int) -> None:
    """``ValueError`` naming the tenant, its quota and its use if pool ``pool`` of
    ``nbytes`` would put ``tenant`` (whose pools here hold ``used`` bytes) over its
    quota; nothing for a pool without a tenant or a tenant without a quota."""
    quota = quotas.get(tenant) if tenant is not None else None
    if quota is not None and used + nbytes > quota:
        raise ValueError(
            f"tenant {tenant!r} is over its quota on this node: pool {pool!r} needs {nbytes} "
            f"bytes, the tenant's pools here use {used} of its quota of {quota} bytes "
            f"({quota - used} left); destroy one of its pools, make the pool smaller or "
            "raise the quota (`raykv up --tenant-quota`, local_settings(tenant_quotas=...))")
