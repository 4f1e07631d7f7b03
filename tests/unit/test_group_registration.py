"""GroupRegistration against a fake node link (no Ray): what registering sends and keeps,
when a group query must register first, and where the query goes."""

from __future__ import annotations

import pytest
from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.rank.group_registration import GroupRegistration
from raykv.controllers.contract import PoolHitPolicy, PoolName, PoolTransferResult, StorageConfig
from raykv.controllers.deployments import PoolQuery, PoolSpec, Registration
from raykv.controllers.keys import KeyScheme

KV = PoolSpec(PoolName.KV, "mha", ("k", "v"))
MAMBA = PoolSpec(PoolName.MAMBA, "mamba", ("conv_0",))
CONFIG = StorageConfig(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, model_name="m")


class FakeLink:
    node_id = "self-node"
    owner = None  # NodeLink.owner: none (a rank without a tenant)

    def __init__(self) -> None:
        self.controller_attached = False
        self.asked: list[tuple] = []
        self.data_ops: list[tuple] = []
        self.version = 0

    def ask_controller(self, method: str, *args) -> Registration:
        self.asked.append((method, *args))
        self.controller_attached = True
        self.version += 1
        return Registration("dep", KeyScheme.from_config(args[0]), "home-node", self.version)

    def data(self, op: DataOp, *args, node_id: str | None = None) -> PoolTransferResult:
        self.data_ops.append((op, node_id, *args))
        return PoolTransferResult(kv_hit_pages=len(args[3]))


def test_register_sends_the_rank_its_pools_and_its_node():
    link = FakeLink()
    group = GroupRegistration(link, CONFIG)
    reg = group.register((KV, MAMBA))
    assert link.asked == [("register_rank", CONFIG, [KV, MAMBA], "self-node", None)]
    assert reg.deployment_id == "dep" and reg.home_node == "home-node"


def test_outdated_until_registered_with_these_pools_on_this_attachment():
    link = FakeLink()
    group = GroupRegistration(link, CONFIG)
    assert group.outdated((KV,))  # never registered
    group.register((KV,))
    assert not group.outdated((KV,))
    assert group.outdated((KV, MAMBA))  # the registered pools changed
    link.controller_attached = False  # the link re-attached since
    assert group.outdated((KV,))


def test_a_query_goes_to_the_home_node_with_the_registered_version():
    link = FakeLink()
    group = GroupRegistration(link, CONFIG)
    group.register((KV,))
    group.register((KV, MAMBA))  # version 2
    q = [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 2)]
    assert group.exists(["a", "b"], q).kv_hit_pages == 2
    assert link.data_ops == [(DataOp.GROUP_EXISTS, "home-node", "dep", 2, (1, 1), ["a", "b"],
                              q)]


def test_a_query_before_registering_is_a_bug():
    with pytest.raises(AssertionError, match="register before a group query"):
        GroupRegistration(FakeLink(), CONFIG).exists(["a"], [])
