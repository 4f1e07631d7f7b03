"""Node actors run where ranks run: one starts when a rank starts on a node without one,
retires (draining first) once the node has had no rank for the idle period, and drains
and leaves a node Ray drains, within Ray's deadline (real Ray nodes, a real master;
Ray's real autoscaler: test_autoscaler.py)."""

import os
import subprocess
import time

import pytest
import ray
from raykv import local_settings, start_local
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.processes import ProcessIdentity
from raykv.clusters.node_actors import named_node_actors
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.controllers import NAMESPACE, StorageConfig, node_actor_name
from raykv.controllers.pool_layout import MiB

from tests.integration.drain_ranks import POOL_PAGES, drain_rank
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
    with start_local(settings=local_settings(global_segment_size=64 * MiB), num_nodes=3,
                     lifecycle=LifecycleSettings(retire_idle_s=IDLE_S, drain_timeout_s=30)) as c:
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
    pid = ray.get(again.__ray_call__.remote(lambda _: os.getpid()))
    ray.kill(again)

    def gone():
        """the killed rank's process exited"""
        return not os.path.exists(f"/proc/{pid}")
    wait_until(gone)
    # an engine that asks is counted before the answer: no idle period can retire its
    # node actor between the two (control: asking without an engine counts none)
    ray.get(cluster.reconciler.want.remote(worker))
    actor = ray.get_actor(node_actor_name(worker), namespace=NAMESPACE)
    assert ray.get(actor.engines.remote()) == 0
    engine = subprocess.Popen(["sleep", "60"])
    try:
        ray.get(cluster.reconciler.want.remote(worker, ProcessIdentity.of(engine.pid)))
        actor = ray.get_actor(node_actor_name(worker), namespace=NAMESPACE)
        assert ray.get(actor.engines.remote()) == 1
    finally:
        engine.kill()
        engine.wait()


def test_a_ray_drain_saves_the_hottest_by_its_deadline_and_keeps_the_node_off(cluster, uid):
    """A PREEMPTION drain with a 20 s deadline on a node holding more objects than move
    in 20 s: the pages read last (the hottest) survive, the rest are misses, no page
    reads other bytes, and the node actor is gone by the deadline; no node actor comes
    back there, and a rank there gets misses at once, never a wait."""
    node, head = cluster.node_ids[2], cluster.node_ids[0]
    model = f"preempt-{uid}"
    writer = drain_rank(node, model, POOL_PAGES)
    keys = [f"{uid}-{i}" for i in range(4 * POOL_PAGES)]  # 2 objects a page: 2048 objects
    assert all(ray.get(writer.write.remote(keys)))
    hot = keys[:POOL_PAGES // 4]  # written first, read last: the hottest
    assert set(ray.get(writer.read.remote(hot))) == {"exact"}

    gcs = ray._raylet.GcsClient(address=ray.get_runtime_context().gcs_address)
    deadline = time.time() + 20
    accepted, why = gcs.drain_node(node, 2, "test preemption", int(deadline * 1000))
    assert accepted, why

    def stopped():
        """the draining node's actor stopped"""
        return not has_actor(node)
    wait_until(stopped, timeout_s=60)
    assert time.time() <= deadline + 3.0  # by the deadline (a look's period of slack)
    report = ray.get(cluster.reconciler.leaving.remote())["reports"][node]
    assert report.get("outcome") == "stopped" and report["reason"] == "preemption", report

    reader = drain_rank(head, model, POOL_PAGES)
    got = ray.get(reader.read.remote(keys))
    assert "wrong" not in got
    assert all(g == "exact" for g in got[:len(hot)]), got[:len(hot)]  # the hottest kept
    assert got.count("miss") > 0, report  # more than the deadline allowed: the rest lost
    # the rank still there: its calls fail at once, no node actor comes back
    with pytest.raises(ray.exceptions.RayTaskError) as e:
        ray.get(writer.read.remote(hot), timeout=60)
    assert isinstance(e.value.cause, NodeUnavailableError)
    with pytest.raises(ray.exceptions.RayTaskError, match="draining"):
        ray.get(cluster.reconciler.want.remote(node))
    assert not has_actor(node)


def test_an_operator_drain_moves_the_pages_and_keeps_the_node_off(cluster, uid):
    """`raykv drain NODE` (the reconciler's drain): the node actor moves what only its
    segment holds and stops, though a rank still runs there; the pages read back exact
    from the head node; no node actor starts there again; the head node is refused."""
    node, head = cluster.node_ids[1], cluster.node_ids[0]
    model = f"operator-{uid}"
    writer = drain_rank(node, model, POOL_PAGES)
    keys = [f"{uid}-{i}" for i in range(POOL_PAGES // 4)]
    assert all(ray.get(writer.write.remote(keys)))
    report = ray.get(cluster.reconciler.drain.remote(node))
    assert report["outcome"] == "stopped" and report["reason"] == "operator", report
    assert report["objects_moved"] == 2 * len(keys), f"{report}"  # k and v: 2 objects a page
    assert not has_actor(node)
    reader = drain_rank(head, model, POOL_PAGES)
    assert ray.get(reader.read.remote(keys)) == ["exact"] * len(keys)
    with pytest.raises(ray.exceptions.RayTaskError, match="draining"):
        ray.get(cluster.reconciler.want.remote(node))
    with pytest.raises(ray.exceptions.RayTaskError, match="head node"):
        ray.get(cluster.reconciler.drain.remote(head))
