"""v2 multi-pool API on a real store, in both Mooncake modes: hit tables, hybrid round
trips across nodes, tagging, rank scoping, draft offload paths and bad input."""

import logging

import pytest
import ray
import torch
from mooncake.store import MooncakeDistributedStore
from raykv import CacheClient
from raykv.controllers import PoolHitPolicy, PoolName, PoolTransfer, StorageConfig

from tests.integration.ranks import HYBRID, MHA, indices, start_hybrid

KV, MAMBA, SWA, IDX, DRAFT = (PoolName.KV, PoolName.MAMBA, PoolName.SWA, PoolName.INDEXER,
                              PoolName.DRAFT)
TRAIL = PoolHitPolicy.TRAILING_PAGES


@pytest.fixture(scope="module")
def cluster(any_mode_cluster):
    """Every test here runs against an embedded and a standalone cluster."""
    return any_mode_cluster


@pytest.fixture(scope="module")
def hybrid(cluster):
    """The driver as an MHA rank with every hybrid pool registered."""
    client = CacheClient(StorageConfig(model_name="hy/brid"))
    for name, (kind, kw) in HYBRID.items():
        client.register_mem_host_pool_v2(client.create_host_pool(kind, **kw), PoolName(name))
    return client


def page_slots(name: PoolName, pages: list[int]) -> torch.Tensor:
    """Host indices of ``pages`` in a pool (Mamba: one slot per page)."""
    if name == MAMBA:
        return torch.as_tensor(pages)
    return torch.cat([indices(p * 4, 1) for p in pages]) if pages else torch.arange(0)


def write(client, keys, present: dict[PoolName, list[int]]):
    """Store, for each pool, only the pages listed (0-based)."""
    transfers = [PoolTransfer(name, [keys[p] for p in pages], page_slots(name, pages))
                 for name, pages in present.items() if pages]
    result = client.batch_set_v2(transfers)
    assert all(all(v) for v in result.values()), result


FIVE = list(range(5))
SCENARIOS = [
    # (pages stored per pool, transfers' (pool, policy, window), kv_hit, restorable)
    ({KV: FIVE, MAMBA: [2, 4]}, [(MAMBA, TRAIL, 1)], 5, [0, 3, 5]),
    ({KV: FIVE, MAMBA: [2]}, [(MAMBA, TRAIL, 1)], 3, [0, 3]),
    ({KV: FIVE, IDX: [0, 1, 3, 4]}, [(IDX, "all_pages", 5)], 2, [0, 1, 2]),
    ({KV: FIVE, MAMBA: [1, 2, 4]}, [(MAMBA, TRAIL, 2)], 3, [0, 3]),
    ({KV: FIVE, SWA: [2, 3, 4]}, [(SWA, TRAIL, 2)], 5, [0, 4, 5]),
    ({KV: FIVE, MAMBA: [2, 4], DRAFT: [0, 1, 2, 3]}, [(MAMBA, TRAIL, 1),
                                                      (DRAFT, "all_pages", 5)], 3, [0, 3]),
    ({KV: [0, 1, 2], MAMBA: [2, 4], IDX: FIVE}, [(MAMBA, TRAIL, 1), (IDX, "all_pages", 5)],
     3, [0, 3]),
]


@pytest.mark.parametrize(("present", "asks", "hit", "restorable"), SCENARIOS)
def test_exists_v2_tables(hybrid, uid, present, asks, hit, restorable):
    keys = [f"{uid}-{i}" for i in range(5)]
    write(hybrid, keys, present)
    transfers = [PoolTransfer(name, keys[-window:], None, policy)
                 for name, policy, window in asks]
    result = hybrid.batch_exists_v2(keys, transfers)
    assert result.kv_hit_pages == hit
    assert result.restorable_prefix_pages == restorable
    for name, policy, window in asks:
        want = min(window, hit) if policy == TRAIL else hit
        assert result.extra_pool_hit_pages[name] == want


def test_hybrid_round_trip_across_nodes(cluster, uid):
    node1, node2 = cluster.node_ids
    cfg = StorageConfig(model_name="hy/brid", tp_rank=0, tp_size=2)
    writer, reader = start_hybrid(node1, cfg), start_hybrid(node2, cfg)
    ray.get(writer.fill.remote(42))
    keys = [f"{uid}-{i}" for i in range(4)]
    kv_idx, mamba_idx = indices(8, 4), torch.tensor([3, 5, 7, 9])
    transfers = [
        PoolTransfer(KV, keys, kv_idx),
        PoolTransfer(MAMBA, keys, mamba_idx, TRAIL),
        PoolTransfer(SWA, keys, kv_idx, TRAIL),
        PoolTransfer(IDX, keys, None, indices_from_pool=KV),
        PoolTransfer(DRAFT, None, None, indices_from_pool=KV),
    ]
    stored = ray.get(writer.call.remote("batch_set_v2", transfers))
    assert stored == {name: [True] * 4 for name in (KV, MAMBA, SWA, IDX, DRAFT)}
    found = ray.get(reader.call.remote("batch_exists_v2", keys, [
        PoolTransfer(MAMBA, keys[-1:], None, TRAIL), PoolTransfer(IDX, keys, None),
        PoolTransfer(DRAFT, keys, None)]))
    assert found.kv_hit_pages == 4
    assert found.extra_pool_hit_pages == {MAMBA: 1, IDX: 4, DRAFT: 4}
    read = [PoolTransfer(KV, keys, indices(40, 4)),
            PoolTransfer(MAMBA, keys, torch.tensor([0, 1, 2, 15]), TRAIL),
            PoolTransfer(SWA, keys, indices(40, 4), TRAIL),
            PoolTransfer(IDX, None, None, indices_from_pool=KV),
            PoolTransfer(DRAFT, None, None, indices_from_pool=KV)]
    got = ray.get(reader.call.remote("batch_get_v2", read))
    assert got == {name: [True] * 4 for name in (KV, MAMBA, SWA, IDX, DRAFT)}
    kv_slots = list(range(8, 24))
    for name, src, dst in [("kv", kv_slots, list(range(40, 56))),
                           ("swa", kv_slots, list(range(40, 56))),
                           ("indexer", kv_slots, list(range(40, 56))),
                           ("draft", kv_slots, list(range(40, 56))),
                           ("mamba", [3, 5, 7, 9], [0, 1, 2, 15])]:
        wrote = ray.get(writer.slots.remote(name, src))
        back = ray.get(reader.slots.remote(name, dst))
        assert len(wrote) == len(back) == (3 if name == "mamba" else
                                           2 if name in ("kv", "swa", "draft") else 1)
        for a, b in zip(wrote, back, strict=True):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_tag_and_model_found_by_exists_v2(cluster, uid):
    tagged = StorageConfig(model_name="org/m", extra_config={"extra_backend_tag": "tg"})
    rank = start_hybrid(cluster.node_ids[1], tagged,
                        {"kv": HYBRID["kv"], "mamba": HYBRID["mamba"]})
    keys = [f"{uid}-{i}" for i in range(3)]
    assert ray.get(rank.call.remote("batch_set_v1", keys[:2], indices(0, 2))) == [True] * 2
    assert ray.get(rank.call.remote("batch_set_v2", [
        PoolTransfer(KV, keys[2:], indices(8, 1)),
        PoolTransfer(MAMBA, keys[1:], torch.tensor([0, 1]), TRAIL)])) == {
        KV: [True], MAMBA: [True, True]}
    found = ray.get(rank.call.remote("batch_exists_v2", keys,
                                     [PoolTransfer(MAMBA, keys[-1:], None, TRAIL)]))
    assert found.kv_hit_pages == 3 and found.restorable_prefix_pages == [0, 2, 3]
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    try:
        assert store.batch_is_exist([f"tg_org-m_{keys[2]}_0_temporal",
                                     f"tg_org-m_{keys[2]}_0_conv_1",
                                     f"tg_org-m_tg_org-m_{keys[2]}_0_k"]) == [1, 1, 0]
    finally:
        store.close()


def test_conv_only_mamba_has_no_temporal_object(hybrid, cluster, uid):
    client = CacheClient(StorageConfig(model_name="conv/only"))
    client.register_mem_pool_host(client.create_host_pool("mha", **MHA))
    pool = client.create_host_pool("mamba", size=4, temporal_shape=(), conv_shapes=[(3, 4)],
                                   dtype=torch.float32)
    assert pool.temporal_buffer is None and len(pool.conv_buffer) == 1
    client.register_mem_host_pool_v2(pool, MAMBA)
    pool.conv_buffer[0].copy_(torch.randn(4, 3, 4))
    keys = [f"{uid}-0", f"{uid}-1"]
    assert client.batch_set_v2([PoolTransfer(KV, keys, indices(0, 2)),
                                PoolTransfer(MAMBA, keys[1:], torch.tensor([2]), TRAIL)]) == {
        KV: [True, True], MAMBA: [True]}
    assert client.batch_exists_v2(keys, [PoolTransfer(MAMBA, keys[1:], None, TRAIL)]
                                  ).kv_hit_pages == 2
    expected = pool.conv_buffer[0][2].clone()
    assert client.batch_get_v2([PoolTransfer(MAMBA, keys[1:], torch.tensor([0]), TRAIL)]) == {
        MAMBA: [True]}
    assert torch.equal(pool.conv_buffer[0][0], expected)
    ptrs, sizes = pool.get_page_buffer_meta(torch.tensor([1, 3]))
    assert sizes == [3 * 4 * 4] * 2 and ptrs[1] - ptrs[0] == 2 * 48


def test_mla_model_rank_scoping(cluster, uid):
    """Mamba keys carry the TP rank in an MLA model; the indexer is stored once."""
    node1, node2 = cluster.node_ids
    pools = {"kv": ("mla", dict(page_size=4, size=64, layer_num=2, kv_cache_dim=16)),
             "mamba": HYBRID["mamba"], "indexer": HYBRID["indexer"]}
    ranks = [start_hybrid(node, StorageConfig(is_mla_model=True, tp_rank=r, tp_size=2,
                                              model_name="dsv/32"), pools)
             for r, node in enumerate((node1, node2))]
    keys = [f"{uid}-{i}" for i in range(2)]
    put_before = ray.get(cluster.node_actors[node2].stats.remote()).counters
    for r, rank in enumerate(ranks):
        ray.get(rank.fill.remote(r))
        out = ray.get(rank.call.remote("batch_set_v2", [
            PoolTransfer(KV, keys, indices(0, 2)),
            PoolTransfer(MAMBA, keys, torch.tensor([0, 1]), TRAIL),
            PoolTransfer(IDX, keys, None, indices_from_pool=KV)]))
        assert out == {KV: [True] * 2, MAMBA: [True] * 2, IDX: [True] * 2}
    put_after = ray.get(cluster.node_actors[node2].stats.remote()).counters
    moved = put_after.get("put_objects", 0) - put_before.get("put_objects", 0)
    assert moved == 2 * 3  # rank 1 stored only its Mamba objects (temporal + 2 conv)
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    try:
        h = f"dsv-32_{keys[0]}"
        assert store.batch_is_exist([f"{h}_0_temporal", f"{h}_1_temporal", f"{h}_1_conv_0",
                                     f"{h}__indexer", f"{h}__k", f"{h}_1_indexer",
                                     f"{h}_1_k"]) == [1, 1, 1, 1, 1, 0, 0]
    finally:
        store.close()


def test_engine_draft_pool_goes_through_staging(cluster, uid):
    writer = CacheClient(StorageConfig(model_name="d/raft"))
    kv = writer.create_host_pool("mha", **MHA)
    writer.register_mem_pool_host(kv)

    class EngineDraft:  # a draft pool the engine allocated itself, outside shared memory
        page_size = 4
        kv_buffer = torch.randn(2, 64, 1, 2, 8).to(torch.float16)

    draft = EngineDraft()
    writer.register_mem_host_pool_v2(draft, DRAFT)
    keys = [f"{uid}-{i}" for i in range(3)]
    assert writer.batch_set_v2([PoolTransfer(KV, keys, indices(0, 3)),
                                PoolTransfer(DRAFT, None, None, indices_from_pool=KV)]) == {
        KV: [True] * 3, DRAFT: [True] * 3}
    expected = draft.kv_buffer[:, 0:12].clone()
    draft.kv_buffer.zero_()
    assert writer.batch_get_v2([PoolTransfer(DRAFT, keys, indices(16, 3))]) == {
        DRAFT: [True] * 3}
    assert torch.equal(draft.kv_buffer[:, 16:28], expected)
    assert torch.count_nonzero(draft.kv_buffer[:, :16]) == 0


def test_unservable_draft_is_disabled_with_one_warning(cluster, uid, caplog):
    client = CacheClient(StorageConfig())
    client.register_mem_pool_host(client.create_host_pool("mha", **MHA))

    class SplitHeads:  # heads split across ranks: a non-contiguous view of a bigger tensor
        page_size = 4
        kv_buffer = torch.zeros(2, 64, 1, 4, 8)[:, :, :, :2]

    with caplog.at_level(logging.WARNING, logger="raykv.cache_actors.rank.client"):
        client.register_mem_host_pool_v2(SplitHeads(), DRAFT)
        client.register_mem_host_pool_v2(SplitHeads(), DRAFT)
    assert [r.message for r in caplog.records].count(
        caplog.records[0].message) == 1 and "draft offload disabled" in caplog.text
    keys = [f"{uid}-{i}" for i in range(2)]
    out = client.batch_set_v2([PoolTransfer(KV, keys, indices(0, 2)),
                               PoolTransfer(DRAFT, keys, indices(0, 2))])
    assert out == {KV: [True, True], DRAFT: [False, False]}
    found = client.batch_exists_v2(keys, [PoolTransfer(DRAFT, keys, None)])
    assert found.kv_hit_pages == 2 and DRAFT not in found.extra_pool_hit_pages


@pytest.mark.parametrize(
    ("transfers", "msg"),
    [
        ([PoolTransfer("bogus", ["a"], indices(0, 1))], "unknown pool name 'bogus'"),
        ([PoolTransfer(KV, ["a", "b"], indices(0, 1))], "pool 'kv': host_indices has 4"),
        ([PoolTransfer(MAMBA, ["a", "b"], torch.tensor([0]))], "pool 'mamba': host_indices"),
        ([PoolTransfer(IDX, ["a"], None, indices_from_pool=KV)],
         "takes its indices from pool 'kv', which has no transfer"),
        ([PoolTransfer(KV, ["a"], indices(0, 1)), PoolTransfer(KV, ["b"], indices(4, 1))],
         "appears twice"),
        ([PoolTransfer(SWA, ["a"], None)], "pool 'swa': the transfer has no host_indices"),
        ([], "non-empty list"),
    ],
)
def test_v2_bad_input(hybrid, transfers, msg):
    for method in ("batch_set_v2", "batch_get_v2"):
        with pytest.raises(ValueError, match=msg):
            getattr(hybrid, method)(transfers)


def test_v2_bad_registrations_and_policies(cluster, hybrid):
    client = CacheClient(StorageConfig())
    with pytest.raises(ValueError, match="no 'mamba' host pool is registered"):
        client.batch_set_v2([PoolTransfer(MAMBA, ["a"], torch.tensor([0]))])
    pool = client.create_host_pool(*HYBRID["indexer"][:1], **HYBRID["indexer"][1])
    try:
        with pytest.raises(ValueError, match="pool kind 'indexer' has no key rule as pool 'kv'"):
            client.register_mem_host_pool_v2(pool, KV)
        with pytest.raises(ValueError, match="unknown pool name 'lora'"):
            client.register_mem_host_pool_v2(pool, "lora")
    finally:
        client.destroy_host_pool(pool)
    with pytest.raises(ValueError, match="pool 'mamba': unknown hit policy 'newest'"):
        hybrid.batch_exists_v2(["a"], [PoolTransfer(MAMBA, ["a"], None, "newest")])
