"""Deployment registry, group object naming and group hits (pure logic)."""

import pytest
from raykv.controllers.contract import PoolHitPolicy, PoolName, StorageConfig
from raykv.controllers.deployments import (
    Deployment,
    DeploymentRegistry,
    PoolQuery,
    PoolSpec,
    deployment_id,
    lookup_home,
)

from tests.unit.oracle import group_hits, group_objects

KV_MHA = PoolSpec(PoolName.KV, "mha", ("k", "v"))
KV_MLA = PoolSpec(PoolName.KV, "mla", ("kv",))
MAMBA = PoolSpec(PoolName.MAMBA, "mamba", ("temporal", "conv_0"))
IDX = PoolSpec(PoolName.INDEXER, "indexer", ("indexer",))


def cfg(**kw) -> StorageConfig:
    return StorageConfig(model_name="org/m", **kw)


def test_deployment_id():
    """The exact key prefix (every non-empty one ends in ``_``), ``default`` for none."""
    assert deployment_id(cfg()) == "org-m_"
    assert deployment_id(StorageConfig()) == "default"
    assert deployment_id(StorageConfig(model_name="default")) == "default_"
    assert deployment_id(cfg(extra_config={"extra_backend_tag": "t"})) == "t_org-m_"


def test_register_and_conflicts():
    reg = DeploymentRegistry()
    reg.register_rank(cfg(tp_rank=0, tp_size=2), [KV_MHA, MAMBA], "n1")
    dep = reg.register_rank(cfg(tp_rank=1, tp_size=2), [KV_MHA, MAMBA], "n2")
    assert dep.ranks == {"0,0": "n1", "1,0": "n2"}
    with pytest.raises(ValueError, match="says tp_size=4 but its group registered tp_size=2"):
        reg.register_rank(cfg(tp_rank=1, tp_size=4), [KV_MHA], "n1")
    with pytest.raises(ValueError, match="is_mla_model=True"):
        reg.register_rank(cfg(tp_rank=1, tp_size=2, is_mla_model=True), [KV_MLA], "n1")
    with pytest.raises(ValueError, match="pool 'mamba' is mamba \\['conv_0'\\]"):
        reg.register_rank(cfg(tp_rank=1, tp_size=2),
                          [KV_MHA, PoolSpec(PoolName.MAMBA, "mamba", ("conv_0",))], "n1")
    with pytest.raises(ValueError, match="must register a kv pool"):
        reg.register_rank(cfg(), [MAMBA], "n1")
    with pytest.raises(ValueError, match="'other' is not registered"):
        reg.get("other")
    with pytest.raises(ValueError, match="no key rule"):
        PoolSpec(PoolName.KV, "mamba", ("conv_0",))


def test_home_node_version_and_a_node_leaving():
    reg = DeploymentRegistry()
    dep = reg.register_rank(cfg(tp_rank=1, tp_size=2), [KV_MHA], "n2")
    assert (dep.home_node, dep.version) == ("n2", 1)   # the first rank's node
    dep = reg.register_rank(cfg(tp_rank=0, tp_size=2), [KV_MHA], "n1")
    assert (dep.home_node, dep.version) == ("n2", 1)   # same pools: same version
    dep = reg.register_rank(cfg(tp_rank=0, tp_size=2), [KV_MHA, MAMBA], "n1")
    assert dep.version == 2                             # a pool was added
    reg.retire_node("n2")
    assert dep.home_node == "n1" and dep.ranks == {"0,0": "n1"}
    reg.retire_node("n1")
    assert dep.home_node is None and dep.ranks == {}
    dep = reg.register_rank(cfg(tp_rank=1, tp_size=2), [KV_MHA], "n3")
    assert dep.home_node == "n3"


def test_lookup_home_is_the_asking_node_unless_a_group_spans_nodes():
    """A replica of one rank asks its own node; a group of several ranks asks the
    deployment's home (its ranks may span nodes and must meet one actor) unless it says
    ``lookup_home="node"``; ``"deployment"`` restores the one home for any group."""
    reg = DeploymentRegistry()
    one = reg.register_rank(cfg(), [KV_MHA], "n1")
    assert lookup_home(one, cfg(), "n2") == "n2"
    deployment = cfg(extra_config={"lookup_home": "deployment"})
    assert lookup_home(one, deployment, "n2") == "n1"  # CONTROL: the old rule
    group = reg.register_rank(StorageConfig(model_name="org/g", tp_size=2), [KV_MHA], "n1")
    rank1 = StorageConfig(model_name="org/g", tp_rank=1, tp_size=2)
    assert lookup_home(group, rank1, "n2") == "n1"
    node = StorageConfig(model_name="org/g", tp_rank=1, tp_size=2,
                         extra_config={"lookup_home": "node"})
    assert lookup_home(group, node, "n2") == "n2"
    with pytest.raises(ValueError, match="lookup_home"):
        cfg(extra_config={"lookup_home": "nearest"})


def test_checkpoint_round_trip():
    reg = DeploymentRegistry()
    dep = reg.register_rank(cfg(tp_size=2), [KV_MHA, MAMBA], "n1")
    assert Deployment.from_dict(dep.to_dict()) == dep


def test_group_objects_mla_replicated_once():
    reg = DeploymentRegistry()
    dep = reg.register_rank(cfg(tp_size=2, is_mla_model=True), [KV_MLA, MAMBA, IDX], "n")
    every = group_objects(dep, ["h"], [PoolQuery(PoolName.MAMBA),
                                                 PoolQuery(PoolName.INDEXER)])
    assert sorted(every.objects) == sorted(["org-m_h__k", "org-m_h__indexer",
                                      "org-m_h_0_temporal", "org-m_h_0_conv_0",
                                      "org-m_h_1_temporal", "org-m_h_1_conv_0"])
    assert every.spans[(0, 0)][PoolName.KV] == every.spans[(1, 0)][PoolName.KV]
    assert every.spans[(0, 0)][PoolName.MAMBA] != every.spans[(1, 0)][PoolName.MAMBA]
    with pytest.raises(ValueError, match="registered no 'swa' pool"):
        group_objects(dep, ["h"], [PoolQuery(PoolName.SWA)])


def test_group_hits_intersect_ranks_and_pp():
    reg = DeploymentRegistry()
    dep = reg.register_rank(cfg(tp_size=2, pp_size=2), [KV_MHA, MAMBA], "n")
    hashes = [f"p{i}" for i in range(4)]
    q = [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 1)]
    every = group_objects(dep, hashes, q)
    objects = every.objects
    assert len(objects) == len(set(objects)) == 4 * 4 * 4  # ranks x pages x objects
    present = set(objects)
    present.discard("org-m_p3_1_1_v")          # rank tp1/pp1 lacks KV of page 3
    for h in ("p0", "p2"):                        # Mamba states only after pages 1 and 3
        for r in ("0_0", "1_0", "0_1", "1_1"):
            present.discard(f"org-m_{h}_{r}_temporal")
    result = group_hits(every, q, [int(o in present) for o in objects])
    assert result.kv_hit_pages == 2
    assert result.restorable_prefix_pages == [0, 2]
    assert result.extra_pool_hit_pages == {PoolName.MAMBA: 1}


def test_a_checkpoint_of_an_older_raykv_still_loads():
    """Checkpoints written before pools' ``name`` became ``role`` keep their
    deployments when a controller of this version restarts from them."""
    reg = DeploymentRegistry()
    dep = reg.register_rank(cfg(tp_size=2), [KV_MHA, MAMBA], "n1")
    old = dep.to_dict()
    old["pools"] = [{("name" if k == "role" else k): v for k, v in p.items()}
                    for p in old["pools"]]
    assert Deployment.from_dict(old) == dep
