"""A node's load estimates on a real two-node cluster (Ray, ``mooncake_master``): a group
answer's hit comes with ``load_runs`` priced by the answering node, whose estimates
follow what its own gets take (``cache_actors.node.load_estimates``).

Node A (the other node) stores the pages; node B (the driver's, the group's lookup
home) answers the group query and serves the driver's loads.
"""

import time

import pytest
import ray
from raykv import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import LoadStats

from tests.integration.conftest import two_nodes
from tests.integration.ranks import MHA, indices, start_rank
from tests.integration.store_delay import delay_store_calls

PAGES = 16
DELAY_S = 0.5


def loads_view(cluster, node: str) -> LoadStats:
    """``loads`` of ``node``'s actor (its ``stats``)."""
    return ray.get(cluster.node_actors[node].stats.remote()).loads


def wait_for(check, within_s: float = 30.0):
    """``check()``'s first truthy answer, asked every 0.1 s; fails after ``within_s``."""
    end = time.monotonic() + within_s
    while not (got := check()):
        assert time.monotonic() < end, "the node actor never got there"
        time.sleep(0.1)
    return got


@pytest.fixture(scope="module")
def cluster():
    """A two-node cluster of this module's own: a cold start's probes are its subject
    (a shared cluster's links were used and its probe objects evicted before)."""
    with two_nodes("embedded") as c:
        yield c


@pytest.fixture
def stored(cluster, uid):
    """A reader on node B (registered first: B is the group's home) and ``PAGES`` pages
    stored by a writer (a ``Rank``) of the same deployment on node A."""
    here = ray.get_runtime_context().get_node_id()
    (there,) = [n for n in cluster.node_ids[:2] if n != here]
    config = StorageConfig(tp_rank=0, tp_size=1, model_name=f"loads/{uid}",
                           extra_config={"engine_id": "e"})
    reader = CacheClient(config)
    pool = reader.create_host_pool("mha", **MHA)
    reader.register_mem_pool_host(pool)
    reader.register_deployment()
    writer = start_rank(there, config)
    keys = [f"{uid}-{i}" for i in range(PAGES)]
    assert ray.get(writer.call.remote("batch_set_v1", keys, indices(0, PAGES))) == \
        [True] * PAGES
    try:
        yield reader, keys, here, there, writer
    finally:
        reader.close()
        ray.kill(writer)


def segment(cluster, node: str) -> str:
    return ray.get(cluster.node_actors[node].health.remote())["segment"]


def test_a_hit_from_another_node_comes_with_priced_runs(cluster, stored):
    """B knows A's link from a probe before any load (A is on the controller's node
    list); the hit stored on A, asked through B: every page in runs from A's segment,
    each priced. Control: a miss has no runs."""
    reader, keys, here, there, writer = stored
    a = segment(cluster, there)
    # a cold start: B probed A's segment, a peer of the node list, before any load
    cold = wait_for(lambda: (v := loads_view(cluster, here).links.get(a)) is not None
                    and v.probe_age_s is not None and v, within_s=90)
    assert cold.samples == 0 and cold.mb_per_s > 0  # the probe's, no get's
    hit = reader.group_exists(keys)
    assert hit.kv_hit_pages == PAGES
    assert sum(p for _, p, _ in hit.load_runs) == PAGES
    assert [(t, p) for t, p, _ in hit.load_runs] == [("l3", PAGES)]
    assert hit.load_runs[0][2] > 0  # priced from the first load on: the probe's estimate
    view = loads_view(cluster, here)
    assert view.links[a].mb_per_s > 0 and view.located_keys >= PAGES
    # the writer on A asks its lookup home B over Ray: the runs travel that route too
    far = ray.get(writer.call.remote("group_exists", keys))
    assert [(t, p) for t, p, _ in far.load_runs] == [("l3", PAGES)]
    # control: a miss is answered without runs
    miss = reader.group_exists([f"{keys[0]}-none-{i}" for i in range(4)])
    assert miss.kv_hit_pages == 0 and miss.load_runs == []
    # what B tells a router: a MiB from its own segment and from the others, priced
    told = told_load_s(cluster, here)
    assert set(told) == {"segment", "l3"} and min(told.values()) > 0, told


def told_load_s(cluster, node: str) -> dict:
    """What ``node``'s residency log tells a router of its load estimates."""
    return ray.get(cluster.node_actors[node].residency_changes.remote(None)).load_s


def estimate_after_loads(cluster, reader, keys, here, loads: int) -> float:
    """The hit's estimated seconds after ``loads`` more loads of it through B, each
    measured by B's background thread before the next query."""
    start = loads_view(cluster, here).overall.samples
    for _ in range(loads):
        assert all(reader.batch_get_v1(keys, indices(0, PAGES)))
    wait_for(lambda: loads_view(cluster, here).overall.samples >= start + loads)
    hit = reader.group_exists(keys)
    assert hit.kv_hit_pages == PAGES
    return sum(s for _, _, s in hit.load_runs)


def test_slow_gets_on_the_answering_node_raise_its_estimates(cluster, stored):
    """Loads through B, measured: the estimate follows them. With every store call of
    B held ``DELAY_S``, five loads later the hit is estimated to take over half of
    ``DELAY_S``; after five plain loads (the control, measured first on the same pages
    and link) it is not."""
    reader, keys, here, _, _ = stored
    plain = estimate_after_loads(cluster, reader, keys, here, 5)
    plain_told = told_load_s(cluster, here)["l3"]
    delay_store_calls([cluster.node_actors[here]], DELAY_S)
    try:
        slow = estimate_after_loads(cluster, reader, keys, here, 5)
        slow_told = told_load_s(cluster, here)["l3"]
    finally:
        delay_store_calls([cluster.node_actors[here]], 0)
    # each delayed get took over DELAY_S: five of them move the average (weight 0.2)
    # two thirds of the way there; a slower machine only raises it
    assert slow >= DELAY_S / 2
    assert plain < DELAY_S / 2  # control: plain loads do not
    # a router is told B's slower link too (what ranks B as if it held less)
    assert slow_told > 3 * plain_told, (plain_told, slow_told)
