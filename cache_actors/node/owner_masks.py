"""Which objects of a data call its caller may not touch (pure: no Ray, no Mooncake).

A node actor serves a caller's own pools and keys only (``controllers.ownership``): the
objects of a batch that lie in another owner's pool or outside the caller's key prefix
(a caller without a key prefix: every tenant's key) fail with ``NOT_OWNED``, after the
batch passed every input check and before any byte moves. ``NodeService`` masks them
out of the store call with these functions and puts their codes back in place.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import TYPE_CHECKING

from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.ownership import TENANT_KEYS, OwnerClaim

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_pools import PoolTable


def outside(keys: list[str], claim: OwnerClaim | None) -> list[bool] | None:
    """Per key, whether it lies outside ``claim``'s key prefix (a caller without one,
    the default deployment's or one without a claim: whether it is a tenant's key);
    None if none does."""
    prefix = claim.key_prefix if claim is not None else ""
    if not prefix:
        if not any(map(str.startswith, keys, repeat(TENANT_KEYS))):
            return None
        return [k.startswith(TENANT_KEYS) for k in keys]
    if all(map(str.startswith, keys, repeat(prefix))):
        return None
    return [not k.startswith(prefix) for k in keys]


def refused(batch: ObjectBatch, used: tuple, table: PoolTable, claim: OwnerClaim | None
            ) -> list[bool] | None:
    """Per object of ``batch``, whether ``claim`` may not move it (not its owner's
    pool of ``table``, or a key outside its prefix); None if it may move every one.
    ``used``: the pools of ``table`` the batch names."""
    owner = None if claim is None else claim.owner
    foreign = {p.name for p in used if table.owners.get(p.name) != owner}
    out = outside(batch.keys, claim)
    if not foreign and out is None:
        return None
    return [pool in foreign or (out is not None and out[i])
            for i, pool in enumerate(batch.pools)]


def allowed(batch: ObjectBatch, refused: list[bool]) -> ObjectBatch:
    """The objects of ``batch`` not ``refused``, as a batch of the same epoch."""
    out = ObjectBatch(epoch=batch.epoch)
    for key, pool, off, size, no in zip(batch.keys, batch.pools, batch.offsets, batch.sizes,
                                        refused, strict=True):
        if not no:
            out.add(key, pool, off, size)
    return out


def merged(codes: list[int], refused: list[bool], code: int) -> list[int]:
    """One code per object of the whole batch: ``code`` for each ``refused`` object, the
    next of ``codes`` (those of the objects that moved, in order) for the others."""
    moved = iter(codes)
    return [code if no else next(moved) for no in refused]


def check_group_claim(deployment_id: str, claim: OwnerClaim | None,
                      claimed: Callable[[str], bool]) -> None:
    """``ValueError`` unless ``claim`` may query the group of ``deployment_id``: a
    caller of another deployment may not, nor a caller without a claim once a claim of
    that deployment was bound on this node (``claimed``)."""
    if claim is None:
        if claimed(deployment_id):
            raise ValueError(f"a group query of deployment {deployment_id!r} needs its "
                             "owner claim (a caller without one is refused)")
    elif claim.deployment_id != deployment_id:
        raise ValueError(f"a rank of deployment {claim.deployment_id!r} may not query "
                         f"the group of deployment {deployment_id!r}")

