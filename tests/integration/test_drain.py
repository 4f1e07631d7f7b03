"""A node that drains before it leaves takes nothing with it: what its segment alone held
moves to the other nodes' segments (hottest first, within the deadline and the room
below the store's high watermark), and ranks reading meanwhile get exact bytes or misses
within their deadlines. Real Ray nodes added and removed, a real mooncake_master."""

from __future__ import annotations

import time
import urllib.request

import pytest
import ray
from raykv import local_settings, start_local
from raykv.cache_actors.node.segment_drain import IN_FLIGHT
from raykv.clusters.store_usage import read_store_usage
from raykv.controllers.pool_layout import MiB

from tests.integration.deadline_bound import bound_s
from tests.integration.drain_ranks import POOL_PAGES, drain_rank

SEGMENT = 32 * MiB
READ_TIMEOUT_S = 2.0
BIG_DIM = 2048
"""Head dim of the pages of the room test: 128 KiB pages (a K and a V object each)."""


@pytest.fixture(scope="module")
def cluster():
    """Two nodes that stay (head and one more); each test adds the nodes that leave."""
    with start_local(settings=local_settings(global_segment_size=SEGMENT), num_nodes=2,
                     master_args=["-client_ttl=4"]) as c:
        yield c


def metrics_url(c) -> str:
    return f"http://127.0.0.1:{c.master.metrics_port}/metrics"


def evicted_bytes(c) -> int:
    text = urllib.request.urlopen(metrics_url(c), timeout=5).read().decode()
    return next(int(float(line.split()[1])) for line in text.splitlines()
                if line.startswith("master_evicted_size_bytes "))


def test_a_drained_node_leaves_every_page_readable_elsewhere_and_readers_never_hang(
        cluster, uid):
    """Pages written on a node (own placement: on its segment) read back byte-exact
    from another node after the node drained and left; a rank reading them throughout
    the drain gets exact bytes or misses, each call within its deadline.
    CONTROL: a node that leaves without a drain takes its pages with it (misses)."""
    c = cluster
    stay = c.node_ids[0]
    reader = drain_rank(stay, "drain/a", POOL_PAGES, timeout_s=READ_TIMEOUT_S)

    control = c.add_node()
    lost = [f"{uid}-lost-{i}" for i in range(48)]
    assert all(ray.get(drain_rank(control, "drain/a", POOL_PAGES).write.remote(lost)))
    assert ray.get(reader.read.remote(lost)) == ["exact"] * 48
    c.remove_node(control)
    assert ray.get(reader.read.remote(lost)) == ["miss"] * 48  # CONTROL: gone with it

    node = c.add_node()
    writer = drain_rank(node, "drain/a", POOL_PAGES)
    kept = [f"{uid}-kept-{i}" for i in range(48)]
    assert all(ray.get(writer.write.remote(kept)))
    page_bytes = ray.get(writer.page_bytes.remote())
    loop = reader.read_loop.remote(kept)
    report = ray.get(c.node_actors[node].drain.remote(60.0, None, "test"))
    ray.get(reader.stop.remote())
    reads = ray.get(loop)
    assert report["state"] == "done" and report["objects_left"] == 0, report
    assert report["bytes_moved"] == 48 * page_bytes and report["objects_failed"] == 0
    assert reads["error"] is None and reads["wrong"] == 0 and reads["rounds"] > 0, reads
    assert reads["longest_s"] <= bound_s(READ_TIMEOUT_S), reads
    assert ray.get(c.node_actors[node].drain_status.remote()) == report
    c.remove_node(node)
    assert ray.get(reader.read.remote(kept)) == ["exact"] * 48


def test_a_short_deadline_saves_the_hottest_and_loses_the_rest_cleanly(cluster, uid):
    """More objects than can move by the deadline (Mooncake runs about 16 move tasks a
    second per segment; 2048 objects here): the drain returns by its deadline (plus a
    margin), the pages read last (the hottest) survive, what else survives is of the
    newest batch (moves start in the hot order, at most ``IN_FLIGHT`` at once), no
    page of an older batch survives and nothing reads wrong."""
    c = cluster
    stay = c.node_ids[0]
    node = c.add_node()
    writer = drain_rank(node, "drain/b", POOL_PAGES)
    batches = [[f"{uid}-{b}-{i}" for i in range(POOL_PAGES)] for b in range(4)]
    for batch in batches:  # each batch touched after the one before
        assert all(ray.get(writer.write.remote(batch)))
    hot = batches[0][:8]  # written first, read last: the hottest
    assert ray.get(writer.read.remote(hot)) == ["exact"] * 8
    deadline_s = 5.0
    t = time.monotonic()
    report = ray.get(c.node_actors[node].drain.remote(deadline_s, None, "preemption"))
    took = time.monotonic() - t
    assert took <= bound_s(deadline_s), (took, report)
    assert report["candidates"] == 2 * len(batches) * POOL_PAGES  # a K and a V object each
    assert report["objects_left"] > 0 and report["objects_moved"] > 0, report
    assert report["started"] - report["objects_moved"] <= IN_FLIGHT
    c.remove_node(node)
    reader = drain_rank(stay, "drain/b", POOL_PAGES)
    got = [ray.get(reader.read.remote(batch)) for batch in batches]
    assert all(o != "wrong" for batch in got for o in batch)
    assert got[0][:8] == ["exact"] * 8  # the hottest survived
    survived = [sum(o == "exact" for o in batch[8 if b == 0 else 0:])
                for b, batch in enumerate(got)]
    assert survived[:-1] == [0] * (len(batches) - 1), (survived, report)
    assert survived[-1] < POOL_PAGES, (survived, report)  # the newest, cut by the deadline


def test_receivers_nearly_full_bound_what_moves_and_lose_nothing_of_theirs(cluster, uid):
    """The staying nodes are nearly full: the drain moves at most the room below the
    store's high watermark (``StoreUsage.room_without``), drops the rest, and no
    object already on the receivers is evicted for it (each reads back exact, the
    master evicted nothing). CONTROL: the leaving node holds more than that room."""
    c = cluster
    node = c.add_node()
    writer = drain_rank(node, "drain/c", 16, head_dim=BIG_DIM)
    page_bytes = ray.get(writer.page_bytes.remote())  # 128 KiB
    leaving = [f"{uid}-leaving-{i}" for i in range(80)]  # 10 MiB
    assert all(ray.get(writer.write.remote(leaving)))
    usage = read_store_usage(metrics_url(c))
    held = {}
    for n in c.node_ids:
        if n != node:
            segment = ray.get(c.node_actors[n].health.remote())["segment"]
            pages = (int(0.875 * SEGMENT) - usage.segments[segment][0]) // page_bytes
            rank = drain_rank(n, "drain/c", 16, head_dim=BIG_DIM)
            held[n] = (rank, [f"{uid}-{n[:6]}-{i}" for i in range(pages)])
            assert all(ray.get(rank.write.remote(held[n][1])))
    evicted = evicted_bytes(c)
    segment = ray.get(c.node_actors[node].health.remote())["segment"]
    room = read_store_usage(metrics_url(c)).room_without(segment)
    assert 0 < room < len(leaving) * page_bytes  # CONTROL: not all of it fits
    report = ray.get(c.node_actors[node].drain.remote(60.0, room, "test"))
    assert 0 < report["bytes_moved"] <= room, report
    assert report["objects_dropped"] > 0 and report["objects_left"] == 0, report
    c.remove_node(node)
    for rank, keys in held.values():
        assert ray.get(rank.read.remote(keys)) == ["exact"] * len(keys)
    assert evicted_bytes(c) == evicted
    got = ray.get(next(iter(held.values()))[0].read.remote(leaving))
    assert "wrong" not in got and 0 < got.count("exact") * page_bytes <= room
