"""Node actors follow the Ray nodes: a node that joins gets a node actor its ranks can
use; a node that leaves has its actor retired and its objects turn into misses."""

import time

import ray
import torch
from raykv import local_settings, start_local
from raykv.clusters.node_actors import named_node_actors
from raykv.controllers import NAMESPACE, StorageConfig, node_actor_name
from raykv.controllers.pool_layout import MiB

from tests.integration.ranks import indices, start_rank


def test_nodes_join_and_leave(uid):
    with start_local(settings=local_settings(global_segment_size=64 * MiB), num_nodes=2,
                     master_args=["-client_ttl=4"]) as c:
        node1 = c.node_ids[0]
        new = c.add_node()
        assert new in ray.get(c.controller.nodes.remote())
        assert node_actor_name(new) in named_node_actors(NAMESPACE)
        writer = start_rank(new, StorageConfig())
        ray.get(writer.fill.remote(3))
        keys = [f"{uid}-{i}" for i in range(12)]
        assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, 12))) == [True] * 12
        wrote = ray.get(writer.pages.remote(0, 12))
        reader = start_rank(node1, StorageConfig())
        assert ray.get(reader.call.remote("batch_get_v1", keys, indices(0, 12))) == [True] * 12

        c.remove_node(new)  # returns once the controller retired the node's actor
        assert new not in ray.get(c.controller.nodes.remote())
        assert node_actor_name(new) not in named_node_actors(NAMESPACE)
        deadline = time.monotonic() + 60

        # Reads of the left node's objects fail at once (transfer to a dead peer), then
        # the master expires its segment and exists reports them missing too. Pages that
        # still read (stored on other nodes) must be bit-exact throughout.
        while True:
            got = ray.get(reader.call.remote("batch_get_v1", keys, indices(0, 12)))
            read = ray.get(reader.pages.remote(0, 12))
            for p, ok in enumerate(got):
                if ok:
                    assert torch.equal(read[:, 4 * p:4 * p + 4], wrote[:, 4 * p:4 * p + 4])
            hits = ray.get(reader.call.remote("batch_exists", keys))
            if not all(got) and hits == got.index(False):
                break
            assert time.monotonic() < deadline, f"left node's objects: get {got}, exists {hits}"
            time.sleep(1)
