"""v1 data plane against a real two-node Ray cluster and a real mooncake_master, in
both Mooncake modes (embedded; standalone with a real mooncake_client per node).

Ranks run as Ray actors pinned to a node; each reaches Mooncake only through its own
node's actor, so a read on node 2 of what node 1 wrote crosses nodes.
"""

import time
from pathlib import Path

import pytest
import ray
import torch
from mooncake.store import MooncakeDistributedStore
from raykv.controllers import StorageConfig

from tests.integration.conftest import node_pids
from tests.integration.ranks import MHA, indices, planned, start_rank

N = 5


@pytest.fixture(scope="module")
def cluster(any_mode_cluster):
    """Every test here runs against an embedded and a standalone cluster."""
    return any_mode_cluster


def cfg(**kw) -> StorageConfig:
    return StorageConfig(model_name="org/toy", **kw)


def test_round_trip_across_nodes_mha_tp2_and_mla(cluster, uid):
    node1, node2 = cluster.node_ids
    keys = [f"{uid}-{i}" for i in range(N)]
    writers = {
        "tp0": start_rank(node1, cfg(tp_rank=0, tp_size=2)),
        "tp1": start_rank(node1, cfg(tp_rank=1, tp_size=2)),
        "mla": start_rank(node1, cfg(is_mla_model=True), kind="mla"),
    }
    readers = {
        "tp0": start_rank(node2, cfg(tp_rank=0, tp_size=2)),
        "tp1": start_rank(node2, cfg(tp_rank=1, tp_size=2)),
        "mla": start_rank(node2, cfg(is_mla_model=True), kind="mla"),
    }
    for seed, w in enumerate(writers.values()):
        ray.get(w.fill.remote(seed))
        assert ray.get(w.call.remote("batch_set_v1", keys, indices(8, N))) == [True] * N
    for name, r in readers.items():
        assert ray.get(r.call.remote("batch_exists", keys)) == N
        assert ray.get(r.call.remote("batch_get_v1", keys, indices(32, N))) == [True] * N
        wrote = ray.get(writers[name].pages.remote(8, N))
        read = ray.get(r.pages.remote(32, N))
        assert torch.equal(wrote.view(torch.uint8), read.view(torch.uint8)), name
    # TP shards differ: rank 1 read its own shard, not rank 0's.
    assert not torch.equal(ray.get(readers["tp0"].pages.remote(32, N)),
                           ray.get(readers["tp1"].pages.remote(32, N)))


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (it imported torch)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_node_actors_move_pages_without_torch(cluster, uid):
    """The node actors put and get a rank's pages by pointer: neither ever imports torch
    (3.7 CPU-s and ~180 MB each, measured). Control: the rank, whose pools are tensors, has."""
    node1, node2 = cluster.node_ids
    writer, reader = start_rank(node1, cfg()), start_rank(node2, cfg())
    keys = [f"{uid}-{i}" for i in range(N)]
    ray.get(writer.fill.remote(1))
    assert ray.get(writer.call.remote("batch_set_v1", keys, indices(8, N))) == [True] * N
    assert ray.get(reader.call.remote("batch_get_v1", keys, indices(8, N))) == [True] * N
    assert torch.equal(ray.get(writer.pages.remote(8, N)), ray.get(reader.pages.remote(8, N)))
    assert not any(_maps_torch(pid) for pid in node_pids(cluster).values())
    assert _maps_torch(ray.get(writer.pid.remote()))  # control


def test_object_names_seen_by_plain_mooncake_client(cluster, uid):
    node1 = cluster.node_ids[0]
    tagged = dict(model_name="org/toy", extra_config={"extra_backend_tag": "tag"})
    mha0 = start_rank(node1, StorageConfig(tp_rank=0, tp_size=2, **tagged))
    mha1 = start_rank(node1, StorageConfig(tp_rank=1, tp_size=2, **tagged))
    mla = start_rank(node1, StorageConfig(is_mla_model=True, pp_rank=1, pp_size=2, **tagged),
                     kind="mla")
    h = f"{uid}h"
    for r in (mha0, mha1, mla):
        assert ray.get(r.call.remote("batch_set_v1", [h], indices(0, 1))) == [True]

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    try:
        p = "tag_org-toy_"
        expected = [f"{p}{h}_0_k", f"{p}{h}_0_v", f"{p}{h}_1_k", f"{p}{h}_1_v", f"{p}{h}_1_k"]
        assert store.batch_is_exist(expected) == [1] * 5
        page_bytes = 4 * MHA["layer_num"] * MHA["head_num"] * MHA["head_dim"] * 2
        assert store.get_size(f"{p}{h}_0_k") == page_bytes
        wrong = [f"{h}_0_k", f"org-toy_{h}_0_k", f"{p}{p}{h}_0_k", f"{p}{h}__k"]
        assert store.batch_is_exist(wrong) == [0] * 4
    finally:
        store.close()


def test_exists_stops_at_first_missing_page(cluster, uid):
    r = start_rank(cluster.node_ids[0], cfg())
    a, b, c, d = (f"{uid}-{x}" for x in "abcd")
    assert ray.get(r.call.remote("batch_set_v1", [a, b, d], indices(0, 3))) == [True] * 3
    assert ray.get(r.call.remote("batch_exists", [a, b, c, d])) == 2
    assert ray.get(r.call.remote("batch_exists", [c, a])) == 0
    got = ray.get(r.call.remote("batch_get_v1", [a, c, d], indices(16, 3)))
    assert got == [True, False, True]


def test_put_if_absent_keeps_first_writer(cluster, uid):
    node1, node2 = cluster.node_ids
    first, second = start_rank(node1, cfg()), start_rank(node2, cfg())
    ray.get(first.fill.remote(11))
    ray.get(second.fill.remote(22))
    keys = [f"{uid}-{i}" for i in range(2)]
    assert ray.get(first.call.remote("batch_set_v1", keys, indices(0, 2))) == [True, True]
    assert ray.get(second.call.remote("batch_set_v1", keys, indices(0, 2))) == [True, True]
    assert ray.get(second.call.remote("batch_get_v1", keys, indices(40, 2))) == [True, True]
    assert torch.equal(ray.get(second.pages.remote(40, 2)), ray.get(first.pages.remote(0, 2)))


def test_mla_every_tp_rank_puts_the_one_copy(cluster, uid):
    """A TP rank > 0 of an MLA model stores the group's one copy itself (put-if-absent):
    what it reports stored is in the store (it was reported stored without being written
    when only TP rank 0 wrote); a later rank 0 finds it present and keeps it."""
    node1, node2 = cluster.node_ids
    rank1 = start_rank(node1, cfg(is_mla_model=True, tp_rank=1, tp_size=2), kind="mla")
    ray.get(rank1.fill.remote(3))
    keys = [f"{uid}-{i}" for i in range(2)]
    assert ray.get(rank1.call.remote("batch_exists", keys)) == 0  # CONTROL: not yet
    assert ray.get(rank1.call.remote("batch_set_v1", keys, indices(0, 2))) == [True, True]
    assert ray.get(rank1.call.remote("batch_exists", keys)) == 2
    rank0 = start_rank(node2, cfg(is_mla_model=True, tp_rank=0, tp_size=2), kind="mla")
    ray.get(rank0.fill.remote(5))
    assert ray.get(rank0.call.remote("batch_exists", keys)) == 2  # the same objects
    assert ray.get(rank0.call.remote("batch_set_v1", keys, indices(0, 2))) == [True, True]
    assert ray.get(rank0.call.remote("batch_get_v1", keys, indices(8, 2))) == [True, True]
    # the first writer's bytes stay: rank 0's put found them present
    assert torch.equal(ray.get(rank0.pages.remote(8, 2)), ray.get(rank1.pages.remote(0, 2)))


def test_killed_rank_pool_survives_for_replacement(cluster, uid):
    node1, node2 = cluster.node_ids
    name = f"survivor-{uid}"
    rank = start_rank(node1, cfg(), pool_name=name)
    ray.get(rank.fill.remote(7))
    before = ray.get(rank.pages.remote(0, 16))
    ray.kill(rank)
    replacement = start_rank(node1, cfg(), pool_name=name, attach=True)
    assert torch.equal(ray.get(replacement.pages.remote(0, 16)), before)
    # Creating by the same name with the same shape attaches too.
    again = start_rank(node1, cfg(), pool_name=name)
    assert torch.equal(ray.get(again.pages.remote(0, 16)), before)
    keys = [f"{uid}-{i}" for i in range(3)]
    assert ray.get(replacement.call.remote("batch_set_v1", keys, indices(0, 3))) == [True] * 3
    reader = start_rank(node2, cfg())
    assert ray.get(reader.call.remote("batch_get_v1", keys, indices(0, 3))) == [True] * 3
    assert torch.equal(ray.get(reader.pages.remote(0, 3)), before[:, :12])


def test_legacy_pointer_api(cluster, uid):
    r = start_rank(cluster.node_ids[0], cfg())
    reader = start_rank(cluster.node_ids[1], cfg())
    ray.get(r.fill.remote(3))

    keys = [f"{uid}-{i}" for i in range(4)]  # 2 pages x (k, v) as free-form object keys
    ptrs, sizes = ray.get(r.kv_meta.remote(0, 2))
    assert ray.get(r.call.remote("batch_set", keys, target_locations=ptrs,
                                 target_sizes=sizes)) is True
    rptrs, rsizes = ray.get(reader.kv_meta.remote(8, 2))
    assert ray.get(reader.call.remote("batch_get", keys, target_locations=rptrs,
                                      target_sizes=rsizes)) == 4
    assert torch.equal(ray.get(reader.pages.remote(8, 2)), ray.get(r.pages.remote(0, 2)))
    missing = [keys[0], f"{uid}-none", keys[2]]
    assert ray.get(reader.call.remote("batch_get", missing, target_locations=rptrs[:3],
                                      target_sizes=rsizes[:3])) == 1


def test_control_group_answers_while_data_calls_run(cluster, uid):
    """health/stats (control group) are served while the data group is saturated."""
    from raykv import CacheClient
    from raykv.controllers import PoolName
    from raykv.controllers.contract import PoolTransfer

    client = CacheClient(StorageConfig(is_mla_model=True, model_name=f"busy/{uid}",
                                       extra_config={"timeout_s": 60.0}))  # 64 MiB puts
    pool = client.create_host_pool("mla", page_size=16, size=16 * 64, layer_num=1,
                                   kv_cache_dim=64 * 1024, dtype=torch.uint8)  # 1 MiB pages
    client.register_mem_pool_host(pool)
    keys = [f"{uid}-{i}" for i in range(64)]
    assert client.batch_set_v1(keys, torch.arange(16 * 64)) == [True] * 64
    plan = planned(client, [PoolTransfer(PoolName.KV, keys, torch.arange(16 * 64))],
                   write=False)
    actor = cluster.node_actors[client.node_id]
    busy = [actor.get.remote(plan.batch, claim=client.owner_claim())  # 12 x 64 MiB of reads
            for _ in range(12)]
    health = ray.get(actor.health.remote())
    pending = ray.wait(busy, num_returns=len(busy), timeout=0)[1]
    assert health["store_healthy"] and pending, "health waited for the data calls"
    assert all(c == 1 << 20 for codes in ray.get(busy) for c in codes)
    client.destroy_host_pool(pool)


def l2_pages(pool, pages: list[int]) -> torch.Tensor:
    """The bytes of ``pages`` of an L2 pool (one vLLM block per page)."""
    buf = pool.kv_buffer.view(torch.uint8).view(pool.layout.num_pages, -1)
    return buf[pages].clone()


def test_l2_write_behind_then_a_node_without_it_fills_from_l3(cluster, uid):
    """Node 1's L2: three blocks reserved, written and committed land in L3 behind the
    writer (write-behind in the node actor, no put by the rank); a lookup leases them.
    Node 2's L2 (Ray route: the driver is on node 1) reads them from L3 into its own
    pages (3 gets), byte for byte; asked again it serves them from L2 with no get.
    Control: a block never written is not found on either node."""
    from raykv.cache_actors.rank.client import CacheClient
    from raykv.controllers.pool_layout import PoolLayout
    from raykv.controllers.result_codes import PRESENT

    node1, node2 = cluster.node_ids
    conf = StorageConfig(model_name=f"org/l2-{uid}")
    layout = PoolLayout.vllm(page_size=4, size=4, layer_num=2, head_num=1, head_dim=16,
                             dtype="bfloat16", itemsize=2)
    a, b = CacheClient(conf, node_id=node1), CacheClient(conf, node_id=node2)
    try:
        la, lb = a.l2(), b.l2()
        pa, pb = la.open(layout, 8), lb.open(layout, 8)
        assert pa.layout.num_pages == 8 and pb.layout.num_pages == 8
        hashes = [f"{uid}{i}" for i in range(3)]
        pages = la.reserve(pa.name, hashes)
        assert all(p >= 0 for p in pages)
        buf = pa.kv_buffer.view(torch.uint8).view(8, -1)
        buf[pages] = torch.randint(0, 255, (3, buf.shape[1]), dtype=torch.uint8)
        wrote = l2_pages(pa, pages)
        assert la.commit(pa.name, hashes, pages, [True] * 3) == 3
        assert la.reserve(pa.name, hashes[:1]) == [PRESENT]
        assert la.lookup(hashes + [f"{uid}x"], 1) == 3
        for _ in range(100):  # the write-behind put runs in node 1's actor
            if a.stats().l2.l3_put >= 3:
                break
            time.sleep(0.05)
        assert a.stats().l2.l3_put == 3
        assert lb.lookup(hashes, 1) == 0  # node 2's L2 is its own
        gets = b.stats().counters.get("get_objects", 0)
        got = lb.acquire(pb.name, hashes + [f"{uid}x"], True)
        assert len(got) == 3
        assert torch.equal(l2_pages(pb, got), wrote)
        assert b.stats().counters["get_objects"] == gets + 3
        assert lb.acquire(pb.name, hashes, True) == got
        stats = b.stats()
        assert stats.counters["get_objects"] == gets + 3  # from L2: no store get
        assert stats.l2.filled == 3 and stats.l2.fill_failed == 1  # x
    finally:
        a.close()
        b.close()


def set_flush_attempts(actor, attempts: int) -> None:
    """Set the write-behind's puts per object in the running node actor ``actor``."""
    def set_attempts(node, n: int) -> None:  # runs in the node actor
        node._service.l2.write_behind.attempts = n

    ray.get(actor.__ray_call__.remote(set_attempts, attempts), timeout=60)


@pytest.mark.parametrize("attempts", [4, 1], ids=["retry", "control-no-retry"])
def test_l2_write_behind_retries_a_failed_put_so_l3_has_no_hole(cluster, uid, attempts):
    """Node 1's L2 commits block 0 of a chain, whose write-behind put fails (inside the
    running node actor), then blocks 1 and 2, whose put lands. The write-behind puts
    block 0 again after a back-off: L3 holds the whole chain and node 2 reads all three
    blocks from it, byte for byte; the retry is counted, nothing is lost. Control
    (``attempts`` 1, the rule before retries): block 0 is counted in ``l3_put_failed``
    and L3 holds blocks 1 and 2 without it, a hole: node 2 reads none of the chain."""
    from raykv.cache_actors.node.write_behind import ATTEMPTS
    from raykv.cache_actors.rank.client import CacheClient
    from raykv.controllers.pool_layout import PoolLayout

    from tests.integration.store_delay import fail_store_puts

    node1, node2 = cluster.node_ids
    n1 = cluster.node_actors[node1]
    conf = StorageConfig(model_name=f"org/behind-{uid}")
    layout = PoolLayout.vllm(page_size=4, size=4, layer_num=2, head_num=1, head_dim=16,
                             dtype="bfloat16", itemsize=2)
    a, b = CacheClient(conf, node_id=node1), CacheClient(conf, node_id=node2)
    try:
        set_flush_attempts(n1, attempts)
        before = a.stats().l2
        la, lb = a.l2(), b.l2()
        pa, pb = la.open(layout, 8), lb.open(layout, 8)
        hashes = [f"{uid}{i}" for i in range(3)]
        buf = pa.kv_buffer.view(torch.uint8).view(8, -1)
        fail_store_puts(n1, 1)  # the next put in node 1's actor fails
        pages = []
        for chunk in (hashes[:1], hashes[1:]):
            got = la.reserve(pa.name, chunk)
            buf[got] = torch.randint(0, 255, (len(got), buf.shape[1]), dtype=torch.uint8)
            assert la.commit(pa.name, chunk, got, [True] * len(got)) == len(got)
            for _ in range(100):  # block 0's failed put first, then blocks 1 and 2
                s = a.stats().l2
                if s.l3_put + s.l3_put_failed + s.l3_put_pending >= \
                        before.l3_put + before.l3_put_failed + len(pages) + len(got):
                    break
                time.sleep(0.05)
            pages += got
        wrote = l2_pages(pa, pages)
        for _ in range(100):  # the retry runs after a back-off of 0.5 s
            s = a.stats().l2
            if s.l3_put + s.l3_put_failed - before.l3_put - \
                    before.l3_put_failed >= 3:
                break
            time.sleep(0.05)
        done = {k: getattr(s, k) - getattr(before, k)
                for k in ("l3_put", "l3_put_failed", "l3_put_retried")}
        got = lb.acquire(pb.name, hashes, True)  # node 2: from L3, up to the first gap
        if attempts > 1:
            assert done == {"l3_put": 3, "l3_put_failed": 0, "l3_put_retried": 1}, s
            assert len(got) == 3 and torch.equal(l2_pages(pb, got), wrote)
        else:  # control: a hole at block 0, blocks 1 and 2 in L3 behind it
            assert done == {"l3_put": 2, "l3_put_failed": 1, "l3_put_retried": 0}, s
            assert got == []
            behind = lb.acquire(pb.name, hashes[1:], True)
            assert torch.equal(l2_pages(pb, behind), wrote[1:])
        assert s.l3_put_pending == 0
        assert la.lookup(hashes, 1) == 3  # node 1's L2 holds the chain either way
    finally:
        set_flush_attempts(n1, ATTEMPTS)
        fail_store_puts(n1, 0)
        a.close()
        b.close()


def test_residency_names_the_node_that_holds_a_chain(cluster, uid):
    """Node 1's L2 writes 16 blocks behind to L3: embedded, they land on node 1's own
    segment (puts prefer it; control: random placement would put all 16 there with
    chance 2^-16), so node 1 answers L2, own segment and L3 for the 16 leading pages and
    node 2 answers L3 alone; ``locate`` names node 1's segment for each; a chain with a
    gap counts up to the gap. Standalone (a dummy client cannot locate): L2 and L3, no
    segment. Owner rules: a caller without the deployment's claim sees no L2, keys of
    another deployment or a tenant's are refused; a query past its deadline is not
    run."""
    from raykv.cache_actors.errors import DeadlineExceededError
    from raykv.cache_actors.rank.client import CacheClient
    from raykv.controllers.pool_layout import PoolLayout

    node1, node2 = cluster.node_ids
    conf = StorageConfig(model_name=f"org/where-{uid}")
    layout = PoolLayout.vllm(page_size=4, size=16, layer_num=2, head_num=1, head_dim=16,
                             dtype="bfloat16", itemsize=2)
    a, b = CacheClient(conf, node_id=node1), CacheClient(conf, node_id=node2)
    n1, n2 = cluster.node_actors[node1], cluster.node_actors[node2]
    try:
        la = a.l2()
        pa = la.open(layout, 16)
        hashes = [f"{uid}{i:02d}" for i in range(16)]
        pages = la.reserve(pa.name, hashes)
        assert la.commit(pa.name, hashes, pages, [True] * 16) == 16
        for _ in range(100):  # the write-behind put runs in node 1's actor
            if a.stats().l2.l3_put >= 16:
                break
            time.sleep(0.05)
        keys = la._keys(hashes + [f"{uid}x"])
        embedded = ray.get(n1.health.remote())["mode"] == "embedded"
        seg1 = ray.get(n1.stats.remote()).own_segment
        seg2 = ray.get(n2.stats.remote()).own_segment
        on1 = 16 if embedded else 0
        assert (seg1 and seg2 and seg1 != seg2) if embedded else seg1 is seg2 is None
        r1 = ray.get(n1.residency.remote(keys, 1, a.owner_claim(node1)))
        r2 = ray.get(n2.residency.remote(keys, 1, b.owner_claim(node2)))
        assert (r1.node_id, r1.pages, r1.best(), r1.own_segment) == (node1, 17, (16, on1, 16),
                                                                      seg1)
        assert (r2.node_id, r2.best(), r2.own_segment) == (node2, (0, 0, 16), seg2)
        if embedded:
            assert ray.get(n2.locate.remote(keys, b.owner_claim(node2))) == \
                [[seg1]] * 16 + [[]]
        gap = keys[:3] + keys[-1:] + keys[4:8]
        assert ray.get(n1.residency.remote(gap, 1, a.owner_claim(node1))).best() == \
            (3, 3 if embedded else 0, 3)
        two = ray.get(n1.residency.remote(keys[:16], 2, a.owner_claim(node1)))  # 2 keys a page
        assert (two.pages, two.l3) == (8, 8)
        # no claim: no L2
        assert ray.get(n1.residency.remote(keys, 1)).best() == (0, on1, 16)
        other = CacheClient(StorageConfig(model_name=f"org/other-{uid}"), node_id=node1)
        try:
            with pytest.raises(ValueError, match="outside the caller's key prefix"):
                ray.get(n1.residency.remote(keys, 1, other.owner_claim(node1)))
        finally:
            other.close()
        with pytest.raises(ValueError, match="tenant's claim"):
            ray.get(n1.residency.remote(["t1.x_" + keys[0]], 1))
        with pytest.raises(DeadlineExceededError):
            ray.get(n1.residency.remote(keys, 1, a.owner_claim(node1), 0.0))
        stats = ray.get(n1.stats.remote()).residency
        assert stats.queries >= 7 and stats.refused >= 2 and stats.late >= 1
    finally:
        a.close()
        b.close()
