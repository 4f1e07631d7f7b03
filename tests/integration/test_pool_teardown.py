"""A pool destroyed while ranks loop puts and gets through it (real Ray, real
mooncake_master, embedded and standalone): the node actor never crashes and no key ever
reads back bytes other than what its writer wrote.

The node actors run with slow store calls (``store_delay``, injected into them):
each store call waits inside itself, after the pointers were resolved, so the destroy
lands while calls are in flight on the pool. Before the fix, the pool was unmapped
(embedded: the store call read unmapped memory) or had its pages given back (standalone:
zeros stored under real keys and reported stored) under those calls.
"""

import time

import pytest
import ray
from raykv import CacheClient
from raykv.controllers import StorageConfig

from tests.integration.conftest import MODES, node_pids, slow_two_nodes
from tests.integration.loopers import PAGES, POOL, looper

DELAY_S = 0.15
VICTIM = "teardown-victim"


@pytest.fixture(scope="module", params=MODES)
def slow_cluster(request):
    """A two-node cluster whose node actors hold every store call ``DELAY_S`` s."""
    with slow_two_nodes(request.param, DELAY_S) as cluster:
        yield cluster


def test_destroy_during_puts_and_gets_never_stores_wrong_bytes(slow_cluster, uid):
    cluster = slow_cluster
    head, other = cluster.node_ids
    before = node_pids(cluster)
    # the loopers' deployment (the pool's owner's: only it may attach the pool)
    owner = CacheClient(StorageConfig(model_name="teardown/" + uid[:4]))
    assert owner.node_id == head
    owner.create_host_pool("mha", name=VICTIM, **POOL)
    victims = [looper(head, f"{uid}v{i}", VICTIM, attach=True, slot=i * 2 * PAGES * 4)
               for i in range(3)]
    # the other node's rank: what it must never see is an error or wrong bytes; its
    # deadline is generous because 2 loaded cores once held one of its puts past 5 s
    honest = looper(other, f"{uid}h", f"teardown-own-{uid}", attach=False, timeout_s=30.0)
    runs = [*(r.loop.remote(200) for r in victims), honest.loop.remote(20)]
    deadline = time.monotonic() + 300
    while min(ray.get([r.rounds_done.remote() for r in victims])) < 2:  # all looping
        assert time.monotonic() < deadline and not ray.wait(runs, timeout=0)[0]
        time.sleep(DELAY_S)
    assert owner.destroy_host_pool(VICTIM)
    results = ray.get(runs, timeout=300)

    assert node_pids(cluster) == before  # no node actor crashed (or was restarted)
    for res in results[:-1]:  # the victims' loop ended with a clear error: the pool is
        # gone (UnknownPoolError, a ValueError), or went while the call was prepared
        assert res["error"] is not None and res["error"].split(":")[0] in (
            "UnknownPoolError", "ValueError"), res["error"]
        assert VICTIM in res["error"] or "destroyed" in res["error"], res["error"]
    assert results[-1]["error"] is None  # the other node's rank never noticed
    assert not any(res["mismatched"] for res in results)

    # Every key any rank was told stored reads back as exactly what its writer wrote
    # (read by that rank, into a fresh pool of its own).
    for res, rank in zip(results, [*victims, honest], strict=True):
        assert res["stored"], "a looper stored nothing before the destroy"
        assert ray.get(rank.verify.remote(res["stored"]), timeout=300) == []
