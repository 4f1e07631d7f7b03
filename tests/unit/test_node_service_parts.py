"""The pure parts of a node actor's service, each on its own (no Ray, no Mooncake): the
owner masks of a data call, the copies of deployments for group queries, the watch on
engine processes, a pool table's check that a call's pools are still published, and the
assembly of ``stats``. The same code runs inside ``NodeService`` in the integration
tests (test_ownership, test_group, test_engine_reaper, test_node_pools)."""

from types import MappingProxyType, SimpleNamespace

import pytest
from raykv.cache_actors.errors import DeadlineExceededError, StalePoolsError
from raykv.cache_actors.node.deployment_copies import DeploymentCopies
from raykv.cache_actors.node.engine_watch import EngineWatch
from raykv.cache_actors.node.node_pools import PoolTable
from raykv.cache_actors.node.node_stats import node_stats, pool_owner
from raykv.cache_actors.node.owner_masks import (
    allowed,
    check_group_claim,
    merged,
    outside,
    refused,
)
from raykv.controllers.node_records import PoolOwner, PoolStats, StoreStats, TenantUse
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.ownership import TENANT_KEYS, Owner, OwnerClaim

from tests.unit.fakes import IDLE_NODE

A = OwnerClaim("a_", key_prefix="a_")
B_OWNER = Owner("b_")


def test_keys_outside_a_prefix_and_tenant_keys_without_one():
    assert outside(["a_1", "a_2"], A) is None
    assert outside(["a_1", "b_2"], A) == [False, True]
    assert outside(["x", "y"], None) is None
    assert outside(["x", TENANT_KEYS + "k"], None) == [False, True]


def pool(name: str, nbytes: int = 64):
    layout = SimpleNamespace(kind="mla", num_pages=4)
    return SimpleNamespace(name=name, nbytes=nbytes,
                           handle=SimpleNamespace(layout=layout))


def table_of(owners: dict, epoch: int = 1) -> PoolTable:
    return PoolTable(epoch, MappingProxyType({n: pool(n) for n in owners}),
                     MappingProxyType(owners))


def test_objects_of_other_owners_pools_are_masked_and_their_codes_put_back():
    table = table_of({"mine": A.owner, "theirs": B_OWNER})
    batch = ObjectBatch(epoch=1)
    batch.add("a_1", "mine", 0, 8)
    batch.add("a_2", "theirs", 0, 8)
    batch.add("b_3", "mine", 8, 8)
    mask = refused(batch, tuple(table.pools.values()), table, A)
    assert mask == [False, True, True]
    moving = allowed(batch, mask)
    assert (moving.keys, moving.pools, moving.epoch) == (["a_1"], ["mine"], 1)
    assert merged([0], mask, -3) == [0, -3, -3]
    # the caller's own pools and keys: nothing masked
    own = ObjectBatch(epoch=1)
    own.add("a_1", "mine", 0, 8)
    assert refused(own, (table.pools["mine"],), table, A) is None


def test_group_queries_of_another_deployment_are_refused():
    check_group_claim("a_", A, lambda d: True)
    check_group_claim("a_", None, lambda d: False)
    with pytest.raises(ValueError, match="may not query"):
        check_group_claim("b_", A, lambda d: False)
    with pytest.raises(ValueError, match="needs its owner claim"):
        check_group_claim("a_", None, lambda d: True)


def test_deployment_copies_fetch_only_when_missing_or_older():
    fetched = []

    def fetch(dep_id):
        fetched.append(dep_id)
        return SimpleNamespace(deployment_id=dep_id, version=len(fetched))

    told = []
    copies = DeploymentCopies(fetch, lambda: told.append(1))
    assert copies.known("d", 1) is None
    assert copies.get("d", 1).version == 1
    assert copies.get("d", 1).version == 1 and fetched == ["d"]  # the copy serves
    assert copies.get("d", 2).version == 2 and fetched == ["d", "d"]  # older: fetched
    assert copies.known("d", 2).version == 2
    assert len(told) == len(fetched)  # each fetch told (the node's deployment_fetches)


def test_a_controller_that_does_not_answer_is_a_deadline():
    def fetch(dep_id):
        raise TimeoutError

    with pytest.raises(DeadlineExceededError, match="did not hand over"):
        DeploymentCopies(fetch).get("d", 1)


class Process:
    def __init__(self) -> None:
        self.up = True

    def alive(self) -> bool:
        return self.up


def test_an_engine_pool_is_due_a_grace_after_its_process_was_seen_gone():
    watch, process, other = EngineWatch(), Process(), Process()
    watch.watch("p", process)
    watch.watch("q", other)
    assert watch.due(watch.watched(), now=100.0, grace_s=0.0) == []  # both run
    process.up = False
    assert watch.due(watch.watched(), now=101.0, grace_s=5.0) == []  # seen gone at 101
    assert watch.due(watch.watched(), now=105.0, grace_s=5.0) == []
    assert watch.due(watch.watched(), now=106.0, grace_s=5.0) == ["p"]
    watch.forget("p")
    assert watch.due(watch.watched(), now=200.0, grace_s=0.0) == []
    other.up = False
    watch.clear()
    assert watch.due(watch.watched(), now=300.0, grace_s=0.0) == []


def test_a_call_whose_pools_left_the_table_is_refused():
    table = table_of({"p": None, "q": None})
    used = (table.pools["p"],)
    table.check_current(table, used)
    table.check_current(table.replaced("q", None), used)  # another pool left: fine
    with pytest.raises(ValueError, match="destroyed"):
        table.check_current(table.replaced("p", None), used)
    with pytest.raises(StalePoolsError):
        table.check_current(PoolTable(2), used)


class Metrics:
    def pool_counters(self, name):
        return {"puts": len(name)}

    def counters(self):
        return {"put": 1}

    def group_queries(self):
        return IDLE_NODE.group_queries

    def merged_calls(self):
        return IDLE_NODE.merged_calls


def test_stats_show_pools_owners_and_tenants():
    table = table_of({"p": Owner("d", "t"), "legacy": None})
    store = StoreStats(mode="embedded", host_pool_bytes=0, host_pool_used=128,
                       exposed_ports=[], mooncake_endpoint=None, own_segment=None)
    idle = IDLE_NODE
    stats = node_stats(table, {"t": 1000, "u": 5}, store, Metrics(),
                       node_id="n", uptime_s=1.0, segment_size=7, confirmed_pages=3,
                       l2=idle.l2, warnings=["w"], residency=idle.residency,
                       warmup=idle.warmup, l2_evictions=idle.l2_evictions, loads=idle.loads)
    assert stats.mode == "embedded" and stats.global_segment_size == 7
    assert stats.host_pool_used == 128 and stats.mooncake_client is None
    assert stats.pools["p"] == PoolStats(kind="mla", bytes=64, pages=4,
                                         owner=PoolOwner(deployment="d", tenant="t"),
                                         counters={"puts": 1})
    assert stats.pools["legacy"].owner is None
    assert stats.tenants == {"t": TenantUse(pool_bytes=64, pools=1, quota=1000),
                             "u": TenantUse(pool_bytes=0, pools=0, quota=5)}
    assert stats.untenanted == TenantUse(pool_bytes=64, pools=1, quota=None)
    assert stats.confirmed_pages == 3 and stats.l2 is idle.l2 and stats.warnings == ["w"]
    assert pool_owner(None) is None
