"""A rank's circuit breaker and its retry after a restart, against a real two-node
cluster (real Ray, a real ``mooncake_master``, embedded node actors).

- A node actor stopped with SIGSTOP: the rank's first data call runs into its
  deadline, which opens its breaker; every further call fails at once
  (``CircuitOpenError``) without being sent (the breaker's counters: rejected, not
  admitted); after SIGCONT its probe finds the actor and the rank's calls hit again.
- A node actor killed and restarted by Ray: the rank's next call, whose idle channel
  connection the old actor's death broke, succeeds without raising (control: with the
  retry off it raises ``NodeUnavailableError``: broken pipe).

Each call's duration is printed (``-s``), never asserted: no wall-clock thresholds.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import ray
from raykv.cache_actors.errors import (
    CircuitOpenError,
    DeadlineExceededError,
    NodeUnavailableError,
)
from raykv.controllers import StorageConfig
from raykv.controllers.naming import node_actor_name

from tests.integration.deadline_bound import within
from tests.integration.process_stop import stop_process
from tests.integration.ranks import indices, start_rank

N = 4
FAST = 6  # calls made while the breaker is open
RECOVER_S = 30.0  # bound of the poll for hits after SIGCONT / a restart (a hang guard)


def cfg(timeout_s: float) -> StorageConfig:
    return StorageConfig(model_name="org/breaker", extra_config={"timeout_s": timeout_s})


def outcome(call) -> tuple[float, object]:
    """(seconds, value or exception) of ``call()``."""
    t = time.monotonic()
    try:
        value = call()
    except Exception as e:  # the outcome under test
        value = e
    return time.monotonic() - t, value


def actor_pid(cluster, node_id: str) -> int:
    actor = ray.get_actor(node_actor_name(node_id), namespace=cluster.namespace)
    return ray.get(actor.health.remote(), timeout=60)["pid"]


def test_a_stopped_node_actor_opens_the_breaker_then_a_probe_finds_it_again(cluster, uid):
    node = cluster.node_ids[0]
    rank = start_rank(node, cfg(1.0))
    keys = [f"{uid}-{i}" for i in range(N)]
    ray.get(rank.fill.remote(1))
    assert ray.get(rank.call.remote("batch_set_v1", keys, indices(0, N))) == [True] * N
    get = lambda: ray.get(rank.call.remote("batch_get_v1", keys, indices(32, N)))  # noqa: E731
    assert get() == [True] * N
    assert ray.get(rank.call.remote("breaker_counts"))["state"] == "closed"

    pid = actor_pid(cluster, node)
    stop_process(pid)
    try:
        slow = [outcome(get)]
        before = ray.get(rank.call.remote("breaker_counts"))
        fast = [outcome(get) for _ in range(FAST)]
        after = ray.get(rank.call.remote("breaker_counts"))
    finally:
        os.kill(pid, signal.SIGCONT)
    print("\nwaited (s), deadline failure:", [round(s, 3) for s, _ in slow])
    print("waited (s), failed at once:", [round(s, 3) for s, _ in fast])
    assert all(isinstance(v, DeadlineExceededError) for _, v in slow), slow
    # the documented bounds: one deadline, then at once (``deadline_bound``)
    assert all(within(s, 1.0) for s, _ in slow), slow
    assert all(within(s, 0.0) for s, _ in fast), fast
    assert before["state"] == "open" and before["opened"] == 1, before
    assert all(isinstance(v, CircuitOpenError) for _, v in fast), fast
    # none of them was sent: each one rejected, none admitted
    assert after["rejected"] - before["rejected"] == FAST
    assert after["admitted"] == before["admitted"]

    tries, got, end = 0, None, time.monotonic() + RECOVER_S
    while got != [True] * N and time.monotonic() < end:
        tries += 1
        _, got = outcome(get)
        if got != [True] * N:
            time.sleep(0.1)
    counts = ray.get(rank.call.remote("breaker_counts"))
    print(f"hits again after {tries} calls; breaker: {counts}")
    assert got == [True] * N
    assert counts["state"] == "closed" and counts["answers"] >= 1 and counts["trials"] >= 1
    assert ray.get(rank.pages.remote(32, N)).equal(ray.get(rank.pages.remote(0, N)))


@pytest.mark.parametrize("retry", [True, False], ids=["retry", "control-no-retry"])
def test_the_first_call_after_a_restart_succeeds(cluster, uid, retry):
    node = cluster.node_ids[1]
    rank = start_rank(node, cfg(5.0))
    ray.get(rank.retry_unsent.remote(retry))
    ray.get(rank.fill.remote(2))
    # a data call over the channel: its connection stays idle for the next one (no put:
    # right after the other case's kill, puts may still land on the dead segment)
    assert ray.get(rank.call.remote("batch_exists", [f"{uid}-before"])) == 0

    old = actor_pid(cluster, node)
    os.kill(old, signal.SIGKILL)
    end = time.monotonic() + RECOVER_S
    while True:  # until Ray restarted it and the new actor answers
        try:
            if actor_pid(cluster, node) != old:
                break
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        assert time.monotonic() < end, "the node actor was not restarted"
        time.sleep(0.2)

    seconds, value = outcome(lambda: ray.get(rank.call.remote(
        "batch_set_v1", [f"{uid}-after"], indices(16, 1))))
    print(f"\nfirst call after the restart ({seconds:.3f} s): {value!r}")
    if retry:
        assert isinstance(value, list) and len(value) == 1, value
    else:
        assert isinstance(value, NodeUnavailableError), value
        assert "Broken pipe" in str(value), value
