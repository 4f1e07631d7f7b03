"""Parallel sizes and group-query numbers are bounded (pure): a config or registration
asking for a group of ten million ranks is refused before any list of its ranks is
built, and a group query's rank and windows must lie in the group."""

from __future__ import annotations

import copy

import pytest
from raykv.controllers.contract import (
    MAX_GROUP_RANKS,
    PoolHitPolicy,
    PoolName,
    StorageConfig,
    check_parallel,
)
from raykv.controllers.deployments import (
    DeploymentRegistry,
    PoolQuery,
    PoolSpec,
    check_group_query,
)
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS

KV = PoolSpec(PoolName.KV, "mha", ("k", "v"))


@pytest.mark.parametrize("fields", [
    {"tp_size": 10**7}, {"pp_size": 10**7}, {"attn_cp_size": 10**7},
    {"tp_size": 64, "pp_size": 32}, {"tp_size": 0}, {"tp_size": 2.0}, {"tp_size": True},
    {"tp_rank": 3, "tp_size": 2}, {"tp_rank": -1},
], ids=str)
def test_out_of_range_parallel_sizes_are_refused(fields):
    with pytest.raises(ValueError, match="tp_|pp_|attn_cp_"):
        StorageConfig(**fields)


def test_the_largest_group_is_accepted():
    StorageConfig(tp_rank=MAX_GROUP_RANKS - 1, tp_size=MAX_GROUP_RANKS)
    StorageConfig(tp_size=32, pp_size=32, pp_rank=31)


def test_a_registration_that_skipped_the_config_check_is_refused():
    """A config arrives at the controller unpickled by Ray, never checked: one whose
    ``tp_size`` was set to 10**7 after it was made is refused at registration, before a
    deployment (or any list of its ranks) exists. Control: the same config with its
    size set back registers."""
    config = StorageConfig(model_name="m")
    config.tp_size = 10**7  # what a hostile rank sends
    registry = DeploymentRegistry()
    with pytest.raises(ValueError, match="MAX_GROUP_RANKS"):
        registry.register_rank(copy.deepcopy(config), [KV], "node")
    assert registry.deployments == {}
    with pytest.raises(ValueError, match="StorageConfig"):
        registry.register_rank({"tp_size": 2}, [KV], "node")
    config.tp_size = 2
    check_parallel(config)
    assert registry.register_rank(config, [KV], "node").tp_size == 2


@pytest.mark.parametrize(("rank", "queries"), [
    ((2, 0), []), ((0, 1), []), ((-1, 0), []), ((0,), []), ("00", []), ((0.0, 0), []),
    ((0, 0), [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 0)]),
    ((0, 0), [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES,
                        MAX_BATCH_OBJECTS + 1)]),
    ((0, 0), [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 1.5)]),
    ((0, 0), [PoolQuery(PoolName.MAMBA)] * 6),
    ((0, 0), "mamba"),
], ids=str)
def test_a_group_query_outside_its_group_is_refused(rank, queries):
    dep = DeploymentRegistry().register_rank(StorageConfig(tp_size=2, model_name="m"),
                                             [KV], "node")
    with pytest.raises(ValueError):
        check_group_query(dep, rank, queries)
    q = [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, MAX_BATCH_OBJECTS)]
    assert check_group_query(dep, [1, 0], q) == ((1, 0), q)  # control
