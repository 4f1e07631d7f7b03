"""Node actors run where engines run: one starts when a rank starts on a node without
one, retires once the node has had no engine for the idle period, and leaves a node Ray
drains (real Ray nodes, a real master; Ray's real autoscaler: test_autoscaler.py)."""

import time

import pytest
import ray
from raykv import start_local
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.clusters.node_actors import named_node_actors
from raykv.controllers import NAMESPACE, StorageConfig, node_actor_name
from raykv.controllers.node_lifecycle import LifecycleSettings
from raykv.controllers.pool_layout import MiB

from tests.integration.ranks import indices, start_rank

IDLE_S = 2.0


def has_actor(node_id: str) -> bool:
    return node_actor_name(node_id) in named_node_actors(NAMESPACE)


def wait_until(what, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what.__doc__}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    with start_local(num_nodes=3, global_segment_size=64 * MiB,
                     lifecycle=LifecycleSettings(retire_idle_s=IDLE_S, drain=False)) as c:
        yield c


def test_node_actors_start_with_engines_and_retire_without(cluster, uid):
    head, worker = cluster.node_ids[0], cluster.node_ids[1]
    assert has_actor(head) and not has_actor(worker)  # no engine there yet

    rank = start_rank(worker, StorageConfig())  # asks for its node actor
    assert has_actor(worker)
    assert worker in ray.get(cluster.controller.nodes.remote())
    keys = [f"{uid}-{i}" for i in range(4)]
    ray.get(rank.fill.remote(1))
    assert ray.get(rank.call.remote("batch_set_v1", keys, indices(0, 4))) == [True] * 4
    time.sleep(2 * IDLE_S)
    assert has_actor(worker)  # an engine runs there: kept past the idle period

    ray.kill(rank)

    def retired():
        """the node actor of the node without engines retired"""
        return not has_actor(worker) and worker not in ray.get(
            cluster.controller.nodes.remote())
    wait_until(retired)
    assert has_actor(head)  # the head node keeps its own for good

    again = start_rank(worker, StorageConfig())  # an engine brings it back
    assert has_actor(worker)
    ray.kill(again)


def test_a_ray_drain_stops_the_node_actor_and_keeps_it_off(cluster, uid):
    node = cluster.node_ids[2]
    rank = start_rank(node, StorageConfig())
    ray.get(rank.fill.remote(2))
    keys = [f"{uid}-{i}" for i in range(4)]
    assert ray.get(rank.call.remote("batch_set_v1", keys, indices(0, 4))) == [True] * 4

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    deadline_ms = int((time.time() + 20) * 1000)
    accepted, why = gcs.drain_node(node, 2, "test preemption", deadline_ms)
    assert accepted, why

    def stopped():
        """the draining node's actor stopped"""
        return not has_actor(node)
    wait_until(stopped)
    # the rank still runs there: its calls fail at once, never hang; no actor comes back
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(rank.call.remote("batch_get_v1", keys, indices(0, 4)), timeout=60)
    assert isinstance(e.value.cause, NodeUnavailableError)
    reconciler = cluster.reconciler
    with pytest.raises(ray.exceptions.RayTaskError, match="draining"):
        ray.get(reconciler.want.remote(node))
    assert not has_actor(node)
    report = ray.get(reconciler.leaving.remote())["reports"][node]
    assert report.get("outcome") == "stopped", report
