"""Finding a node's node actor, and asking for one where there is none.

Node actors run only where they are needed (``clusters.node_lifecycle``). An engine
on a node gets its node actor from the reconciler (``NodeReconciler.want``), which starts
it, calls off its retirement or waits out a retirement already stopping it and starts a
new one, and counts the engine as that actor's before it answers (within a second or
two): from then on the node actor does not retire while the engine lives. A node that
Ray drains gets none: the engine is told so. Another node's actor is only looked up.
"""

from __future__ import annotations

from typing import Any

import ray
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.processes import ProcessIdentity
from raykv.controllers.naming import RECONCILER_NAME, node_actor_name

WANT_TIMEOUT_S = 60.0
"""Seconds a rank waits for the node actor it asked for (starting one sets up its
Mooncake client: ~1-2 s, longer on a loaded node)."""


def node_actor_of(node_id: str, namespace: str, engine: ProcessIdentity | None = None,
                  timeout_s: float = WANT_TIMEOUT_S) -> Any:
    """The node actor of ``node_id`` in ``namespace``. With ``engine`` (a process on
    that node that uses it), through the reconciler: started first if there is none,
    and ``engine`` counted as its engine before this returns. Without ``engine``,
    looked up by name, started through the reconciler only if there is none.
    ``NodeUnavailableError`` if raykv does not run there, the reconciler refuses (the
    node is draining) or it does not answer within ``timeout_s`` seconds."""
    name = node_actor_name(node_id)
    if engine is None:
        try:
            return ray.get_actor(name, namespace=namespace)
        except ValueError:
            pass
    try:
        reconciler = ray.get_actor(RECONCILER_NAME, namespace=namespace)
    except ValueError as e:
        raise NodeUnavailableError(
            f"no raykv node actor on node {node_id[:12]} (namespace {namespace!r}); "
            "is raykv running on this cluster?") from e
    try:
        ray.get(reconciler.want.remote(node_id, engine), timeout=timeout_s)
        return ray.get_actor(name, namespace=namespace)
    except ray.exceptions.GetTimeoutError:
        raise NodeUnavailableError(
            f"the node actor of node {node_id[:12]} did not start within {timeout_s:g} s; "
            "retry later") from None
    except (ValueError, ray.exceptions.RayError) as e:
        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
        raise NodeUnavailableError(
            f"no raykv node actor on node {node_id[:12]}: {cause}") from None
