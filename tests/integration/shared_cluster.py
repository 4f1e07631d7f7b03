"""One two-node embedded cluster per test process, shared by the modules of
``SHARED_CLUSTER_MODULES`` (``tests/work_units.py``: one work unit, so one worker runs
them one after another): a cluster's start and stop cost ~30 CPU-s on these 2 cores.

A module gets the cluster only as the module before it found it: after each module,
``give_back`` compares the cluster with what it was when it started (its nodes, the
pid of every node actor, of the controller and of the reconciler, every node actor
answering and not stopped, no store call of a node actor patched by a test) and stops
it when anything differs (a killed or restarted actor, a hook left set); the next
module then starts a fresh one. What a module stores stays in the store: every test
writes under its own key namespace (``uid``).
"""

from __future__ import annotations

import contextlib

_held: contextlib.ExitStack | None = None
_cluster = None
_found: dict | None = None


def _pid(actor) -> int:
    import ray

    def pid(_actor) -> int:  # runs in the actor's process
        import os

        return os.getpid()

    return ray.get(actor.__ray_call__.remote(pid), timeout=30)


def _store_calls_plain(actor) -> bool:
    import ray

    def plain(_actor) -> bool:  # runs in the node actor's process
        from raykv.cache_actors.node.mooncake_backend import MooncakeBackend

        return not any(hasattr(getattr(MooncakeBackend, op), "__wrapped__")
                       for op in ("put", "get"))

    return ray.get(actor.__ray_call__.remote(plain), timeout=30)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP) or gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in "Tt"
    except OSError:
        return True


def _state(cluster) -> dict:
    """What must be the same before and after a module: node ids and actor pids."""
    nodes = {n: _pid(a) for n, a in cluster.node_actors.items()}
    return {"nodes": nodes, "controller": _pid(cluster.controller),
            "reconciler": _pid(cluster.reconciler)}


def _as_found(cluster) -> bool:
    try:
        state = _state(cluster)
        return (state == _found and not any(map(_stopped, state["nodes"].values()))
                and all(_store_calls_plain(a) for a in cluster.node_actors.values()))
    except Exception:  # an actor that does not answer: not as found
        return False


def take():
    """The held cluster, started now if none is held."""
    global _held, _cluster, _found
    if _cluster is None:
        from tests.integration.conftest import two_nodes

        stack = contextlib.ExitStack()
        _cluster = stack.enter_context(two_nodes("embedded"))
        _held = stack
        _found = _state(_cluster)
    return _cluster


def give_back(cluster) -> None:
    """After a module: keep ``cluster`` for the next module if the module left it as it
    found it, else stop it."""
    if cluster is not _cluster or not _as_found(cluster):
        stop()


def holding() -> bool:
    return _cluster is not None


def stop() -> None:
    """Stop the held cluster, if any."""
    global _held, _cluster, _found
    held, _held, _cluster, _found = _held, None, None, None
    if held is not None:
        held.close()
