"""The node actor's data operations, one name each for both routes a rank has to it.

A rank reaches its node's cache actor through the actor's local channel (same node) or
through a Ray call (another node, or no channel); a ``DataOp``'s value is the name of
the actor's Ray method *and* the op name its channel serves, so the two routes can never
disagree on what an operation is called.
"""

from __future__ import annotations

from enum import StrEnum


class DataOp(StrEnum):
    """A data operation of ``NodeCacheActor`` (arguments and codes: see its methods)."""

    EXISTS = "exists"
    PUT = "put"
    GET = "get"
    GROUP_EXISTS = "group_exists"


# Ops the channel answers asynchronously (a group query joins a batch of queries).
ASYNC_OPS = frozenset({DataOp.GROUP_EXISTS})
