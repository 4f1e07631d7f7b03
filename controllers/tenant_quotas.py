"""Per-tenant host-memory quotas of a node (pure: no Ray, no Mooncake).

A *quota* bounds the bytes of host pools (L2) one tenant's deployments hold on one node:
every pool whose owner names the tenant counts, staging pools and adopted engine pools
included, each pool once, as the node's ``host_pool_bytes`` budget counts them. A pool
that would put its tenant over its quota is refused at creation (or adoption), before
anything is allocated; other tenants are unaffected. Pools without a tenant (a
deployment without one, and legacy pools without an owner) count under no quota; only
the node's ``host_pool_bytes`` bounds them. A tenant without a quota is bounded by that
budget alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from raykv.controllers.tenancy import check_tenant


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
            "raise the quota (`raykv up --tenant-quota`, start_local(tenant_quotas=...))")
