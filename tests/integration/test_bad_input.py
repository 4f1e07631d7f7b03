"""Bad input: a ValueError naming the problem, raised before any byte moves; the node
actor keeps serving. Runs against the real embedded cluster."""

import pytest
import ray
import torch
from raykv import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.object_batch import ObjectBatch

from tests.integration.ranks import MHA, MLA, indices, start_rank

KV_POOL = "bad-input-kv"


@pytest.fixture(scope="module")
def client(cluster):
    c = CacheClient(StorageConfig(model_name="bad/input"))
    pool = c.create_host_pool("mha", name=KV_POOL, **MHA)
    c.register_mem_pool_host(pool)
    yield c
    c.destroy_host_pool(pool)


def moved(client) -> dict:
    counters = client.stats().counters
    return {k: v for k, v in counters.items() if k.startswith(("put", "get"))}


V1_CASES = [
    (["a", "b"], indices(0, 3), "entries but 2 keys need 8"),
    ([], indices(0, 0), "keys is empty"),
    (["a", ""], indices(0, 2), "non-empty strings"),
    (["a", 3], indices(0, 2), "non-empty strings"),
    ("abc", indices(0, 3), "list of strings"),
    (["a", "a"], indices(0, 2), "appears at positions 0 and 1"),
    (["a"], indices(64, 1), r"span \[64, 67\]"),
    (["a"], torch.arange(-4, 0), "span"),
    (["a"], torch.arange(2, 6), "not aligned"),
    (["a"], torch.tensor([0, 2, 1, 3]), "contiguous"),
]


@pytest.mark.parametrize(("keys", "idx", "msg"), V1_CASES)
@pytest.mark.parametrize("method", ["batch_set_v1", "batch_get_v1"])
def test_v1_bad_input(client, method, keys, idx, msg):
    before = moved(client)
    with pytest.raises(ValueError, match=msg):
        getattr(client, method)(keys, idx)
    assert moved(client) == before


@pytest.mark.parametrize(("keys", "msg"), [([], "empty"), (["x", ""], "non-empty")])
def test_exists_bad_keys(client, keys, msg):
    with pytest.raises(ValueError, match=msg):
        client.batch_exists(keys)


def test_pointer_api_bad_input(client):
    pool = client.attach_host_pool(KV_POOL)
    ptrs, sizes = pool.get_page_buffer_meta(indices(0, 1))
    outside = torch.zeros(4096, dtype=torch.uint8)
    before = moved(client)
    cases = [
        (["k"], [outside.data_ptr()], [4096], "do not lie inside a shared pool"),
        (["k"], [pool.base_ptr + pool.nbytes - 8], [64], "do not lie inside"),
        (["k"], [pool.base_ptr - 1], [8], "do not lie inside"),
        (["k", "v"], ptrs, sizes[:1], "lengths must match"),
        (["k"], None, None, "required"),
    ]
    for keys, locs, szs, msg in cases:
        for method in ("batch_set", "batch_get"):
            with pytest.raises(ValueError, match=msg):
                getattr(client, method)(keys, target_locations=locs, target_sizes=szs)
    assert moved(client) == before


def test_unregistered_pool(cluster):
    c = CacheClient(StorageConfig())
    with pytest.raises(ValueError, match="no 'kv' host pool is registered"):
        c.batch_set_v1(["a"], indices(0, 1))
    with pytest.raises(ValueError, match="pool returned by this client"):
        c.register_mem_pool_host(object())


def test_pool_kind_must_match_model(cluster):
    c = CacheClient(StorageConfig(is_mla_model=True))
    pool = c.create_host_pool("mha", **MHA)
    try:
        with pytest.raises(ValueError, match="is MHA but the config says is_mla_model=True"):
            c.register_mem_pool_host(pool)
    finally:
        c.destroy_host_pool(pool)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        (MHA | {"order": "layer_first"}, "page order 'layer_first' cannot be served"),
        (MHA | {"size": 30}, "multiple of page_size"),
        (MHA | {"head_num": 0}, "head_num must be a positive int"),
        (MHA | {"dtype": "notatype"}, "not a torch dtype"),
        (MHA | {"name": "../etc"}, "pool name"),
    ],
)
def test_bad_pools(client, kw, msg):
    with pytest.raises(ValueError, match=msg):
        client.create_host_pool("mha", **kw)


def test_same_name_other_shape_refused(client):
    client.create_host_pool("mla", name="shape-clash", **MLA)
    try:
        with pytest.raises(ValueError, match="exists on this node with another layout"):
            client.create_host_pool("mla", name="shape-clash", **(MLA | {"layer_num": 3}))
    finally:
        client.destroy_host_pool("shape-clash")


def test_attach_missing_pool(client):
    with pytest.raises(ValueError, match="no pool named 'nope'"):
        client.attach_host_pool("nope")


def test_node_actor_rejects_bad_batches_and_keeps_serving(cluster, client, uid):
    """Requests that bypass the client are checked again by the actor itself."""
    actor = cluster.node_actors[client.node_id]
    pool = client.attach_host_pool(KV_POOL)
    bad = [
        ObjectBatch([f"{uid}a"], [pool.name], [pool.nbytes], [8]),
        ObjectBatch([f"{uid}a"], ["no-such-pool"], [0], [8]),
        ObjectBatch([f"{uid}a", f"{uid}a"], [pool.name] * 2, [0, 8], [8, 8]),
        ObjectBatch([""], [pool.name], [0], [8]),
        ObjectBatch([f"{uid}a"], [pool.name], [0, 1], [8]),
    ]
    for batch in bad:
        for method in (actor.put, actor.get):
            with pytest.raises(ValueError):
                ray.get(method.remote(batch))
    assert ray.get(actor.health.remote())["store_healthy"]
    keys = [f"{uid}-{i}" for i in range(2)]
    assert client.batch_set_v1(keys, indices(0, 2)) == [True, True]
    assert client.batch_get_v1(keys, indices(8, 2)) == [True, True]


def test_ill_typed_and_huge_batches_fail_alone_beside_honest_ranks(cluster, client, uid):
    """Batches of the wrong types or over ``MAX_BATCH_OBJECTS`` sent straight to the
    node actor's Ray methods while honest ranks put and get through the same actor (whose
    store calls merge concurrent ranks' batches): each bad call gets a ValueError naming
    the problem, before it is merged with anyone's work; the honest pages round-trip."""
    actor = cluster.node_actors[client.node_id]
    pool = client.attach_host_pool(KV_POOL)
    node = client.node_id
    honest = [start_rank(node, StorageConfig(model_name=f"honest/{uid}{i}"),
                         pool_name=f"bad-input-honest{i}") for i in range(3)]
    ray.get([r.fill.remote(i) for i, r in enumerate(honest)])
    huge = 1_000_000
    bad = [
        (ObjectBatch([f"{uid}a"], [pool.name], [0.5], [8]), r"offsets\[0\] is 0.5"),
        (ObjectBatch([1], [pool.name], [0], [8]), "key 0 is 1"),
        (ObjectBatch([b"k"], [pool.name], [0], [8]), "key 0 is b'k'"),
        (ObjectBatch([f"{uid}a"], [pool.name], [0], [True]), r"sizes\[0\] is True"),
        (ObjectBatch([f"{uid}a"], [pool.name], [0], [8], epoch="0"), "epoch"),
        (ObjectBatch([f"{uid}a"], [7], [0], [8]), "pool names"),
        (ObjectBatch([f"{uid}{i}" for i in range(huge)], [pool.name] * huge, [0] * huge,
                     [8] * huge), "MAX_BATCH_OBJECTS=65536"),
    ]
    keys = [[f"{uid}-h{i}-{p}" for p in range(8)] for i in range(len(honest))]
    puts = [r.call.remote("batch_set_v1", k, indices(0, 8))
            for r, k in zip(honest, keys, strict=True)]
    for batch, msg in bad:
        for method in (actor.put, actor.get):
            with pytest.raises(ValueError, match=msg):
                ray.get(method.remote(batch))
    with pytest.raises(ValueError, match="key 1 is 3"):
        ray.get(actor.exists.remote([f"{uid}a", 3]))
    with pytest.raises(ValueError, match="MAX_BATCH_OBJECTS"):
        ray.get(actor.exists.remote([f"{uid}{i}" for i in range(huge)]))
    assert ray.get(puts) == [[True] * 8] * len(honest)
    gets = [r.call.remote("batch_get_v1", k, indices(32, 8))
            for r, k in zip(honest, keys, strict=True)]
    assert ray.get(gets) == [[True] * 8] * len(honest)
    for r in honest:
        wrote, read = ray.get([r.pages.remote(0, 8), r.pages.remote(32, 8)])
        assert torch.equal(wrote.view(torch.uint8), read.view(torch.uint8))
    assert ray.get(actor.health.remote())["store_healthy"]
