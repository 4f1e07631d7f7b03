"""Joining the raykv cluster's Ray from an engine process (Ray only: no engine import).

Both engine integrations call ``join_ray`` from the process the engine runs them in
(SGLang's scheduler, vLLM's engine core and workers), which is often a plain process
even when the engine itself runs in a Ray actor.
"""

from __future__ import annotations

import logging
import os
import random

from raykv.cache_actors.ray_auth_mode import join_mode

log = logging.getLogger("raykv.integrations")


def inherited_ray_node() -> tuple[str, str] | None:
    """``(node id, GCS address)`` of the Ray node this process belongs to when it descends
    from a Ray worker without being one (an engine's processes started inside a Ray
    actor), else None.

    Ray gives every worker its raylet's pid (``RAY_RAYLET_PID``) and processes a worker
    starts inherit it; the raylet's command line names its node and GCS (``--node_id``,
    ``--gcs-address``; Ray's own ``find_node_ids`` reads the same flags). None when the
    variable is unset or that raylet cannot be read (another PID namespace, gone).
    """
    pid = os.environ.get("RAY_RAYLET_PID", "")
    if not pid.isdigit():
        return None
    import psutil

    try:
        args = psutil.Process(int(pid)).cmdline()
    except psutil.Error:
        return None
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    node, gcs = flags.get("--node_id"), flags.get("--gcs-address")
    return (node, gcs) if node and gcs else None


def join_ray(address: str | None, namespace: str, auth_mode: str | None = None
             ) -> str | None:
    """Connect this process to the raykv cluster unless it already is (a Ray worker, or
    a process that joined before); return the node whose node actor it should use
    (None: the node Ray attached this process to).

    Address: ``address``, else ``$RAY_ADDRESS``, else the cluster of the Ray node this
    process descends from (``inherited_ray_node``), else ``auto`` (the cluster ``ray
    start`` made on this machine; Ray's ``ConnectionError`` if there is none).
    Authentication: ``cache_actors.ray_auth_mode.join_mode(auth_mode)`` (``auth_mode``,
    else ``RAY_AUTH_MODE``, else ``token`` when a token is at hand), set with Ray's
    cached config refreshed: an engine imported Ray, which read the mode, long before
    it joins.
    Randomness: ``ray.init`` draws the ids of its GCS subscribers from Python's
    ``random``, which engines seed (vLLM and SGLang seed every process alike): every
    engine process would subscribe under one id, and the GCS answers each of their
    long polls at once to serve the next, a loop that kept a core busy. ``ray.init``
    therefore runs on fresh entropy, and the caller's ``random`` state is given back
    as it was (joining draws nothing from the engine's seeded stream). The node:
    Ray attaches a joining process to a raylet of its machine (the head node's when a
    machine runs several, as tests do); a process that descends from another alive
    node's worker uses that node instead.
    """
    import ray

    inherited = inherited_ray_node()
    if not ray.is_initialized():
        address = (address or os.environ.get("RAY_ADDRESS")
                   or (inherited[1] if inherited else None) or "auto")
        join_mode(auth_mode)
        seeded = random.getstate()
        random.seed()  # from os.urandom: see "Randomness" above
        try:
            ray.init(address=address, namespace=namespace, log_to_driver=False,
                     include_dashboard=False, logging_level=logging.WARNING)
        finally:
            random.setstate(seeded)
        log.info("raykv joined Ray at %s (pid %d)", address, os.getpid())
    if inherited is None or inherited[0] == ray.get_runtime_context().get_node_id():
        return None
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return inherited[0] if inherited[0] in alive else None
