"""A node's answer to ``raykv why`` (``NodeCacheActor.why``, on a route thread): what
it knows of a list of object keys (``controllers.miss_reasons.NodeFacts``): whether
each is ready in its L2, when its L2 last evicted it (``L2Pools.evictions``), when it
last stored, read or served it (``L2Pools.touches``, the node's journal), and, when
asked (``with_store``), where the store holds it (one ``batch_is_exist``, then one
``batch_get_replica_desc`` of the keys it holds: memory segments, or the store's
disk). It never moves a byte, leases no page and touches no pool.

Owner rules as ``ResidencyQuery``'s (``controllers.ownership``): the caller's claim is
verified (a tenant's needs its call proof), every key must lie in the claim's key prefix
(a caller without one may not name a tenant's key: ``ValueError``), and L2 counts only
pools of the caller's owner. A caller learns nothing of keys it could not compute.

Bounds: at most ``MAX_BATCH_OBJECTS`` keys; a call whose thread starts after its
``deadline`` (``time.monotonic()``) is not run (``DeadlineExceededError``).

Threads: any (the node actor's ``route`` executor).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from raykv.cache_actors.errors import DeadlineExceededError
from raykv.cache_actors.node.owner_masks import outside
from raykv.controllers.miss_reasons import NodeFacts
from raykv.controllers.object_batch import check_object_keys
from raykv.controllers.ownership import OwnerClaim, for_call

if TYPE_CHECKING:
    from raykv.cache_actors.node.l2_pools import L2Pools
    from raykv.cache_actors.node.node_store import NodeStore


class WhyQuery:
    """``raykv why``'s facts of node ``node_id`` from its ``store`` and ``l2`` (its
    eviction record and the node's touch journal too); ``verify``: a caller's claim
    checked (``NodeService.verify``)."""

    def __init__(self, node_id: str, store: NodeStore, l2: L2Pools,
                 verify: Callable[[OwnerClaim | None], OwnerClaim | None]) -> None:
        self._node_id, self._store, self._l2, self._verify = node_id, store, l2, verify

    def facts(self, keys: list[str], with_store: bool, claim: OwnerClaim | None,
              deadline: float) -> NodeFacts:
        """This node's facts of ``keys`` (see the module docstring); ``claim``: the
        claim as it came, bound here to this call (``for_call``)."""
        keys = check_object_keys(keys, "raykv why's keys")
        claim = self._verify(for_call(claim, "why", keys, with_store))
        if outside(keys, claim) is not None:
            raise ValueError("keys outside the caller's key prefix (a tenant's keys need "
                             "the tenant's claim)")
        if time.monotonic() >= deadline:
            raise DeadlineExceededError("raykv why's query started after its deadline; it "
                                        "was not run")
        l2 = self._l2.resident(keys, None if claim is None else claim.owner)
        touched = {k: t.last for k, t in self._l2.touches.of(keys).items()}
        segments = stored = None
        if with_store:
            backend = self._store.backend
            epoch = self._store.before_call()
            codes = self._store.after_call(epoch, backend.exists(keys))
            if any(c < 0 for c in codes):
                raise RuntimeError("the store's lookup failed")
            stored = [c == 1 for c in codes]
            held = [k for k, s in zip(keys, stored, strict=True) if s]
            if backend.can_locate:  # only what it holds: Mooncake logs each miss
                where = backend.locate(held) if held else []
                if where is None:
                    raise RuntimeError("the store's replica lookup failed")
                found = iter(where)
                segments = [list(next(found)) if s else [] for s in stored]
        return NodeFacts(self._node_id, l2, self._l2.evictions.of(keys), touched, segments,
                         stored)
