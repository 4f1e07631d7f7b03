"""A node's link estimates over emulated hosts (``start_hosts(2)``: two network
namespaces, a real Ray node in each, a real ``mooncake_master``; links shaped with
``tc``): host 0's node probes host 1's segment as soon as a hit shows it, and its
estimate follows that link's rate (``cache_actors.node.load_estimates``).

Root only (namespaces, links): skipped otherwise."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch
from raykv import local_settings
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import LinkView
from raykv.controllers.pool_layout import MiB
from raykv_lab.hosts import start_hosts

from tests.integration.ranks import indices, start_rank

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="emulated hosts need root")
PAGES = 8
SHAPE = dict(page_size=16, size=PAGES * 16, layer_num=4, head_num=8, head_dim=64,
             dtype=torch.float16)  # 128 KiB a page
SLOW_MB_S = 10e6 / 8 / 1e6  # 10 Mbit/s in MB/s


def link_of(cluster, node: str, segment: str) -> LinkView | None:
    """``node``'s estimate of its link from ``segment`` (None: none yet)."""
    return ray.get(cluster.node_actors[node].stats.remote()).loads.links.get(segment)


def wait_for(check, within_s: float = 60.0):
    end = time.monotonic() + within_s
    while not (got := check()):
        assert time.monotonic() < end, "the node actor never got there"
        time.sleep(0.2)
    return got


def test_a_shaped_link_is_estimated_at_its_rate_and_an_unshaped_one_far_faster(uid):
    """Host 0's node probes host 1's segment at its start (a peer of the node list) over
    the unshaped link (10 Gbit/s); then host 1's link is shaped to 10 Mbit/s and ten
    loads of a hit stored on host 1 go through host 0's node: its estimate of that link
    comes within 2x of 10 Mbit/s. Control: the probe's estimate of the unshaped link is
    over four times faster (on a loaded 2-core machine a probe read of 256 KiB is mostly
    the scheduler's: 10 MB/s was seen over 10 Gbit/s)."""
    with start_hosts(2, settings=local_settings(global_segment_size=64 * MiB), link="10gbit",
                     cpus_per_node=1, log_to_driver=False) as c:
        a, b = sorted(c.node_ids, key=c.ray_nodes.host_of)
        b_segment = ray.get(c.node_actors[b].health.remote())["segment"]
        config = StorageConfig(tp_rank=0, tp_size=1, model_name=f"links/{uid}",
                               extra_config={"engine_id": "e"})
        reader = start_rank(a, config, shape=SHAPE)
        ray.get(reader.call.remote("register_deployment"))  # the lookup home: host 0
        writer = start_rank(b, config, shape=SHAPE)
        ray.get(writer.fill.remote(1))
        keys = [f"{uid}-{i}" for i in range(PAGES)]
        assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, PAGES, 16))) \
            == [True] * PAGES
        try:
            fast = wait_for(lambda: (v := link_of(c, a, b_segment)) is not None
                            and v.probe_age_s is not None and v).mb_per_s
            c.ray_nodes.set_rate(1, "10mbit")
            assert ray.get(reader.call.remote("group_exists", keys)).kv_hit_pages == PAGES
            for _ in range(10):
                assert all(ray.get(reader.call.remote("batch_get_v1", keys,
                                                      indices(0, PAGES, 16))))
            slow = wait_for(lambda: (v := link_of(c, a, b_segment)) is not None
                            and v.samples >= 10 and v).mb_per_s
            assert SLOW_MB_S / 2 <= slow <= SLOW_MB_S * 2
            assert fast > 4 * slow
        finally:
            c.ray_nodes.set_rate(1, "10gbit")
            ray.kill(reader)
            ray.kill(writer)
