"""Deadlines against a real two-node cluster: a node actor stopped with SIGSTOP (hung,
from its callers' side) fails every call that waits on it within the caller's deadline,
over both routes (the local channel of its own node's ranks, a Ray call from a rank on
another node), never runs them late, and serves again once it is continued.

Each call runs in a thread joined with a bound far above the deadline, so that a call
that hangs (the code before deadlines: socket reads and ``ray.get`` without a timeout)
fails the test instead of hanging the suite; each must have returned within the
documented bound (``deadline_bound``: ``timeout_s``, with a margin for a loaded host).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import ray
from raykv.cache_actors.errors import DeadlineExceededError, NodeUnavailableError
from raykv.controllers import PoolName, PoolTransfer, StorageConfig
from raykv.controllers.naming import CONTROLLER_NAME, node_actor_name

from tests.integration.deadline_bound import bound_s, within
from tests.integration.process_stop import stop_process
from tests.integration.ranks import indices, start_rank

N = 4
TIMEOUT_S = 1.0
HANG_S = 30.0  # a call still running after this long is taken as hung


def cfg(tp_rank: int) -> StorageConfig:
    return StorageConfig(model_name="org/deadline", tp_rank=tp_rank, tp_size=2,
                         extra_config={"timeout_s": TIMEOUT_S})


def timed(call) -> tuple[float, object]:
    """(seconds, result or exception) of ``call()`` run in a thread; ``(inf, None)`` if
    it is still running after ``HANG_S``."""
    out: list = []

    def run() -> None:
        t = time.monotonic()
        try:
            value = call()
        except Exception as e:  # the outcome under test
            value = e
        out.append((time.monotonic() - t, value))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(HANG_S)
    return out[0] if out else (float("inf"), None)


def unavailable(outcome: tuple[float, object]) -> bool:
    """A retryable error within the documented bound of the call's deadline."""
    seconds, value = outcome
    return isinstance(value, NodeUnavailableError) and within(seconds, TIMEOUT_S)


def settle(ok, wait_s: float = 60.0) -> None:
    """Call ``ok()`` until it is true (a retryable error counts as not yet), at most
    ``wait_s`` seconds."""
    end = time.monotonic() + wait_s
    while True:
        with contextlib.suppress(NodeUnavailableError):
            if ok():
                return
        assert time.monotonic() < end, "no hit after the actor was continued"
        time.sleep(0.2)


def home_node(cluster) -> str:
    """The node whose actor answers the group queries of the deployment of ``cfg``."""
    controller = ray.get_actor(CONTROLLER_NAME, namespace=cluster.namespace)
    deployments = ray.get(controller.deployments.remote())
    (dep,) = [d for d in deployments.values() if d["model_name"] == "org/deadline"]
    return dep["home_node"]


def stored(rank, keys: list[str], slot: int) -> list[bool]:
    """``batch_set_v1`` of ``keys`` from ``slot``, sent again (at most 30 s) while it
    fails at its deadline: a fresh rank's first put sets up its transfer connections,
    which on a loaded host can take longer than ``TIMEOUT_S``."""
    end = time.monotonic() + 30
    while True:
        try:
            return ray.get(rank.call.remote("batch_set_v1", keys, indices(slot, len(keys))))
        except DeadlineExceededError:
            if time.monotonic() > end:
                raise


def deployment(cluster, uid: str):
    """Two ranks of one deployment, one per node, each holding ``N`` stored pages; returns
    (home rank, other rank, keys, the calls under test by name). The home rank is on the
    node whose actor answers the group's queries: its data calls and group queries go
    over the channel, the other rank's group queries over Ray."""
    ranks = {n: start_rank(n, cfg(i)) for i, n in enumerate(cluster.node_ids)}
    keys = [f"{uid}-{i}" for i in range(N)]
    for seed, rank in enumerate(ranks.values()):
        ray.get(rank.fill.remote(seed))
        assert stored(rank, keys, 0) == [True] * N
        assert ray.get(rank.call.remote("batch_exists", keys)) == N
    for rank in ranks.values():  # registers the group
        assert ray.get(rank.call.remote("group_exists", keys)).kv_hit_pages == N
    node = home_node(cluster)
    home = ranks[node]
    (other,) = [r for n, r in ranks.items() if n != node]
    asked = keys + [f"{uid}-unasked"]  # no shared recent answer for these
    calls = {
        "channel batch_get_v1": lambda: ray.get(home.call.remote(
            "batch_get_v1", keys, indices(32, N))),
        "channel batch_set_v2": lambda: ray.get(home.call.remote(
            "batch_set_v2", [PoolTransfer(PoolName.KV, [f"{uid}-new"], indices(16, 1))])),
        "channel batch_exists": lambda: ray.get(home.call.remote("batch_exists", asked)),
        "channel group_exists": lambda: ray.get(home.call.remote("group_exists", asked)),
        "Ray group_exists": lambda: ray.get(other.call.remote("group_exists", asked)),
    }
    return home, other, keys, calls


def test_a_stopped_node_actor_fails_calls_at_their_deadline_then_serves_again(cluster, uid):
    home, other, keys, calls = deployment(cluster, uid)
    actor = ray.get_actor(node_actor_name(home_node(cluster)), namespace=cluster.namespace)
    pid = ray.get(actor.health.remote())["pid"]
    outcomes = {}
    for what, call in calls.items():  # each one the first call on the stopped actor
        stop_process(pid)
        try:
            outcomes[what] = timed(call)
        finally:
            os.kill(pid, signal.SIGCONT)
        # the deadline opened the rank's circuit breaker: wait until its probe found the
        # actor again (a hit closes it), so the next call waits on the actor once more
        settle(lambda: ray.get(home.call.remote("batch_exists", keys)) == N)
        settle(lambda: ray.get(other.call.remote("group_exists", keys)).kv_hit_pages == N)
    for what, outcome in outcomes.items():
        assert unavailable(outcome), f"{what}: {outcome}"
        assert isinstance(outcome[1], DeadlineExceededError), f"{what}: {outcome}"

    # Hits resume once the actor runs again (its first calls may still be busy with the
    # requests that expired meanwhile).
    deadline = time.monotonic() + 60
    while True:
        seconds, got = timed(lambda: ray.get(home.call.remote(
            "batch_get_v1", keys, indices(32, N))))
        if got == [True] * N or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == [True] * N
    assert ray.get(other.call.remote("group_exists", keys)).kv_hit_pages == N
    # The put that failed at its deadline was never run late (it would have stored what
    # the rank's slots held by then, under a key the rank was told is not stored).
    assert ray.get(home.call.remote("batch_exists", [f"{uid}-new"])) == 0
    wrote = ray.get(home.pages.remote(0, N))
    assert bool((ray.get(home.pages.remote(32, N)) == wrote).all())


def test_control_without_a_stop_every_call_answers_within_the_deadline(cluster, uid):
    """Control for the test above: the same calls on a running actor answer normally, so
    the errors above come from the stop, not from a deadline too short for this host."""
    home, other, keys, calls = deployment(cluster, uid)
    outcomes = {what: timed(call) for what, call in calls.items()}
    for what, (seconds, value) in outcomes.items():
        assert not isinstance(value, Exception), f"{what}: {value}"
        assert within(seconds, TIMEOUT_S), f"{what}: {seconds:.2f} s > {bound_s(TIMEOUT_S)}"
    assert outcomes["channel batch_get_v1"][1] == [True] * N
    assert outcomes["channel batch_set_v2"][1] == {PoolName.KV: [True]}
    assert outcomes["channel batch_exists"][1] == N
    assert outcomes["channel group_exists"][1].kv_hit_pages == N
    assert outcomes["Ray group_exists"][1].kv_hit_pages == N
