"""A node's store calls on batches of its pools' objects: what ``put`` and ``get`` of the
ranks, L2's fills and L2's write-behind all go through (``NodeService`` and ``L2Pools``
hold one ``StoreMover`` each: the same).

``move`` runs the store backend's ``op`` on every object of a batch its caller may move
(the others answer ``NOT_OWNED``, before any byte moves), once the store is up and
against one generation of the node's pools, counted in flight on the pools it uses (a
pool being removed waits for it: ``NodePools.enter``), under the rank's ticket
(``cache_actors.tickets``), merged with the store calls queued beside it
(``TransferMerger``); each outcome is counted (``NodeMetrics``), told the residency log
(a put on the node's own segment) and the touch journal. ``verify`` checks an owner
claim against the node's bindings.

Threads: any data thread of the node calls ``move`` and ``verify``; the parts lock
themselves.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from raykv.cache_actors.errors import DeadlineExceededError, NodeUnavailableError
from raykv.cache_actors.node.node_pools import NodePools, replaced_during
from raykv.cache_actors.node.node_store import NodeStore
from raykv.cache_actors.node.owner_masks import allowed, merged, refused
from raykv.cache_actors.node.residency_log import ResidencyLog
from raykv.cache_actors.node.ticket_desk import TicketDesk
from raykv.cache_actors.node.touch_journal import TouchJournal
from raykv.cache_actors.node.transfer_merger import TransferMerger
from raykv.cache_actors.tickets import TicketRef, check_deadline
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.owner_sessions import UnknownSessionError
from raykv.controllers.ownership import OwnerClaim
from raykv.controllers.result_codes import NOT_OWNED

if TYPE_CHECKING:
    from raykv.cache_actors.node.node_metrics import NodeMetrics

WAIT_S = 30.0
"""Longest a data call waits inside the node actor for its turn (a queued put/get, a group
query's answer) when its caller gave no deadline of its own, in seconds: a stuck store
call then fails the calls queued behind it with ``DeadlineExceededError`` instead of
holding their threads for good."""


class StoreMover:
    """See the module docstring: the node's ``store``, ``pools``, ``merger`` (its store
    calls), ``tickets``, ``metrics``, ``residency_log`` and ``touches``."""

    def __init__(self, store: NodeStore, pools: NodePools, merger: TransferMerger,
                 tickets: TicketDesk, metrics: NodeMetrics, residency_log: ResidencyLog,
                 touches: TouchJournal) -> None:
        self._store, self._pools, self._merger = store, pools, merger
        self._tickets, self._metrics = tickets, metrics
        self._residency_log, self._touches = residency_log, touches

    def verify(self, claim: OwnerClaim | None) -> OwnerClaim | None:
        """``claim`` once checked against this node's bindings (``OwnerBindings``; a
        tenant's call proof is accepted once); ``ValueError`` naming the conflict,
        ``NodeUnavailableError`` (retryable: the rank opens a new session) if its owner
        session is not open here (this actor restarted or closed it)."""
        try:
            return self._pools.owners.verify(claim)
        except UnknownSessionError as e:
            raise NodeUnavailableError(str(e)) from None

    def move(self, op: str, batch: ObjectBatch, deadline: float | None,
             claim: OwnerClaim | None, ticket: TicketRef | None = None,
             verified: bool = True) -> list[int]:
        """The backend's ``op`` (``put`` or ``get``) on ``batch``, one code per object
        (see the module docstring). ``deadline``: ``time.monotonic()`` seconds (None:
        ``WAIT_S`` from now); ``DeadlineExceededError`` if it passed before the store
        call could start. ``claim``: the owner claim, checked here unless ``verified``.
        ``ticket``: the rank's (None: none)."""
        deadline = time.monotonic() + WAIT_S if deadline is None else check_deadline(deadline)
        held = None if ticket is None else self._tickets.ticket(ticket, deadline)
        if time.monotonic() >= deadline:
            raise DeadlineExceededError(f"{op} reached the node actor after its deadline; "
                                        "it was not run")
        self._store.before_call()
        pools = self._pools
        table = pools.table
        ptrs, used = table.resolve(batch)
        claim = claim if verified else self.verify(claim)
        masked = refused(batch, used, table, claim)
        moving = batch if masked is None else allowed(batch, masked)
        if masked is not None:
            ptrs = [p for p, no in zip(ptrs, masked, strict=True) if not no]
            names = set(moving.pools)
            used = tuple(p for p in used if p.name in names)
        pools.enter(table, used)
        try:
            t = time.perf_counter()
            codes = self._merger.run(op, moving.keys, ptrs, moving.sizes, deadline,
                                     held) if len(moving) else []
        finally:
            pools.leave(used)
        if pools.table.epoch != table.epoch:
            replaced_during(op, moving, codes, table.epoch, pools.table.epoch,
                            self._store.backend.remove)
        codes = self._store.after_call(table.epoch, codes)
        if op == "put" and self._store.backend.prefers_own:
            self._residency_log.stored(moving.keys, codes, claim)
        self._touches.moved(op, moving.keys, moving.sizes, codes, time.time())
        if masked is not None:
            codes = merged(codes, masked, NOT_OWNED)
        self._metrics.record_move(op, batch, codes, time.perf_counter() - t)
        return codes
