"""Transfer planning without Ray or Mooncake: object batches, per-page results and the
validation that must refuse bad input before any byte moves."""

import ast
import pathlib

import numpy as np
import pytest
from raykv.controllers import KeyScheme, PoolHitPolicy, PoolName, PoolTransfer, StorageConfig
from raykv.controllers.deployments import PoolQuery
from raykv.controllers.pool_layout import PoolLayout
from raykv.controllers.transfer_plan import (
    PlanPool,
    check_hit_query,
    check_keys,
    exists_families,
    plan_transfers,
)

PAGE = 4


def mha(size: int = 16 * PAGE) -> PoolLayout:
    return PoolLayout.mha(page_size=PAGE, size=size, layer_num=2, head_num=1, head_dim=8,
                          dtype="bfloat16", itemsize=2)


def mla(size: int = 16 * PAGE) -> PoolLayout:
    return PoolLayout.mla(page_size=PAGE, size=size, layer_num=2, kv_cache_dim=16,
                          dtype="bfloat16", itemsize=2)


def indexer() -> PoolLayout:
    return PoolLayout.indexer(page_size=PAGE, size=16 * PAGE, layer_num=2, index_head_dim=4,
                              dtype="uint8", itemsize=1)


def mamba() -> PoolLayout:
    return PoolLayout.mamba(size=8, temporal=((2, 3), "float32", 4),
                            convs=[((2, 5), "float32", 4)])


def keys_of(**config) -> KeyScheme:
    return KeyScheme.from_config(StorageConfig(model_name="org/toy", **config))


def slots(*pages: int) -> list[int]:
    return [p * PAGE + i for p in pages for i in range(PAGE)]


MHA_POOLS = {PoolName.KV: PlanPool("kv-pool", mha())}


def test_mha_kv_batch_and_results():
    kv = mha()
    plan = plan_transfers([PoolTransfer(PoolName.KV, ["a", "b"], slots(3, 1))], MHA_POOLS,
                          keys_of(tp_size=2), write=True, epoch=7)
    batch = plan.batch
    assert batch.keys == ["org-toy_a_0_k", "org-toy_a_0_v", "org-toy_b_0_k", "org-toy_b_0_v"]
    assert batch.pools == ["kv-pool"] * 4
    assert batch.offsets == kv.object_offsets([3 * PAGE, 1 * PAGE])
    assert batch.sizes == kv.object_sizes * 2
    assert batch.epoch == 7
    assert plan.starts == {PoolName.KV: [3 * PAGE, 1 * PAGE]}
    # put: 0 stored, 1 already present, negative error; a page needs all its objects
    assert plan.stored([0, 1, 0, -200]) == {PoolName.KV: [True, False]}
    size = kv.object_sizes[0]
    assert plan.read([size, size, size, 0]) == {PoolName.KV: [True, False]}
    assert plan.read([size, size - 1, -704, size]) == {PoolName.KV: [False, False]}


def test_hybrid_with_sidecar_and_replicas():
    """MLA model, TP rank 1: KV and indexer are replicated (one copy per group, which
    every rank puts: put-if-absent keeps one, and a rank reports stored only what the
    store holds); the indexer takes KV's indices; Mamba is TP-sharded."""
    pools = {PoolName.KV: PlanPool("kv", mla()), PoolName.INDEXER: PlanPool("ix", indexer()),
             PoolName.MAMBA: PlanPool("mb", mamba())}
    transfers = [PoolTransfer(PoolName.KV, ["a", "b"], np.array(slots(0, 2))),
                 PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV),
                 PoolTransfer(PoolName.MAMBA, ["b"], [5])]
    keys = keys_of(is_mla_model=True, tp_rank=1, tp_size=2)
    put = plan_transfers(transfers, pools, keys, write=True, epoch=0)
    assert put.fixed == {}
    assert put.batch.keys == ["org-toy_a__k", "org-toy_b__k", "org-toy_a__indexer",
                              "org-toy_b__indexer", "org-toy_b_1_temporal",
                              "org-toy_b_1_conv_0"]
    assert put.batch.offsets[4:] == mamba().object_offsets([5])
    # CONTROL: an object the store does not hold is a failed page on this rank too
    assert put.stored([0, 1, 0, -200, 0, 0]) == {
        PoolName.KV: [True, True], PoolName.INDEXER: [True, False], PoolName.MAMBA: [True]}
    get = plan_transfers(transfers, pools, keys, write=False, epoch=0)
    assert get.batch.keys == ["org-toy_a__k", "org-toy_b__k", "org-toy_a__indexer",
                              "org-toy_b__indexer", "org-toy_b_1_temporal",
                              "org-toy_b_1_conv_0"]
    assert get.batch.offsets[2:4] == indexer().object_offsets([0, 2 * PAGE])
    assert get.spans == {PoolName.KV: (0, 1, 2), PoolName.INDEXER: (2, 1, 2),
                         PoolName.MAMBA: (4, 2, 1)}
    codes = [*mla().object_sizes * 2, indexer().object_sizes[0], -704, *mamba().object_sizes]
    assert get.read(codes) == {PoolName.KV: [True, True], PoolName.INDEXER: [True, False],
                               PoolName.MAMBA: [True]}


def test_disabled_pool_fails_without_the_store():
    plan = plan_transfers([PoolTransfer(PoolName.KV, ["a"], slots(0)),
                           PoolTransfer(PoolName.DRAFT, indices_from_pool=PoolName.KV)],
                          MHA_POOLS, keys_of(), write=False, epoch=0,
                          disabled={PoolName.DRAFT})
    assert len(plan.batch) == 2
    assert plan.read(mha().object_sizes) == {PoolName.DRAFT: [False], PoolName.KV: [True]}


def test_tensor_like_indices_are_brought_to_host():
    class OnDevice:  # what a torch tensor offers: cpu() then numpy()
        def cpu(self):
            return self

        def numpy(self):
            return np.array(slots(2))

    plan = plan_transfers([PoolTransfer(PoolName.KV, ["a"], OnDevice())], MHA_POOLS,
                          keys_of(), write=True, epoch=0)
    assert plan.starts[PoolName.KV] == [2 * PAGE]


KV = PoolName.KV


@pytest.mark.parametrize(("transfers", "msg"), [
    ([], "non-empty list of PoolTransfer"),
    (PoolTransfer(KV, ["a"], slots(0)), "non-empty list of PoolTransfer"),
    ("kv", "holds a str, not a PoolTransfer"),
    ([("kv", ["a"])], "holds a tuple, not a PoolTransfer"),
    ([PoolTransfer("nope", ["a"], slots(0))], "unknown pool name 'nope'"),
    ([PoolTransfer(KV, ["a"], slots(0)), PoolTransfer("kv", ["b"], slots(1))],
     "pool 'kv' appears twice"),
    ([PoolTransfer(KV, ["a"])], "pool 'kv': the transfer has no host_indices"),
    ([PoolTransfer(KV, ["a"], slots(0), indices_from_pool=PoolName.DRAFT)],
     "give host_indices or indices_from_pool, not both"),
    ([PoolTransfer(PoolName.DRAFT, ["a"], indices_from_pool=KV)],
     "takes its indices from pool 'kv', which has no transfer with host_indices"),
    ([PoolTransfer(PoolName.DRAFT, ["a"], indices_from_pool="bogus")],
     "unknown pool name 'bogus'"),
    ([PoolTransfer(KV, [], [])], "keys is empty"),
    ([PoolTransfer(KV, ["a", "a"], slots(0, 1))], "'a' appears at positions 0 and 1"),
    ([PoolTransfer(KV, ["a", ""], slots(0, 1))], "key 1 is ''"),
    ([PoolTransfer(KV, ["a"], slots(0)[:-1])], "pool 'kv': host_indices has 3 entries"),
    ([PoolTransfer(KV, ["a"], [1, 2, 3, 4])], "pool 'kv': page 0 starts at slot 1"),
    ([PoolTransfer(KV, ["a"], [0, 1, 3, 2])], "pool 'kv': page 0 does not cover"),
    ([PoolTransfer(KV, ["a"], slots(16))], r"pool 'kv': host_indices span \[64, 67\]"),
    ([PoolTransfer(KV, ["a"], [[0, 1, 2, 3]])], "pool 'kv': host_indices must be a 1-D"),
    ([PoolTransfer(PoolName.INDEXER, ["a"], slots(0))],
     r"no 'indexer' host pool is registered: call register_mem_host_pool_v2\(pool, "
     r"PoolName.INDEXER\)"),
])
def test_bad_transfers(transfers, msg):
    with pytest.raises(ValueError, match=msg):
        plan_transfers(transfers, MHA_POOLS, keys_of(), write=True, epoch=0)


def test_unregistered_kv_names_the_call():
    with pytest.raises(ValueError, match=r"call register_mem_pool_host\(pool\)"):
        plan_transfers([PoolTransfer(KV, ["a"], slots(0))], {}, keys_of(), write=False,
                       epoch=0)


def test_an_object_named_twice_is_refused():
    class OneSuffix(KeyScheme):
        def suffixes(self, pool, kind, buffer_names):
            return ["_x"]

    keys = OneSuffix(prefix="", mha="0", mla="", is_mla_model=False, tp_rank=0)
    pools = {**MHA_POOLS, PoolName.DRAFT: PlanPool("draft", mha())}
    with pytest.raises(ValueError, match="the transfers name the same object twice"):
        plan_transfers([PoolTransfer(KV, ["a"], slots(0)),
                        PoolTransfer(PoolName.DRAFT, indices_from_pool=KV)],
                       pools, keys, write=True, epoch=0)


@pytest.mark.parametrize(("keys", "msg"), [
    ("abc", "keys must be a list of strings, got str"),
    (None, "got NoneType"),
    ([], "keys is empty"),
    (["a", 3], "key 1 is 3"),
    (["a", ["b"]], r"key 1 is \['b'\]"),
    (["a", "b", "a"], "'a' appears at positions 0 and 2"),
])
def test_bad_keys(keys, msg):
    with pytest.raises(ValueError, match=msg):
        check_keys(keys)


def test_exists_queries_and_objects():
    pools = {KV: PlanPool("kv", mha()), PoolName.MAMBA: PlanPool("mb", mamba())}
    keys, queries = check_hit_query(
        ("a", "b"), [PoolTransfer(KV, ["a", "b"]),
                     PoolTransfer(PoolName.MAMBA, ["x", "y", "z"], hit_policy="trailing_pages"),
                     PoolTransfer(PoolName.DRAFT, hit_policy="all_pages")],
        pools, disabled={PoolName.DRAFT})
    assert keys == ["a", "b"]
    assert queries == [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 3)]
    families = exists_families(queries, pools, keys_of(tp_rank=1, tp_size=2), (1, 0))
    assert families.objects(keys) == [
        "org-toy_a_1_k", "org-toy_b_1_k", "org-toy_a_1_v", "org-toy_b_1_v",
        "org-toy_a_1_temporal", "org-toy_b_1_temporal", "org-toy_a_1_conv_0",
        "org-toy_b_1_conv_0"]


@pytest.mark.parametrize(("pools", "transfers", "msg"), [
    ({}, [], r"no 'kv' host pool is registered: call register_mem_pool_host\(pool\)"),
    (MHA_POOLS, [PoolTransfer(PoolName.MAMBA, ["a"])], "no 'mamba' host pool is registered"),
    (MHA_POOLS, [PoolTransfer(PoolName.MAMBA, ["a"], hit_policy="last")],
     "pool 'mamba': unknown hit policy 'last'"),
    (MHA_POOLS, ["kv"], "holds a str, not a PoolTransfer"),
    ({**MHA_POOLS, PoolName.SWA: PlanPool("swa", mha())},
     [PoolTransfer(PoolName.SWA), PoolTransfer("swa")], "pool 'swa' appears twice"),
])
def test_bad_exists(pools, transfers, msg):
    with pytest.raises(ValueError, match=msg):
        check_hit_query(["a"], transfers, pools)


def test_transfer_planning_stays_pure():
    """No Ray, Mooncake or torch: it must stay unit-testable in milliseconds."""
    root = pathlib.Path(__file__).resolve().parents[2] / "controllers"
    for module in ("transfer_plan.py", "object_batch.py"):
        tree = ast.parse((root / module).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        for name in names:
            assert name.split(".")[0] not in {"ray", "torch", "mooncake"}, (module, name)
            assert not name.startswith("raykv.") or name.startswith("raykv.controllers."), \
                (module, name)
