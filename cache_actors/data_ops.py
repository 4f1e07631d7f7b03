"""The node actor's data operations, one name each for both routes a rank has to it.

A rank reaches its node's actor through the actor's local channel (same node) or
through a Ray call (another node, or no channel); a ``DataOp``'s value is the name of
the actor's Ray method, the op name its channel serves *and* the ``NodeService`` method
both call, so the two routes can never disagree on what an operation is called.
``DATA_OP_ARGS`` are the argument types the channel checks every request against before
it reaches a handler.
"""

from __future__ import annotations

from enum import StrEnum

from raykv.cache_actors.channel_codec import Signature
from raykv.controllers.deployments import PoolQuery
from raykv.controllers.object_batch import ObjectBatch


class DataOp(StrEnum):
    """A data operation of ``NodeCacheActor`` (arguments and codes: see its methods)."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    GROUP_EXISTS = "group_exists"
    L2_LOOKUP = "l2_lookup"
    L2_ACQUIRE = "l2_acquire"
    L2_RESERVE = "l2_reserve"
    L2_COMMIT = "l2_commit"


# Ops the channel answers asynchronously (a group query joins a batch of queries).
ASYNC_OPS = frozenset({DataOp.GROUP_EXISTS})
# Ops that touch pages: they carry a ticket and the caller's deadline on both routes.
TICKETED_OPS = frozenset({DataOp.PUT, DataOp.GET})
# Ops the node runs only before the caller's deadline, which they carry on both routes: the
# ticketed ones, and the L2 ops that change which pages a rank holds (one given up on never
# changes them after the rank's next op).
DEADLINE_OPS = TICKETED_OPS | {DataOp.L2_ACQUIRE, DataOp.L2_RESERVE, DataOp.L2_COMMIT}

DATA_OP_ARGS: dict[str, Signature] = {
    DataOp.EXISTS: Signature((list[str],)),
    # the batch, its ticket (book, slot, serial: cache_actors.tickets) or None
    DataOp.PUT: Signature((ObjectBatch, tuple[str, int, int] | None)),
    DataOp.GET: Signature((ObjectBatch, tuple[str, int, int] | None)),
    # deployment id, its version, the asking rank (tp, pp), its engine ("": none given),
    # page keys, extra pools
    DataOp.GROUP_EXISTS: Signature((str, int, tuple[int, int], str, list[str],
                                    list[PoolQuery])),
    # L2 (cache_actors.node.l2_pools): keys and keys per page; then the holder (pid,
    # start ticks), the L2 pool's name, keys, and fill / pages and outcomes
    DataOp.L2_LOOKUP: Signature((list[str], int)),
    DataOp.L2_ACQUIRE: Signature((tuple[int, int], str, list[str], bool)),
    DataOp.L2_RESERVE: Signature((tuple[int, int], str, list[str])),
    DataOp.L2_COMMIT: Signature((tuple[int, int], str, list[str], list[int], list[bool])),
}
"""Argument types of each data op on the channel (``NodeService``'s handlers)."""
