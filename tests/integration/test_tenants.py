"""Tenants on a real two-node cluster (Ray + mooncake_master): each tenant finds, reads
and writes only its own objects; a process without the tenant secret can neither find
them nor plant objects the tenant would load; another model revision or KV dtype is a
miss, never a load. Every scenario has its control without a tenant, where the same
calls do cross-hit (so these tests can fail).

Clients run in this test process (``CacheClient`` reads ``$RAYKV_TENANT_SECRET`` when it
is made, so each is made under its own secret through ``monkeypatch``).
"""

from __future__ import annotations

import time

import pytest
import ray
import torch
from mooncake.store import MooncakeDistributedStore
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.tenancy import TENANT_SECRET_ENV, keyed_page_hash, page_key

from tests.integration.ranks import MHA, Rank, indices

N = 4          # pages per scenario
READ_AT = 32   # first slot pages are read into (written from slot 0)
SECRET_A, SECRET_B, SECRET_C = ("a" * 32, "b" * 32, "c" * 32)


@pytest.fixture
def make(cluster, monkeypatch):
    """``make(secret, seed, dtype=..., model_name=..., **extra_config)``: a client in
    this process made under ``secret`` (None: unset), with an MHA KV pool filled from
    ``seed``; its pools are destroyed and it is closed after the test."""
    made: list[tuple[CacheClient, object]] = []

    def make(secret: str | None, seed: int, *, model_name: str,
             dtype: torch.dtype = torch.float16, **extra) -> tuple[CacheClient, object]:
        if secret is None:
            monkeypatch.delenv(TENANT_SECRET_ENV, raising=False)
        else:
            monkeypatch.setenv(TENANT_SECRET_ENV, secret)
        client = CacheClient(StorageConfig(model_name=model_name, extra_config=extra))
        try:
            pool = client.create_host_pool("mha", **(MHA | {"dtype": dtype}))
            client.register_mem_pool_host(pool)
        except BaseException:
            client.close()
            raise
        g = torch.Generator().manual_seed(seed)
        pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(dtype))
        made.append((client, pool))
        return client, pool

    yield make
    for client, pool in made:
        client.destroy_host_pool(pool)
        client.close()


def pages(pool, start: int) -> torch.Tensor:
    """The bytes of ``N`` pages from slot ``start``, both buffers."""
    return pool.kv_buffer[:, start:start + N * MHA["page_size"]].contiguous().view(torch.uint8)


def write(client, keys) -> None:
    assert client.batch_set_v1(keys, indices(0, N)) == [True] * N


def read(client, keys) -> list[bool]:
    return client.batch_get_v1(keys, indices(READ_AT, N))


def miss(client, pool, keys) -> None:
    """``client`` finds none of ``keys`` and loads no byte of them into ``pool``."""
    before = pages(pool, READ_AT).clone()
    assert client.batch_exists(keys) == 0
    assert read(client, keys) == [False] * N
    assert torch.equal(pages(pool, READ_AT), before)


def test_two_tenants_write_the_same_hashes_and_each_reads_its_own(make, uid):
    model = f"org/{uid}"
    keys = [f"{uid}-{i}" for i in range(N)]
    a, pool_a = make(SECRET_A, 1, model_name=model, tenant="a")
    b, pool_b = make(SECRET_B, 2, model_name=model, tenant="b")
    write(a, keys)
    write(b, keys)
    assert read(a, keys) == [True] * N and read(b, keys) == [True] * N
    assert torch.equal(pages(pool_a, READ_AT), pages(pool_a, 0))
    assert torch.equal(pages(pool_b, READ_AT), pages(pool_b, 0))
    assert not torch.equal(pages(pool_a, 0), pages(pool_b, 0))
    for other, other_pool in (make(SECRET_C, 3, model_name=model, tenant="c"),
                              make(None, 4, model_name=model)):
        miss(other, other_pool, keys)
        assert other.group_exists(keys).kv_hit_pages == 0
    assert a.group_exists(keys).kv_hit_pages == N  # control: the owner's group finds them


def test_control_without_tenants_the_second_writer_reads_the_first_ones_bytes(make, uid):
    model = f"org/{uid}"
    keys = [f"{uid}-{i}" for i in range(N)]
    a, pool_a = make(None, 1, model_name=model)
    b, pool_b = make(None, 2, model_name=model)
    write(a, keys)
    write(b, keys)  # put-if-absent: a's objects stay
    assert read(b, keys) == [True] * N
    assert torch.equal(pages(pool_b, READ_AT), pages(pool_a, 0))  # the cross hit
    third, _ = make(None, 3, model_name=model)
    assert third.batch_exists(keys) == N


def test_the_right_tenant_with_a_wrong_secret_finds_nothing(make, cluster, uid):
    """An impostor claims tenant "a" with another secret. The node actor, which bound
    "a"'s owner key at the owner's first pool, refuses its owner session; and the store itself
    (a plain Mooncake client, which any process that reaches the master can be) holds
    nothing under the keys the impostor can compute, though the tenant's prefix is
    public. Controls: under the owner's secret the same computation names every object,
    and a client with the right secret reads them."""
    model = f"org/{uid}"
    keys = [f"{uid}-{i}" for i in range(N)]
    owner, pool = make(SECRET_A, 1, model_name=model, tenant="a")
    write(owner, keys)
    with pytest.raises(ValueError, match="owner key differs"):
        make(SECRET_B, 2, model_name=model, tenant="a")

    def objects(secret: str) -> list[str]:
        return [k for h in keys for k in owner.key_scheme.kv_keys(
            keyed_page_hash(page_key(secret.encode()), h))]

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    try:
        assert store.batch_is_exist(objects(SECRET_B)) == [0] * (2 * N)
        assert store.batch_is_exist([k for h in keys for k in owner.key_scheme.kv_keys(h)]) \
            == [0] * (2 * N)  # nor under the raw page hashes
        assert store.batch_is_exist(objects(SECRET_A)) == [1] * (2 * N)  # control
    finally:
        store.close()
    twin, twin_pool = make(SECRET_A, 3, model_name=model, tenant="a")
    assert twin.batch_exists(keys) == N and read(twin, keys) == [True] * N
    assert torch.equal(pages(twin_pool, READ_AT), pages(pool, 0))


def test_pre_poisoned_objects_are_never_loaded(make, cluster, uid):
    """A process without the secret writes poison first: under the keys the victim
    would use without a tenant, and under the victim's own tenant prefix (which anyone
    can compute) with the raw page hashes. A rank whose ``extra_backend_tag`` makes its
    prefix the tenant's is refused by the node actor (a tenant's keys are out of reach
    of any claim but the tenant's), so the poison goes in through a plain Mooncake
    client, as any process that reaches the master can."""
    model = f"org/{uid}"
    keys = [f"{uid}-{i}" for i in range(N)]
    legacy, poison = make(None, 666, model_name=model)
    write(legacy, keys)
    victim, pool = make(SECRET_A, 1, model_name=model, tenant="a")
    with pytest.raises(ValueError, match="or a tenant's"):
        make(None, 667, model_name=None, extra_backend_tag=victim.key_scheme.prefix[:-1])
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", cluster.metadata_server, 16 << 20, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    try:
        planted = [k for h in keys for k in victim.key_scheme.kv_keys(h)]
        size = pages(poison, 0).numel() // (2 * N)
        assert [store.put(k, b"\x66" * size) for k in planted] == [0] * len(planted)
        assert store.batch_is_exist(planted) == [1] * len(planted)
    finally:
        store.close()
    miss(victim, pool, keys)
    write(victim, keys)  # then the victim's own objects work
    assert read(victim, keys) == [True] * N
    assert torch.equal(pages(pool, READ_AT), pages(pool, 0))
    # Control: without a tenant the victim loads the poison.
    plain, plain_pool = make(None, 2, model_name=model)
    assert read(plain, keys) == [True] * N
    assert torch.equal(pages(plain_pool, READ_AT), pages(poison, 0))


@pytest.mark.parametrize("change", ["model_revision", "kv_dtype"])
def test_another_revision_or_kv_dtype_is_a_miss_never_a_load(make, uid, change):
    """Writer and reader differ in the revision of the weights or in the KV dtype
    (float16 vs bfloat16: the same page size in bytes, so a load would "work")."""
    model = f"org/{uid}"
    keys = [f"{uid}-{i}" for i in range(N)]
    writer_kw = {"model_revision": "r1", "kv_dtype": "float16"}
    reader_kw = writer_kw | ({"model_revision": "r2"} if change == "model_revision"
                             else {"kv_dtype": "bfloat16", "dtype": torch.bfloat16})
    writer, _ = make(SECRET_A, 1, model_name=model, tenant="a", **writer_kw)
    write(writer, keys)
    reader, rpool = make(SECRET_A, 2, model_name=model, tenant="a", **reader_kw)
    miss(reader, rpool, keys)
    assert reader.group_exists(keys).kv_hit_pages == 0  # its own deployment
    assert writer.batch_exists(keys) == N  # control: the writer's objects are there
    # Control: without a tenant the reader loads the writer's bytes; only registering
    # (as a group query does) tells it apart, and refuses it.
    plain_model = f"plain/{uid}"
    plain_writer, wpool = make(None, 3, model_name=plain_model, **writer_kw)
    write(plain_writer, keys)
    assert plain_writer.group_exists(keys).kv_hit_pages == N
    plain_reader, ppool = make(None, 4, model_name=plain_model, **reader_kw)
    assert read(plain_reader, keys) == [True] * N
    assert torch.equal(pages(ppool, READ_AT), pages(wpool, 0))  # the writer's bytes
    with pytest.raises(ValueError, match=f"{change}=.*tenant.*extra_backend_tag"):
        plain_reader.group_exists(keys)


def test_models_sharing_sglang_keys_are_refused_without_a_tenant(make, uid):
    keys = [f"{uid}-0"]
    first, _ = make(None, 1, model_name=f"org/{uid}")
    assert first.group_exists(keys).kv_hit_pages == 0
    second, _ = make(None, 2, model_name=f"org-{uid}")
    assert second.key_scheme.prefix == first.key_scheme.prefix  # SGLang's keys, kept
    with pytest.raises(ValueError, match=f"model_name='org-{uid}' \\(theirs: 'org/{uid}'\\)"
                                         ".*tenant.*extra_backend_tag"):
        second.group_exists(keys)
    # With a tenant the two models are two deployments.
    for i, name in enumerate((f"org/{uid}", f"org-{uid}")):
        c, _ = make(SECRET_A, 3 + i, model_name=name, tenant="a")
        assert c.group_exists(keys).kv_hit_pages == 0


def test_a_tenant_without_its_secret_is_refused_at_construction(monkeypatch):
    monkeypatch.delenv(TENANT_SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match="tenant 'a' needs its secret in "
                                         f"\\${TENANT_SECRET_ENV}"):
        CacheClient(StorageConfig(model_name="org/m", extra_config={"tenant": "a"}))


def test_an_impostor_on_another_node_cannot_register_the_tenants_deployment(make, cluster,
                                                                            uid):
    """The tenant registers from this node; an impostor with another secret on the other
    node (where the tenant never ran, so that node actor binds the impostor's owner key
    and lets it make a pool) is refused by the controller, which bound the tenant's key
    at its first registration: it cannot register conflicting pools under the tenant's
    deployment and so block the tenant's next ranks. The tenant's own ranks keep
    registering (control)."""
    tenant, model = f"reg-{uid}", f"org/{uid}"
    owner, _ = make(SECRET_A, 1, model_name=model, tenant=tenant)
    dep = owner.register_deployment()
    other = next(n for n in cluster.node_ids if n != owner.node_id)
    config = StorageConfig(model_name=model, extra_config={"tenant": tenant})
    impostor = Rank.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(other, soft=False),
        runtime_env={"env_vars": {TENANT_SECRET_ENV: SECRET_B}}).remote(config)
    with pytest.raises(ray.exceptions.RayTaskError,
                       match="differs from the one the controller bound"):
        ray.get(impostor.call.remote("register_deployment"))
    ray.kill(impostor)
    twin, _ = make(SECRET_A, 2, model_name=model, tenant=tenant)
    assert twin.register_deployment() == dep  # CONTROL: the tenant's secret registers


def test_a_tenants_router_finds_its_prefix_and_learns_nothing_of_others(cluster,
                                                                        monkeypatch, uid):
    """``RayKVRouter``'s look-up (``NodeAnswers``) for a tenant: with the tenant's
    secret it opens owner sessions with both node actors and finds the tenant's pages
    in node 1's L2, on its segment and in L3 (node 2: L3); another tenant's router,
    asking about the same prompt, finds nothing (its keys are its own); a router
    claiming the tenant with another secret gets no answer at all (its session is
    refused), so it would route by power of two. The same for node 1's residency log
    (what a router's view is kept from): the tenant's keys in L2 and on the segment,
    none for the other tenant, no answer for the impostor."""
    import asyncio

    from raykv.cache_actors.rank.rank_owner import RankOwner
    from raykv.controllers.naming import NAMESPACE
    from raykv.controllers.pool_layout import PoolLayout
    from raykv.integrations.serve.node_answers import NodeAnswers
    from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions

    node1, node2 = cluster.node_ids
    prompt = list(range(3, 3 + 4 * 6 + 1))  # 6 loadable blocks of 4 tokens

    def router(tenant: str, secret: str) -> tuple[RouteKeys, NodeAnswers]:
        monkeypatch.setenv(TENANT_SECRET_ENV, secret)
        keys = RouteKeys(RouteOptions.parse({"model_name": f"org/rt-{uid}", "block_size": 4,
                                             "tenant": tenant}))
        return keys, NodeAnswers(NAMESPACE, RankOwner.of_config(keys.config))

    def changes(nodes: NodeAnswers):
        return asyncio.run(nodes.changes(node1, None, 10.0))

    def ask(keys: RouteKeys, nodes: NodeAnswers) -> dict:
        got = asyncio.run(nodes.ask(cluster.node_ids, keys.keys(prompt), 1, 10.0))
        return {n: r.best() for n, r in got.items()}

    keys, nodes = router(f"ra{uid}", SECRET_A)
    client = CacheClient(keys.config, node_id=node1)
    try:
        link = client.l2()
        hashes = keys.page_hashes(prompt)
        pool = link.open(PoolLayout.vllm(page_size=4, size=24, layer_num=1, head_num=1,
                                         head_dim=8, dtype="bfloat16", itemsize=2), 6)
        pages = link.reserve(pool.name, hashes)
        assert link.commit(pool.name, hashes, pages, [True] * 6) == 6
        for _ in range(200):
            if client.stats().l2.l3_put >= 6:
                break
            time.sleep(0.05)
        assert ask(keys, nodes) == {node1: (6, 6, 6), node2: (0, 0, 6)}
        assert ask(*router(f"rb{uid}", SECRET_B)) == {node1: (0, 0, 0), node2: (0, 0, 0)}
        impostor_keys, impostor = router(f"ra{uid}", SECRET_C)
        assert ask(impostor_keys, impostor) == {} and impostor.counts["failed"] == 2
        # the residency log a router's view is kept from: the tenant's own keys only
        tenant_keys = set(keys.keys(prompt))
        got = changes(nodes)
        assert got.reset and {("l2", k, True) for k in tenant_keys} | {
            ("segment", k, True) for k in tenant_keys} == set(got.changes)
        assert changes(router(f"rb{uid}", SECRET_B)[1]).changes == []
        with pytest.raises(Exception, match="session|proof|refused"):
            changes(router(f"ra{uid}", SECRET_C)[1])
    finally:
        client.close()
