"""A node that joins warms the L2 pool an engine opens on it (real Ray, real
``mooncake_master``, embedded mode): a deployment's rank on node 1 writes chains of
blocks through its L2 (the write-behind puts them to L3, on node 1's segment); a node
joins, a rank of the same deployment opens its L2 there, the warm-up reads the chains
from L3 into it, and the rank's first reads of them are L2 hits, byte for byte, with
no store get. CONTROL: on a node that joins with the warm-up off, the same reads are
L2 misses that cross to L3."""

from __future__ import annotations

import time

import ray
import torch
from raykv import local_settings, start_local
from raykv.cache_actors.rank.client import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.deployments import deployment_id
from raykv.controllers.node_records import NodeStats
from raykv.controllers.pool_layout import MiB, PoolLayout

LAYOUT = PoolLayout.vllm(page_size=4, size=4, layer_num=2, head_num=1, head_dim=16,
                         dtype="bfloat16", itemsize=2)
CHAINS, PAGES = 3, 4  # 3 prefixes of 4 blocks each
WAIT_S = 90.0  # a loaded 2-core host is slow; each wait ends as soon as its event is seen


def l2_pages(pool, pages: list[int]) -> torch.Tensor:
    """The bytes of ``pages`` of an L2 pool (one vLLM block per page)."""
    buf = pool.kv_buffer.view(torch.uint8).view(pool.layout.num_pages, -1)
    return buf[pages].clone()


def engine(conf: StorageConfig, node_id: str) -> CacheClient:
    """A rank of ``conf``'s deployment on ``node_id`` as a vLLM worker attaches: its
    client and its KV pool (its L2 is opened by the caller)."""
    client = CacheClient(conf, node_id=node_id)
    client.register_mem_pool_host(client.create_host_pool(LAYOUT))
    return client


def waited(what, done, client: CacheClient) -> NodeStats:
    """``client``'s node stats once ``done(stats)`` holds (bounded by ``WAIT_S``)."""
    deadline = time.monotonic() + WAIT_S
    while not done(s := client.stats()):
        assert time.monotonic() < deadline, (what, s.warmup, s.l2)
        time.sleep(0.2)
    return s


def exported(on: str, off: str, deployment: str, nbytes: int) -> None:
    """Node ``on``'s Prometheus endpoint (Ray's metrics agent) shows ``nbytes`` warmed
    for ``deployment`` once Ray exported them (bounded wait); CONTROL: node ``off``
    warmed nothing and shows none."""
    from tests.integration.test_metrics_export import SCRAPE_S, scrape, total

    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    deadline = time.monotonic() + SCRAPE_S
    while True:
        found = scrape(nodes[on]).get("raykv_l2_warmed_bytes", [])
        got = total(found, "_total", node=on[:12], deployment=deployment, tenant="(none)")
        if got == nbytes:
            break
        assert got < nbytes and time.monotonic() < deadline, (got, nbytes, found)
        time.sleep(1)
    assert total(scrape(nodes[off]).get("raykv_l2_warmed_bytes", []), node=off[:12]) == 0


def first_reads(client: CacheClient, pool, chains: list[list[str]]) -> tuple[list, dict]:
    """The rank's first reads of ``chains`` as a vLLM worker makes them (a lookup, then
    ``acquire`` with ``fill``: L2, else L3 into L2); the pages, and what the node
    counted meanwhile (L2 hits, store gets, fills)."""
    link = client.l2()
    before = client.stats()
    got = []
    for chain in chains:
        link.lookup(chain, 1)
        got.append(link.acquire(pool.name, chain, True))
    after = client.stats()
    hits = sum(p.hits for p in after.l2.pools.values()) - \
        sum(p.hits for p in before.l2.pools.values())
    return got, {"l2_hits": hits,
                 "store_gets": after.counters.get("get_objects", 0) -
                 before.counters.get("get_objects", 0),
                 "filled": after.l2.filled - before.l2.filled}


def test_a_node_that_joins_warms_its_new_l2_pool(uid):
    with start_local(settings=local_settings(global_segment_size=64 * MiB, l2_bytes=16 * MiB),
                     num_nodes=2) as c:
        conf = StorageConfig(model_name=f"org/warm-{uid}")
        writer = engine(conf, c.node_ids[0])
        writer.register_deployment()  # as its scheduler's first group query does
        clients = [writer]
        try:
            link = writer.l2()
            pool = link.open(LAYOUT, 32)
            chains = [[f"{uid}c{n}p{p}" for p in range(PAGES)] for n in range(CHAINS)]
            wrote = []
            for chain in chains:  # one request's blocks saved per step
                pages = link.reserve(pool.name, chain)
                assert all(p >= 0 for p in pages)
                buf = pool.kv_buffer.view(torch.uint8).view(pool.layout.num_pages, -1)
                buf[pages] = torch.randint(0, 255, (PAGES, buf.shape[1]), dtype=torch.uint8)
                wrote.append(l2_pages(pool, pages))
                assert link.commit(pool.name, chain, pages, [True] * PAGES) == PAGES
            waited("write-behind", lambda s: s.l2.l3_put >= CHAINS * PAGES, writer)

            # CONTROL: a node that joins with the warm-up off (set in its node actor)
            off = c.add_node()
            ray.get(c.node_actors[off].__ray_call__.remote(
                lambda node: setattr(node._warmup, "warm_bytes", 0)), timeout=60)
            cold = engine(conf, off)
            clients.append(cold)
            cold_pool = cold.l2().open(LAYOUT, 32)
            assert cold.stats().warmup.warmups == {}
            got, counted = first_reads(cold, cold_pool, chains)
            assert [len(g) for g in got] == [PAGES] * CHAINS  # from L3, through L2
            assert counted == {"l2_hits": 0, "store_gets": CHAINS * PAGES,
                               "filled": CHAINS * PAGES}

            # a node that joins with the warm-up on (the default)
            on = c.add_node()
            warm = engine(conf, on)
            clients.append(warm)
            warm_pool = warm.l2().open(LAYOUT, 32)
            s = waited("warm-up", lambda s: s.warmup.warmups and
                       not s.warmup.running, warm)
            (w,) = s.warmup.warmups.values()
            assert (w.state, w.stopped, w.pages) == ("done", "done", CHAINS * PAGES)
            assert w.bytes == CHAINS * PAGES * LAYOUT.object_bytes == s.warmup.bytes
            assert s.l2.warmed == CHAINS * PAGES and s.l2.warm_failed == 0
            got, counted = first_reads(warm, warm_pool, chains)
            assert counted == {"l2_hits": CHAINS * PAGES, "store_gets": 0, "filled": 0}
            for pages, bytes_ in zip(got, wrote, strict=True):
                assert torch.equal(l2_pages(warm_pool, pages), bytes_)
            exported(on, off, deployment_id(conf), w.bytes)
        finally:
            for client in clients:
                client.close()
