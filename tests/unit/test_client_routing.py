"""CacheClient's routing against the shared fake node route (``FakeRoute``: no Ray, no
Mooncake): which data op each call makes, to which node, with which objects, and when it
registers with the controller; pools are real shared memory made by the fake route."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from raykv.cache_actors.data_ops import DataOp
from raykv.cache_actors.host_pools import HostPool
from raykv.cache_actors.rank import client as client_module
from raykv.cache_actors.rank.client import CacheClient
from raykv.controllers.contract import (
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    StorageConfig,
)
from raykv.controllers.deployments import PoolQuery
from raykv.controllers.ownership import claim_of, tenant_digest

from tests.unit.fakes import FakeRoute

NODE, HOME, HIT = "n" * 40, FakeRoute.HOME, FakeRoute.HIT


@pytest.fixture
def make(monkeypatch):
    monkeypatch.setattr(client_module, "NodeLink", FakeRoute)
    monkeypatch.setattr(client_module, "ray", SimpleNamespace(
        is_initialized=lambda: True,
        get_runtime_context=lambda: SimpleNamespace(get_node_id=lambda: NODE)))
    clients: list[CacheClient] = []

    def make(**config) -> tuple[CacheClient, FakeRoute]:
        c = CacheClient(StorageConfig(model_name="org/m", **config))
        clients.append(c)
        return c, FakeRoute.made[-1]
    yield make
    for c in clients:
        c.close()


def kv_pool(client: CacheClient, mla: bool = False) -> HostPool:
    shape = dict(layer_num=1, kv_cache_dim=8) if mla else dict(layer_num=1, head_num=1,
                                                                head_dim=4)
    pool = client.create_host_pool("mla" if mla else "mha", size=8, page_size=2,
                                   dtype=torch.uint8, **shape)
    client.register_mem_pool_host(pool)
    return pool


def test_the_link_is_made_for_the_rank_with_its_deadline(make):
    client, link = make(extra_config={"timeout_s": 1.5})
    assert link.node_id == NODE and link.namespace == "raykv" and link.timeout_s == 1.5
    assert link.owner.base == claim_of(client.config) == client.owner_claim()
    assert link.owner.base.key_prefix == client.key_scheme.prefix
    assert client.health() == {"mode": "embedded"} and client.stats() == {"counters": {}}
    assert [c[0] for c in link.calls] == ["health", "stats"] and link.data_ops == []


def test_a_mode_that_contradicts_the_node_actor_is_refused(make):
    with pytest.raises(ValueError, match="runs in embedded mode"):
        make(extra_config={"standalone_storage": True})


def test_v2_puts_and_gets_are_one_data_op_each_on_this_node(make):
    client, link = make()
    pool = kv_pool(client)
    assert client.batch_set_v2([PoolTransfer(PoolName.KV, ["a", "b"], list(range(4)))]) == {
        PoolName.KV: [True, True]}
    assert client.batch_get_v2([PoolTransfer(PoolName.KV, ["a"], [2, 3])]) == {
        PoolName.KV: [True]}
    (put, node, batch), (get, node2, read) = link.data_ops
    assert (put, node, get, node2) == (DataOp.PUT, None, DataOp.GET, None)
    assert batch.keys == ["org-m_a_0_k", "org-m_a_0_v", "org-m_b_0_k", "org-m_b_0_v"]
    assert set(batch.pools) == {pool.name} and read.keys == ["org-m_a_0_k", "org-m_a_0_v"]


def test_every_rank_puts_a_replicated_pool_and_reports_what_the_store_holds(make):
    """TP rank 1 of an MLA model puts the group's one copy too (put-if-absent): its page
    is True only from the store's code, never without sending (SGLang's MooncakeStore
    does the same; a rank alone must find what it stored)."""
    client, link = make(tp_rank=1, tp_size=2, is_mla_model=True)
    kv_pool(client, mla=True)
    assert client.batch_set_v1(["a"], [0, 1]) == [True]
    ((op, _, batch),) = link.data_ops
    assert op == DataOp.PUT and batch.keys == ["org-m_a__k"]
    assert client.batch_get_v1(["a"], [0, 1]) == [True]
    assert [op for op, *_ in link.data_ops] == [DataOp.PUT, DataOp.GET]


def test_a_rank_hit_is_one_exists_op_of_its_own_objects(make):
    client, link = make()
    kv_pool(client)
    assert client.batch_exists(["a", "b"]) == 2
    ((op, node, names),) = link.data_ops
    assert (op, node) == (DataOp.EXISTS, None)
    assert sorted(names) == sorted(f"org-m_{h}_0_{b}" for h in "ab" for b in "kv")


def test_the_pointer_api_puts_and_gets_on_this_node(make):
    client, link = make()
    pool = kv_pool(client)
    ptrs, sizes = pool.get_page_buffer_meta(list(range(2)))
    assert client.batch_set(["x_k", "x_v"], ptrs, sizes) is True
    assert client.batch_get(["x_k", "x_v"], ptrs, sizes) == 2
    assert [(op, node) for op, node, _ in link.data_ops] == [(DataOp.PUT, None),
                                                             (DataOp.GET, None)]
    assert link.data_ops[0][2].keys == ["org-m_x_k", "org-m_x_v"]


def test_a_group_query_registers_once_then_goes_to_the_home_node(make):
    client, link = make(tp_rank=1, tp_size=2)
    kv_pool(client)
    assert client.group_exists(["a"]) == HIT
    assert client.group_exists(["a", "b"]) == HIT
    ((config, specs, node),) = link.registered  # registered before the first query only
    assert config is client.config and node == NODE
    assert [s.role for s in specs] == [PoolName.KV]
    assert link.data_ops == [
        (DataOp.GROUP_EXISTS, HOME, "org", 1, (1, 0), "", ["a"], []),
        (DataOp.GROUP_EXISTS, HOME, "org", 1, (1, 0), "", ["a", "b"], [])]


def test_a_group_query_registers_again_after_a_reattach_or_new_pools(make):
    client, link = make()
    kv_pool(client)
    client.group_exists(["a"])
    link.controller_attached = False  # the link re-attached: the group may have moved
    client.group_exists(["a"])
    assert len(link.registered) == 2
    # a registration on a group query runs within the query's deadline (never a
    # control call's 120 s on an engine's step)
    assert link.register_depths == [1, 1]
    assert link.bounds == [("group_exists", client.config.timeout_s)] * 2
    mamba = client.create_host_pool("mamba", size=4, temporal_shape=(2,), conv_shapes=[(2,)],
                                    dtype=torch.uint8)
    client.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    client.group_exists(["a"], [PoolTransfer(PoolName.MAMBA, ["a"],
                                             hit_policy=PoolHitPolicy.TRAILING_PAGES)])
    assert len(link.registered) == 3
    assert [s.role for s in link.registered[-1][1]] == [PoolName.KV, PoolName.MAMBA]
    assert link.data_ops[-1][1:] == (HOME, "org", 3, (0, 0), "", ["a"], [
        PoolQuery(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, 1)])


def test_bad_input_never_reaches_the_link(make):
    client, link = make()
    kv_pool(client)
    for call in (lambda: client.batch_set_v1(["a"], [1, 2]),  # not page-aligned
                 lambda: client.batch_exists([]),
                 lambda: client.group_exists(["a", "a"]),
                 lambda: client.batch_set(["k"], [0], [8])):  # not inside a pool
        with pytest.raises(ValueError):
            call()
    assert link.data_ops == [] and link.registered == []


# ------------------------------------------------------------------ tenants
def test_a_tenant_rank_needs_its_secret(make, monkeypatch):
    monkeypatch.delenv("RAYKV_TENANT_SECRET", raising=False)
    with pytest.raises(ValueError, match="tenant 'acme' needs its secret in "
                                         "\\$RAYKV_TENANT_SECRET.*not set"):
        make(extra_config={"tenant": "acme"})
    monkeypatch.setenv("RAYKV_TENANT_SECRET", "short")
    with pytest.raises(ValueError, match="too short"):
        make(extra_config={"tenant": "acme"})


def test_a_tenant_rank_keys_every_page_hash_once_at_every_entry(make, monkeypatch):
    """v1 and v2 puts, gets and hits, a sidecar, the group query and the pointer API all
    send keyed hashes under the tenant prefix, each keyed exactly once; the controller is
    sent the config (no secret) and hands back the same scheme."""
    import pickle

    from raykv.controllers.ownership import verify_registration
    from raykv.controllers.tenancy import keyed_page_hash, page_key

    secret = "x" * 32
    monkeypatch.setenv("RAYKV_TENANT_SECRET", secret)
    client, link = make(extra_config={"tenant": "acme"})
    pool = kv_pool(client)
    idx = client.create_host_pool("indexer", size=8, page_size=2, layer_num=1,
                                  index_head_dim=4, dtype=torch.uint8)
    client.register_mem_host_pool_v2(idx, PoolName.INDEXER)
    p = client.key_scheme.prefix
    assert p.startswith("t1.4=acme.") and "org" in p

    def k(h: str) -> str:
        return p + keyed_page_hash(page_key(secret.encode()), h)

    client.batch_set_v2([PoolTransfer(PoolName.KV, ["a"], [0, 1]),
                         PoolTransfer(PoolName.INDEXER, indices_from_pool=PoolName.KV)])
    assert link.data_ops[-1][2].keys == [k("a") + "_0_k", k("a") + "_0_v", k("a") + "__indexer"]
    client.batch_get_v1(["b"], [2, 3])
    assert link.data_ops[-1][2].keys == [k("b") + "_0_k", k("b") + "_0_v"]
    client.batch_set_v1(["b"], [2, 3])
    assert link.data_ops[-1][2].keys == [k("b") + "_0_k", k("b") + "_0_v"]
    client.batch_exists(["c"])
    assert sorted(link.data_ops[-1][2]) == [k("c") + "_0_k", k("c") + "_0_v"]
    ptrs, sizes = pool.get_page_buffer_meta([0, 1])
    client.batch_set(["x_k", "x_v"], ptrs, sizes)
    assert link.data_ops[-1][2].keys == [k("x_k"), k("x_v")]
    client.batch_get(["x_k"], ptrs[:1], sizes[:1])
    assert link.data_ops[-1][2].keys == [k("x_k")]
    client.group_exists(["d", "e"])
    assert link.data_ops[-1][6] == [k(h)[len(p):] for h in "de"]
    ((config, specs, _),) = link.registered
    assert secret.encode() not in pickle.dumps((config, specs, link.proofs))
    # a proof signed over the controller's challenge, never the secret; good once
    keys: dict[str, str] = {}
    verify_registration(link.challenges, keys, claim_of(config), link.proofs[0])
    assert keys == {"acme": tenant_digest("acme")}
    with pytest.raises(ValueError, match="answered already"):
        verify_registration(link.challenges, keys, claim_of(config), link.proofs[0])
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(client)
    assert client.key_scheme.prefix == p
    assert "x" * 16 not in repr(client.__dict__)
    with pytest.raises(ValueError, match="'d' appears at positions 0 and 1"):
        client.group_exists(["d", "d"])
