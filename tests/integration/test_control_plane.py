"""The control plane never waits on data (real Ray, real mooncake_master): a node actor's
``health`` and ``channel_path`` answer while it reserves and registers a large pool, and
while it drains a pool behind a store call held open (``store_delay``).

Each test shows the order, not a speed: a ``health`` reply came back, and only after it
the pool call was seen still running (``ray.wait``), so the reply did not wait for it.
Before, pool calls ran on the ``control`` group's event loop and ``health`` queued behind
them: no reply ever came back while one ran (both tests failed so on the old code). The
latencies are printed (``-s``), not asserted."""

from __future__ import annotations

import statistics
import time

import pytest
import ray
from raykv.controllers import StorageConfig
from raykv.controllers.ownership import claim_of
from raykv.controllers.pool_layout import PoolLayout

from tests.integration.conftest import slow_two_nodes
from tests.integration.ranks import indices, start_rank

DELAY_S = 4.0  # each put and get waits this long inside its store call
ANSWER_S = 120.0  # "answers at all": against hangs only
N = 4


@pytest.fixture(scope="module")
def slow_cluster():
    """The cluster, its head node actor warmed up: one small pool made and destroyed
    first (the first pool imports torch, which holds the GIL for a second or so)."""
    with slow_two_nodes("embedded", DELAY_S) as cluster:
        actor = cluster.node_actors[cluster.node_ids[0]]
        small = PoolLayout.mla(page_size=1, size=4, layer_num=1, kv_cache_dim=8,
                               dtype="uint8", itemsize=1)
        ray.get(actor.create_pool.remote("warm-up", small), timeout=ANSWER_S)
        assert ray.get(actor.destroy_pool.remote("warm-up"), timeout=ANSWER_S)
        yield cluster


def answers_while(actor, ref) -> list[float]:
    """Ask ``actor`` for ``health`` and ``channel_path`` in turn until ``ref`` (a pool
    call) is done; the latency of each reply after which ``ref`` was still running."""
    during = []
    while True:
        start = time.perf_counter()
        health, path = ray.get([actor.health.remote(), actor.channel_path.remote()],
                               timeout=ANSWER_S)
        took = time.perf_counter() - start
        assert health["store_healthy"] and path
        if ray.wait([ref], timeout=0)[0]:
            return during
        during.append(took)


def report(what: str, during: list[float]) -> None:
    print(f"{what}: {len(during)} health + channel_path replies, median "
          f"{statistics.median(during) * 1e3:.1f} ms, max {max(during) * 1e3:.1f} ms")


def test_health_answers_while_a_large_pool_is_made(slow_cluster, uid):
    """A 2 GiB pool: its memory reserved whole (``posix_fallocate``) and registered with
    Mooncake, hundreds of ms; ``health`` and ``channel_path`` reply meanwhile."""
    node = slow_cluster.node_ids[0]
    actor = slow_cluster.node_actors[node]
    layout = PoolLayout.mla(page_size=64, size=1 << 20, layer_num=32, kv_cache_dim=64,
                            dtype="uint8", itemsize=1)
    assert layout.nbytes == 2 << 30
    name = f"big-{uid}"
    ref = actor.create_pool.remote(name, layout)
    during = answers_while(actor, ref)
    assert ray.get(ref, timeout=ANSWER_S).name == name
    assert ray.get(actor.destroy_pool.remote(name), timeout=ANSWER_S)
    assert during, "no health reply came back while the pool was being made"
    report("while a 2 GiB pool was made", during)


def test_health_answers_while_a_pool_is_drained(slow_cluster, uid):
    """A put holds a pool for ``DELAY_S`` inside its store call; the pool's destroy waits
    for it (the drain) and ``health`` and ``channel_path`` reply meanwhile; the put ends
    stored and the destroy after it."""
    node = slow_cluster.node_ids[0]
    actor = slow_cluster.node_actors[node]
    config = StorageConfig(model_name=f"drained/{uid}")
    name = f"drained-{uid}"
    rank = start_rank(node, config, pool_name=name)
    ray.get(rank.fill.remote(0))
    keys = [f"{uid}-{i}" for i in range(N)]
    put = rank.call.remote("batch_set_v1", keys, indices(0, N))
    time.sleep(DELAY_S / 4)  # the put is inside its store call (it lasts DELAY_S)
    assert not ray.wait([put], timeout=0)[0]
    destroy = actor.destroy_pool.remote(name, claim_of(config))
    during = answers_while(actor, destroy)
    assert ray.get(destroy, timeout=ANSWER_S) is True
    assert ray.get(put, timeout=ANSWER_S) == [True] * N
    assert during, "no health reply came back while the pool was drained"
    report("while a pool was drained", during)
