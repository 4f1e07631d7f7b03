"""Standalone mode: the node actor is a dummy client of its node's ``mooncake_client``,
which cannot tell which objects its segment holds (Mooncake 0.3.13 answers
``batch_get_replica_desc`` to dummies with nothing), so a drain moves nothing and says
so instead of reporting a drain it did not do."""

from __future__ import annotations

import ray

from tests.integration.conftest import two_nodes
from tests.integration.drain_ranks import drain_rank


def test_a_standalone_drain_says_it_cannot_locate_and_moves_nothing(uid):
    with two_nodes("standalone") as c:
        node = c.node_ids[1]
        writer = drain_rank(node, "drain/s", 16)
        assert all(ray.get(writer.write.remote([f"{uid}-{i}" for i in range(16)])))
        report = ray.get(c.node_actors[node].drain.remote(10.0, None, "test"))
        assert report["state"] == "no locate", report
        assert report["objects_moved"] == report["candidates"] == 0, report
        assert ray.get(c.node_actors[node].drain_status.remote()) == report
