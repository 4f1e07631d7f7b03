"""GroupRegistration against the shared fake node route (no Ray): what registering sends and keeps,
when a group query must register first, and where the query goes."""

from __future__ import annotations

import pytest
from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.errors import NodeUnavailableError
from raykv.cache_actors.rank.group_registration import GroupRegistration
from raykv.controllers.contract import PoolHitPolicy, PoolName, StorageConfig
from raykv.controllers.deployments import PoolQuery, PoolSpec

from tests.unit.fakes import FakeRoute

KV = PoolSpec(PoolName.KV, "mha", ("k", "v"))
MAMBA = PoolSpec(PoolName.MAMBA, "mamba", ("conv_0",))
CONFIG = StorageConfig(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, model_name="m",
                       extra_config={"engine_id": "e1"})


def route() -> FakeRoute:
    """The shared fake route of a rank on node ``self-node`` without a tenant."""
    return FakeRoute(node_id="self-node")


def test_register_sends_the_rank_its_pools_and_its_node():
    link = route()
    group = GroupRegistration(link, CONFIG)
    reg = group.register((KV, MAMBA))
    assert link.asked == [("register_rank", CONFIG, [KV, MAMBA], "self-node", None)]
    assert reg.deployment_id == FakeRoute.DEPLOYMENT and reg.home_node == FakeRoute.HOME
    # the lookup home readied for the first query: its copy of the deployment, the route
    assert link.asked_at == [(FakeRoute.HOME, "copy_deployment", FakeRoute.DEPLOYMENT, 1)]
    assert link.prepared == [FakeRoute.HOME]


def test_a_home_that_cannot_be_readied_leaves_it_to_the_first_query():
    link = route()

    def down(node_id: str) -> None:
        raise NodeUnavailableError("the home's actor is restarting")
    link.prepare = down
    group = GroupRegistration(link, CONFIG)
    assert group.register((KV,)).home_node == FakeRoute.HOME  # registered all the same
    assert not group.outdated((KV,))
    assert group.exists(["a"], []) == FakeRoute.HIT
    # CONTROL: another error is raised, not left to the query
    link.prepare = lambda node_id: 1 / 0
    with pytest.raises(ZeroDivisionError):
        group.register((KV,))


def test_outdated_until_registered_with_these_pools_on_this_attachment():
    link = route()
    group = GroupRegistration(link, CONFIG)
    assert group.outdated((KV,))  # never registered
    group.register((KV,))
    assert not group.outdated((KV,))
    assert group.outdated((KV, MAMBA))  # the registered pools changed
    link.controller_attached = False  # the link re-attached since
    assert group.outdated((KV,))


def test_a_query_goes_to_the_home_node_with_the_registered_version():
    link = route()
    group = GroupRegistration(link, CONFIG)
    group.register((KV,))
    group.register((KV, MAMBA))  # version 2
    q = [PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 2)]
    assert group.exists(["a", "b"], q) == FakeRoute.HIT
    assert link.data_ops == [(DataOp.GROUP_EXISTS, FakeRoute.HOME, FakeRoute.DEPLOYMENT, 2,
                              (1, 1), "e1", ["a", "b"], q)]


def test_a_query_before_registering_is_a_bug():
    with pytest.raises(AssertionError, match="register before a group query"):
        GroupRegistration(route(), CONFIG).exists(["a"], [])
