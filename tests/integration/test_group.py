"""Group hits through the group's home node actor, rank-consistent answers, conflicts, and recovery
of the controller and of node actors, on a real two-node cluster; and ``RayKVRouter``
routing Ray Serve deployments by where these node actors hold a prefix (last: it starts
Ray Serve on the cluster)."""

import contextlib
import os
import random
import signal
import time
from types import SimpleNamespace

import pytest
import ray
import torch
from mooncake.store import MooncakeDistributedStore
from ray.experimental import internal_kv
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import CacheClient, NodeUnavailableError
from raykv.controllers import (
    CONTROLLER_NAME,
    NAMESPACE,
    PoolName,
    PoolTransfer,
    StorageConfig,
    node_actor_name,
)
from raykv.controllers.contract import PoolHitPolicy
from raykv.controllers.controller import checkpoint_key
from raykv.controllers.deployments import PoolQuery, deployment_id
from raykv.controllers.pool_layout import PoolLayout
from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions
from raykv.integrations.serve.text_tokens import chat_ids

from tests.integration.ranks import HYBRID, MHA, indices, start_hybrid, start_rank

KV, MAMBA = PoolName.KV, PoolName.MAMBA
TRAIL = PoolHitPolicy.TRAILING_PAGES
POOLS = {"kv": HYBRID["kv"], "mamba": HYBRID["mamba"]}


def store(rank, keys, kv_pages, mamba_pages):
    transfers = [PoolTransfer(KV, [keys[p] for p in kv_pages],
                              torch.cat([indices(4 * p, 1) for p in kv_pages]))]
    if mamba_pages:
        transfers.append(PoolTransfer(MAMBA, [keys[p] for p in mamba_pages],
                                      torch.as_tensor(mamba_pages), TRAIL))
    out = ray.get(rank.call.remote("batch_set_v2", transfers))
    assert all(all(v) for v in out.values())


def tp2_ranks(cluster, pools=POOLS, **config):
    """TP ranks 0 and 1 of one deployment, on the first and second node."""
    return [start_hybrid(node, StorageConfig(tp_rank=r, tp_size=2, **config), pools)
            for r, node in enumerate(cluster.node_ids[:2])]


def test_ranks_disagree_alone_but_agree_as_a_group(cluster, uid):
    r0, r1 = tp2_ranks(cluster, model_name=f"grp/{uid}")
    keys = [f"{uid}-{i}" for i in range(4)]
    store(r0, keys, [0, 1, 2, 3], [1, 3])   # rank 0: KV 4 pages, states after 2 and 4
    store(r1, keys, [0, 1, 2], [1, 2])       # rank 1: KV 3 pages, states after 2 and 3
    ask = [PoolTransfer(MAMBA, keys[-1:], None, TRAIL)]
    alone = [ray.get(r.call.remote("batch_exists_v2", keys, ask)).kv_hit_pages
             for r in (r0, r1)]
    assert alone == [4, 3]                    # each rank alone would load a different prefix
    group = ray.get([r.call.remote("group_exists", keys, ask) for r in (r0, r1)])
    assert group[0] == group[1]
    assert group[0].kv_hit_pages == 2 and group[0].restorable_prefix_pages == [0, 2]
    assert group[0].extra_pool_hit_pages == {MAMBA: 1}


def test_mla_replica_stored_by_any_rank_serves_the_group(cluster, uid):
    """The group's one copy of an MLA page, put by TP rank 1, is the group's hit; rank 0's
    put of it later finds it present."""
    pools = {"kv": ("mla", dict(page_size=4, size=64, layer_num=2, kv_cache_dim=16))}
    r0, r1 = tp2_ranks(cluster, pools, is_mla_model=True, model_name=f"mla/{uid}")
    keys = [f"{uid}-{i}" for i in range(3)]
    assert ray.get(r0.call.remote("batch_exists", keys)) == 0  # CONTROL: nothing yet
    assert ray.get(r1.call.remote("batch_set_v1", keys, indices(0, 3))) == [True] * 3
    assert ray.get(r0.call.remote("group_exists", keys)).kv_hit_pages == 3
    assert ray.get(r0.call.remote("batch_set_v1", keys, indices(0, 3))) == [True] * 3
    assert ray.get(r1.call.remote("group_exists", keys)).kv_hit_pages == 3


def test_one_answer_per_group_request(cluster, uid):
    model = f"win/{uid}"
    ranks = []
    for r in range(2):
        c = CacheClient(StorageConfig(tp_rank=r, tp_size=2, model_name=model))
        c.register_mem_pool_host(c.create_host_pool("mha", **MHA))
        ranks.append(c)
    keys = [f"{uid}-{i}" for i in range(4)]
    for c in ranks:
        assert c.batch_set_v1(keys[:2], indices(0, 2)) == [True] * 2
    first = ranks[0].group_exists(keys)
    for c in ranks:
        assert c.batch_set_v1(keys[2:], indices(8, 2)) == [True] * 2
    assert ranks[1].group_exists(keys) == first       # the same step: the same answer
    assert first.kv_hit_pages == 2
    assert ranks[1].group_exists(keys).kv_hit_pages == 4  # a new step: a fresh answer
    assert ranks[0].group_exists(keys).kv_hit_pages == 4


@pytest.mark.parametrize("named", [True, False], ids=["engines", "control_unnamed"])
def test_two_replicas_asking_interleaved_each_get_one_answer(cluster, uid, named):
    """Replicas A and B of one model (TP 2 each, one home node) ask about the same keys,
    interleaved, while pages are stored: with engine ids each replica's ranks get one
    answer. Control: ranks naming no engine count as one group, and A's rank 1 gets the
    answer B's rank 0 asked for, a hit A's rank 0 was not told of."""
    model = f"replicas/{uid}"

    def rank(engine: str, tp: int) -> CacheClient:
        extra = {"engine_id": engine} if named else None
        c = CacheClient(StorageConfig(tp_rank=tp, tp_size=2, model_name=model,
                                      extra_config=extra))
        c.register_mem_pool_host(c.create_host_pool("mha", **MHA))
        return c
    (a0, a1), (b0, b1) = [[rank(e, tp) for tp in range(2)] for e in "AB"]
    keys = [f"{uid}-{i}" for i in range(4)]
    for c in (a0, a1):
        assert c.batch_set_v1(keys[:2], indices(0, 2)) == [True] * 2
    first = a0.group_exists(keys).kv_hit_pages
    for c in (a0, a1):  # replica B's step stores the rest meanwhile
        assert c.batch_set_v1(keys[2:], indices(8, 2)) == [True] * 2
    b_first = b0.group_exists(keys).kv_hit_pages
    assert (first, b_first) == (2, 4)
    got = a1.group_exists(keys).kv_hit_pages, b1.group_exists(keys).kv_hit_pages
    assert got == ((2, 4) if named else (4, 4))


def test_confirmed_pages_spare_the_store_until_forgotten(cluster, uid):
    r0, r1 = tp2_ranks(cluster, model_name=f"conf/{uid}")
    keys = [f"{uid}-{i}" for i in range(4)]
    for rank in (r0, r1):  # KV and a Mamba state for every page
        store(rank, keys, [0, 1, 2, 3], [0, 1, 2, 3])
    ask = [PoolTransfer(MAMBA, keys[-1:], None, TRAIL)]
    assert ray.get(r0.call.remote("group_exists", keys, ask)).kv_hit_pages == 4
    dep = ray.get(cluster.controller.deployments.remote())[f"conf-{uid}_"]  # its key prefix
    home = ray.get_actor(node_actor_name(dep["home_node"]), namespace=NAMESPACE)
    before = ray.get(home.stats.remote()).group_queries
    # The same rank asks again: a fresh answer, from the pages the store just leased.
    assert ray.get(r0.call.remote("group_exists", keys, ask)).kv_hit_pages == 4
    after = ray.get(home.stats.remote()).group_queries
    assert after.confirmed == before.confirmed + 1
    assert after.store_calls == before.store_calls
    # A forced remove takes objects whatever their lease; told so, the actor asks again.
    raw = MooncakeDistributedStore()
    assert raw.setup("127.0.0.1", cluster.metadata_server, 0, 16 << 20, "tcp", "",
                     cluster.master_address) == 0
    try:
        assert raw.batch_remove([f"conf-{uid}_{keys[2]}_1_k"], True) == [0]
    finally:
        raw.close()
    ray.get(home.forget_confirmations.remote())
    hit = ray.get(r0.call.remote("group_exists", keys, ask))
    assert hit.kv_hit_pages == 2 and hit.restorable_prefix_pages == [0, 1, 2]
    assert ray.get(home.stats.remote()).group_queries.store_calls > after.store_calls


def answered(node: str) -> int:
    """Group queries ``node``'s actor has answered so far, however."""
    stats = ray.get(ray.get_actor(node_actor_name(node), namespace=NAMESPACE).stats.remote())
    g = stats.group_queries
    return g.recent + g.inflight + g.confirmed + g.looked_up


@ray.remote(num_cpus=0)
def ask_group(config: StorageConfig, keys: list[str], times: int) -> list[int]:
    """A replica's rank on the node this task runs on: ``times`` group queries' hits."""
    client = CacheClient(config)
    pool = client.create_host_pool("mha", **MHA)
    client.register_mem_pool_host(pool)
    try:
        return [client.group_exists(keys).kv_hit_pages for _ in range(times)]
    finally:
        client.destroy_host_pool(pool)
        client.close()


def test_replicas_on_two_nodes_ask_their_own_nodes(cluster, uid):
    """Two replicas (one rank each) of one deployment, here and on the other node, each
    asking a group query three times: each is answered by its own node's actor (its
    lookup home), so no actor serves every replica's lookups; both get the hit.
    Control: ``lookup_home="deployment"`` (the one home node per deployment of before):
    this node's actor (the first to register) answers all six."""
    here = ray.get_runtime_context().get_node_id()
    (there,) = [n for n in cluster.node_ids[:2] if n != here]
    elsewhere = NodeAffinitySchedulingStrategy(there, soft=False)
    for lookup_home, want in ((None, {here: 3, there: 3}),
                              ("deployment", {here: 6, there: 0})):
        extra = {} if lookup_home is None else {"lookup_home": lookup_home}
        config = StorageConfig(model_name=f"home/{uid}{lookup_home}", extra_config=extra)
        local = CacheClient(config)
        pool = local.create_host_pool("mha", **MHA)
        local.register_mem_pool_host(pool)
        keys = [f"{uid}-{lookup_home}-{i}" for i in range(2)]
        try:
            assert local.batch_set_v1(keys, indices(0, 2)) == [True] * 2
            assert local.group_exists(keys).kv_hit_pages == 2  # registers first: home here
            before = {n: answered(n) for n in (here, there)}
            remote = ask_group.options(scheduling_strategy=elsewhere).remote(config, keys, 3)
            assert [local.group_exists(keys).kv_hit_pages for _ in range(3)] == [2] * 3
            assert ray.get(remote) == [2] * 3
            assert {n: answered(n) - before[n] for n in (here, there)} == want, lookup_home
        finally:
            local.destroy_host_pool(pool)
            local.close()


def test_conflicting_rank_is_refused_and_controller_keeps_serving(cluster, uid):
    model = f"conflict/{uid}"
    good = CacheClient(StorageConfig(tp_rank=0, tp_size=2, model_name=model))
    good.register_mem_pool_host(good.create_host_pool("mha", **MHA))
    assert good.group_exists([f"{uid}-0"]).kv_hit_pages == 0
    bad = CacheClient(StorageConfig(tp_rank=1, tp_size=4, model_name=model))
    bad.register_mem_pool_host(bad.create_host_pool("mha", **MHA))
    with pytest.raises(ValueError, match="says tp_size=4 but its group registered tp_size=2"):
        bad.group_exists([f"{uid}-0"])
    mla = CacheClient(StorageConfig(tp_rank=1, tp_size=2, is_mla_model=True, model_name=model))
    mla.register_mem_pool_host(mla.create_host_pool(
        "mla", page_size=4, size=64, layer_num=2, kv_cache_dim=16))
    with pytest.raises(ValueError, match="is_mla_model=True"):
        mla.group_exists([f"{uid}-0"])
    home = cluster.node_actors[cluster.node_ids[0]]
    with pytest.raises(ValueError, match="'nobody' is not registered"):
        ray.get(home.group_exists.remote("nobody", 1, (0, 0), "", ["a"], [PoolQuery(KV)]))
    with pytest.raises(ValueError, match="tp_rank 2 is out of range"):
        StorageConfig(tp_rank=2, tp_size=2)
    assert good.group_exists([f"{uid}-1"]).kv_hit_pages == 0


def settle(method, timeout_s: float = 60.0):
    """Call an actor method until the (restarting) actor answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(method.remote(), timeout=5)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError,
                ray.exceptions.GetTimeoutError):
            assert time.monotonic() < deadline, "the actor did not come back"
            time.sleep(0.5)


def restart_controller(controller, timeout_s: float = 60.0) -> None:
    """Kill the controller and wait until Ray's restart of it (another process) answers."""
    pid = SimpleNamespace(remote=lambda: controller.__ray_call__.remote(
        lambda _actor: os.getpid()))  # a lambda travels by value, this module need not
    old = settle(pid)
    ray.kill(controller, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while settle(pid) == old:
        assert time.monotonic() < deadline, "the controller was not restarted"
        time.sleep(0.2)


def answer(query, tries: int = 40):
    """``query()`` once its node actor answers again (a restart can refuse a call or two
    with ``NodeUnavailableError``); the last refusal is raised if it never answers."""
    for _ in range(tries - 1):
        try:
            return query()
        except NodeUnavailableError:
            time.sleep(0.5)
    return query()


@pytest.mark.parametrize("restored", [True, False], ids=["restored", "control-checkpoint-lost"])
def test_controller_restarts_from_its_checkpoint(cluster, uid, restored):
    """After a restart the controller has its nodes and deployments again and answers
    as before: the first rank's group query finds its 2 pages, a new rank of the
    deployment (on the other node) registers and reads their bytes, and a rank that
    contradicts the deployment's registered group (tp_size) is refused. CONTROL
    (``restored=False``): the checkpoint deleted from the test side before the kill; the
    restarted controller has forgotten the deployment and takes the contradicting rank
    (the checkpoint is put back afterwards, for the module's later tests)."""
    model = f"ckpt/{uid}"
    client = CacheClient(StorageConfig(model_name=model))
    pool = client.create_host_pool("mha", **MHA)
    client.register_mem_pool_host(pool)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape).to(pool.kv_buffer.dtype))
    buf = pool.kv_buffer
    written = (buf[:, :8] if buf.dim() == 5 else buf[:8]).clone()  # Rank.pages(0, 2)
    keys = [f"{uid}-{i}" for i in range(2)]
    assert client.batch_set_v1(keys, indices(0, 2)) == [True] * 2
    assert client.group_exists(keys).kv_hit_pages == 2
    controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
    before = ray.get(controller.deployments.remote())
    dep = deployment_id(StorageConfig(model_name=model))
    assert dep in before
    nodes = ray.get(controller.nodes.remote())
    saved = internal_kv._internal_kv_get(checkpoint_key(NAMESPACE))
    if not restored:
        internal_kv._internal_kv_del(checkpoint_key(NAMESPACE))
    try:
        restart_controller(controller)
        after = ray.get(controller.deployments.remote())
        assert (after == before) is restored
        assert answer(lambda: client.group_exists(keys)).kv_hit_pages == 2
        reader = start_rank(cluster.node_ids[1], StorageConfig(model_name=model))
        assert answer(lambda: ray.get(reader.call.remote("batch_get_v1", keys,
                                                         indices(0, 2)))) == [True] * 2
        assert torch.equal(ray.get(reader.pages.remote(0, 2)), written)
        bad = CacheClient(StorageConfig(tp_rank=1, tp_size=2, model_name=model))
        bad.register_mem_pool_host(bad.create_host_pool("mha", **MHA))
        with pytest.raises(ValueError) as refused:
            answer(lambda: bad.group_exists(keys))
        registered = ray.get(controller.deployments.remote())[dep]["tp_size"]
        if restored:
            assert "says tp_size=2 but its group registered tp_size=1" in str(refused.value)
            assert registered == 1
        else:  # CONTROL: the controller took the contradiction as a new deployment (only
            assert registered == 2  # the node actor's copy of the old one refused it)
    finally:
        if not restored:
            internal_kv._internal_kv_put(checkpoint_key(NAMESPACE), saved, overwrite=True)
            restart_controller(controller)
    assert settle(controller.nodes) == nodes


def test_dead_node_actor_is_replaced_and_ranks_reattach(cluster, uid):
    # Last in the module: puts placed on the killed actor's segment fail until the
    # master expires it (~10 s), which would fail the stores of tests after it.
    node2 = cluster.node_ids[1]
    name = f"reattach-{uid}"
    rank = start_rank(node2, StorageConfig(), pool_name=name)
    ray.get(rank.fill.remote(9))
    before = ray.get(rank.pages.remote(0, 4))
    ray.kill(cluster.node_actors[node2], no_restart=True)
    with pytest.raises(NodeUnavailableError, match="retry"):
        ray.get(rank.call.remote("batch_exists", [f"{uid}-0"]))
    keys = [f"{uid}-{i}" for i in range(4)]
    deadline = time.monotonic() + 60
    stored = [False] * 4
    while not all(stored):
        # Until the master expires the dead actor's segment (~10 s), puts placed on it
        # fail: they must come back as False pages (never as success), and a retry of
        # those pages lands once the segment is gone.
        assert time.monotonic() < deadline, f"pages still failing: {stored}"
        try:
            stored = ray.get(rank.call.remote("batch_set_v1", keys, indices(0, 4)))
        except NodeUnavailableError:
            time.sleep(0.5)
    assert torch.equal(ray.get(rank.pages.remote(0, 4)), before)  # the pool survived
    reader = start_rank(cluster.node_ids[0], StorageConfig())
    assert ray.get(reader.call.remote("batch_get_v1", keys, indices(0, 4))) == [True] * 4
    assert torch.equal(ray.get(reader.pages.remote(0, 4)), before)


# ------------------------------------------------------------------------------------
# RayKVRouter: routing real Ray Serve deployments by what these node actors hold.
#
# This module's two-node raykv cluster (real Ray, real ``mooncake_master``); Ray Serve
# with two replicas per app, one per node (``max_replicas_per_node=1``), each answering
# its node id. The pages of a long prefix are written into node 1's L2 (write-behind to node 1's
# own segment) under the keys raykv's vLLM connector gives them. What is verified: the
# router computes those keys (checked against the client's own keying), its view learns
# node 1's L2 from node 1's residency log, and every request sharing the prefix lands on
# node 1's replica; the controls are the same requests through Serve's default
# power-of-two router, a prompt no node holds, and node 1's actor SIGSTOPped (both fall
# back to power of two once the view finds node 1 stale, and every request is
# answered). vLLM replicas behind the router: ``test_vllm.py``.

ROUTE_BLOCK = 8
TOKENS = 129  # 16 full blocks that an engine could load (the last token is computed)
REQUESTS = 16  # a router that is not routing by residency puts them all on one
# node with chance 2^-15
DEADLINE_MS = 2000.0
STALE_MS = 3000.0  # a patient view on a loaded 2-core machine


def where():
    """A Serve deployment whose two replicas (one per node) answer their node id."""
    from ray import serve

    @serve.deployment(num_replicas=2, max_replicas_per_node=1,
                      ray_actor_options={"num_cpus": 0})
    class Where:
        def __call__(self, request) -> str:
            return ray.get_runtime_context().get_node_id()

    return Where


@pytest.fixture(scope="module")
def apps(cluster):
    """Three apps of ``where``: ``raykv`` (``RayKVRouter``), ``pow2`` (Serve's default
    router) and ``raykv_no_engine`` (``RayKVRouter`` without its engine tier:
    ``engine_blocks`` 0), each with its replicas on both nodes; their handles."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from raykv.integrations.serve.router import RayKVRouter

    serve.start(proxy_location="Disabled")
    model = f"org/route-{os.getpid()}"
    # a generous deadline and a patient view: this checks where requests go, on a
    # loaded 2-core machine
    kwargs = {"model_name": model, "block_size": ROUTE_BLOCK, "deadline_ms": DEADLINE_MS,
              "stale_ms": STALE_MS}
    # and as patient a queue-length probe (the handles' routers run in this process):
    # Serve passes over a chosen replica whose probe does not answer within 0.1 s, which
    # on a loaded machine sent every request to the replica of the other node
    patience = pytest.MonkeyPatch()
    patience.setattr(RayKVRouter, "queue_len_response_deadline_s", 2.0)
    try:
        routed = where().options(request_router_config=RequestRouterConfig(
            request_router_class="raykv.integrations.serve.router:RayKVRouter",
            request_router_kwargs=kwargs))
        no_engine = where().options(request_router_config=RequestRouterConfig(
            request_router_class="raykv.integrations.serve.router:RayKVRouter",
            request_router_kwargs=kwargs | {"engine_blocks": 0}))
        handles = {"raykv": serve.run(routed.bind(), name="raykv", route_prefix=None),
                   "pow2": serve.run(where().bind(), name="pow2", route_prefix=None),
                   "raykv_no_engine": serve.run(no_engine.bind(), name="raykv_no_engine",
                                                route_prefix=None)}
        yield handles, RouteOptions.parse(kwargs)
    finally:
        patience.undo()
        with contextlib.suppress(Exception):
            serve.shutdown()


def tokens(seed: int, n: int = TOKENS) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 30000) for _ in range(n)]


def nodes_of(handle, prompts: list[list[int]]) -> list[str]:
    return [handle.remote(SimpleNamespace(prompt=p)).result(timeout_s=60) for p in prompts]


def nodes_at_once(handle, prompts: list[list[int]]) -> list[str]:
    """``nodes_of`` with every request in flight together: power of two choices then
    sees queues of different lengths and spreads them (one request at a time, each
    finding both queues empty, it may send them all to one replica)."""
    responses = [handle.remote(SimpleNamespace(prompt=p)) for p in prompts]
    return [r.result(timeout_s=60) for r in responses]


def router_of(handle):
    """The ``RayKVRouter`` behind ``handle`` in this process (Ray 2.60's handle
    internals: the router of a handle runs in the handle's process)."""
    return handle._router._asyncio_router.request_router


def hold_on_node(cluster, opts: RouteOptions, prompt: list[int]) -> None:
    """Write the loadable pages of ``prompt`` into the first node's L2 (as a vLLM
    worker's save does), and wait for their write-behind to that node's segment."""
    from raykv.cache_actors.rank.client import CacheClient

    keys = RouteKeys(opts)
    hashes = keys.page_hashes(prompt)
    client = CacheClient(keys.config, node_id=cluster.node_ids[0])
    try:
        link = client.l2()
        assert keys.keys(prompt) == link._keys(hashes)  # the client's own keying
        pool = link.open(PoolLayout.vllm(page_size=ROUTE_BLOCK, size=ROUTE_BLOCK * len(hashes),
                                         layer_num=1, head_num=1, head_dim=8,
                                         dtype="bfloat16", itemsize=2), len(hashes))
        pages = link.reserve(pool.name, hashes)
        assert link.commit(pool.name, hashes, pages, [True] * len(hashes)) == len(hashes)
        for _ in range(200):
            if client.stats().l2.l3_put >= len(hashes):
                break
            time.sleep(0.05)
    finally:
        client.close()


def learnt(handle, opts: RouteOptions, node: str, prompt: list[int]):
    """The ``RayKVRouter`` behind ``handle``, once its residency view has learnt from
    ``node``'s residency log that the node's L2 holds every loadable page of ``prompt``
    and has heard from every node lately (a partial view is not used: a request then
    falls back to power of two, and its replica's engine tier would draw the repeats
    after it); a first request makes the handle's router; at most 30 s."""
    nodes_of(handle, [tokens(999, 4)])
    router, keys = router_of(handle), RouteKeys(opts).keys(prompt)
    deadline = time.monotonic() + 30
    while True:
        got = router.view.answer(node, keys, 1)
        if (got is not None and got.l2 == len(keys)
                and all(router.view.fresh(n) for n in router.view.nodes)):
            return router
        assert time.monotonic() < deadline, (got, router.counts, router.view.counts)
        time.sleep(0.05)


@pytest.mark.engine("ray.serve")
def test_a_repeated_prefix_lands_on_the_node_that_holds_it(cluster, apps):
    handles, opts = apps
    node1 = cluster.node_ids[0]
    shared = tokens(1)
    hold_on_node(cluster, opts, shared)
    before = learnt(handles["raykv"], opts, node1, shared).counts["routed"]
    prompts = [shared + tokens(100 + i, 8) for i in range(REQUESTS)]
    got = nodes_of(handles["raykv"], prompts)
    counts = router_of(handles["raykv"]).counts
    assert set(got) == {node1}, (got.count(node1), counts, before)
    assert counts["routed"] - before == REQUESTS
    # controls: Serve's own router, and a prefix no node holds, spread over both nodes
    assert set(nodes_at_once(handles["pow2"], prompts)) == set(cluster.node_ids)
    cold = [tokens(200 + i) for i in range(REQUESTS)]
    assert set(nodes_at_once(handles["raykv"], cold)) == set(cluster.node_ids)


@pytest.mark.engine("ray.serve")
def test_a_prefix_the_router_sent_to_a_replica_goes_back_to_it(cluster, apps):
    """No node holds this prefix (these replicas run no engine, nothing is saved): the
    router's engine tier alone (what it sent where, ``sent_keys``) sends every repeat
    to the replica it sent the first to, each counted as routed. Control: with
    ``engine_blocks`` 0 the same repeats tell no replica apart: each is a new prefix,
    spread to the replica sent the fewest lately: both nodes get some, and the app's
    two replicas end up sent as many requests (within one)."""
    handles, _ = apps
    cold = tokens(3)
    moved = {}
    for name in ("raykv", "raykv_no_engine"):
        handle = handles[name]
        first = nodes_of(handle, [cold + tokens(400, 8)])[0]
        router = router_of(handle)
        deadline = time.monotonic() + 30
        while not all(router.view.fresh(n) for n in cluster.node_ids):  # heard from both
            assert time.monotonic() < deadline, router.counts
            time.sleep(0.05)
        before = dict(router.counts)
        got = nodes_of(handle, [cold + tokens(401 + i, 8) for i in range(REQUESTS)])
        moved[name] = (first, got, {k: router.counts[k] - before[k]
                                    for k in ("routed", "spread", "fallback")})
    first, got, counts = moved["raykv"]
    assert set(got) == {first} and counts == {"routed": REQUESTS, "spread": 0, "fallback": 0}
    _, got, counts = moved["raykv_no_engine"]
    assert counts == {"routed": 0, "spread": REQUESTS, "fallback": 0}
    sent = router_of(handles["raykv_no_engine"]).recent.counts()  # every request so far
    assert set(got) == set(cluster.node_ids) and max(sent.values()) - min(sent.values()) <= 1


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def text_app(cluster, apps, tmp_path, name: str, chat: bool = False, **extra):
    """A ``where`` app ``name`` whose ``RayKVRouter`` reads text with the tiny model's
    tokenizer (``chat``: given a chat template, and the held pages are those of a
    conversation whose system message is the document; ``extra``: more router kwargs),
    a document whose loadable pages node 1's L2 holds, and the app's router once it
    learnt that and loaded its tokenizer: (handle, router, document)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from raykv_lab.engines.vllm_model import make_llama
    from transformers import AutoTokenizer

    _, opts = apps
    model = make_llama(str(tmp_path / "tiny-llama"))
    tok = AutoTokenizer.from_pretrained(model)
    common = ["the", "of", "and", "to", "in", "is", "it", "was", "for", "on", "are", "with"]
    words = random.Random(5).choices(common, k=700)
    document = "Document: " + " ".join(words)
    if chat:
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(model)  # the router's tokenizer has the template
        held = chat_ids(tok, [{"role": "system", "content": document},
                              {"role": "user", "content": "Question 0?"}])
    else:
        held = tok.encode(document)
    kwargs = {"model_name": f"{opts.model_name}-{name}", "block_size": ROUTE_BLOCK,
              "deadline_ms": DEADLINE_MS, "stale_ms": STALE_MS, "tokenizer": model} | extra
    opts = RouteOptions.parse(kwargs)  # a deployment (and L2 pool) of its own
    hold_on_node(cluster, opts, held)
    app = where().options(request_router_config=RequestRouterConfig(
        request_router_class="raykv.integrations.serve.router:RayKVRouter",
        request_router_kwargs=kwargs))
    handle = serve.run(app.bind(), name=name, route_prefix=None)
    router = learnt(handle, opts, cluster.node_ids[0], held)
    deadline = time.monotonic() + 60
    while not router._tokens.ready:
        assert time.monotonic() < deadline, "the router's tokenizer did not load"
        time.sleep(0.1)
    return handle, router, document


@pytest.mark.parametrize("chat", [False, True], ids=["text", "chat"])
@pytest.mark.engine("ray.serve")
@pytest.mark.engine("transformers")
def test_text_prompts_are_routed_by_their_tokens(cluster, apps, tmp_path, chat):
    """Requests that carry text or chat ``messages``, as Serve LLM's OpenAI ingress gives
    them: a router with the model's tokenizer tokenizes them (its chat template
    rendered for a chat; through its prefix memo; waiting for their keys as long as
    they take) and sends every question about a document node 1 holds to node 1,
    routed, the questions after the first reusing the document's ids from the memo.
    Control: the same requests through the app whose router has no tokenizer all fall
    back to power of two."""
    from ray import serve

    handles, _ = apps
    name = "raykv_chat" if chat else "raykv_text"
    handle, router, document = text_app(cluster, apps, tmp_path, name, chat=chat,
                                        keys_wait_ms=60_000)
    try:
        questions = [SimpleNamespace(prompt=None, messages=[
            {"role": "system", "content": document},
            {"role": "user", "content": f"Question {i}?"}]) if chat else
            SimpleNamespace(prompt=f"{document} Question {i}: what is it?")
            for i in range(8)]
        before = dict(router.counts)
        got = [handle.remote(q).result(timeout_s=60) for q in questions]
        assert set(got) == {cluster.node_ids[0]}, (got, router.counts)
        assert router.counts["routed"] - before["routed"] == len(questions)
        assert router.counts["keys_late"] == 0
        assert router.text_memo()["hits"] >= len(questions) - 1
        nodes_of(handles["raykv"], [tokens(999, 4)])  # the handle's router is made
        control = router_of(handles["raykv"])
        before = dict(control.counts)
        for q in questions:
            handles["raykv"].remote(q).result(timeout_s=60)
        assert control.counts["fallback"] - before["fallback"] == len(questions)
    finally:
        serve.delete(name)


@pytest.mark.parametrize("memo", [True, False], ids=["memo", "control_no_memo"])
@pytest.mark.engine("ray.serve")
@pytest.mark.engine("transformers")
def test_text_past_its_keys_wait_is_routed_on_what_the_memo_knows(cluster, apps, tmp_path,
                                                                  memo):
    """A router that never waits for a text's keys (``keys_wait_ms`` 0) routes each
    question about a document on the document's ids its memo holds: the first question
    goes as a new prefix (nothing known yet, unless its tokenization ended before the
    router looked again); once that is done, every later question is routed at once on
    its known part, to the replica the first went to (its keys counted for that replica
    when they were made).
    Control: without the memo nothing is known in time, so every question goes as a new
    prefix, spread over both nodes. With as many
    requests' keys being made as the router allows, the next is routed on its known
    part alone, its keys not made."""
    from ray import serve

    name = "raykv_text_late" + ("" if memo else "_no_memo")
    # the engine tier worth more than node 1's L2 plus a queued request (1.2 against 1.0
    # + 0.1): every question stays with the replica that computed the first even while
    # one is queued there. At the default (1.05) a question queued behind another goes
    # to node 1, whose L2 holds the document, and then both replicas tie: spread.
    handle, router, document = text_app(cluster, apps, tmp_path, name, keys_wait_ms=0,
                                        text_memo_ids=(4 << 20) if memo else 0,
                                        weight_engine=1.2)
    try:
        questions = [SimpleNamespace(prompt=f"{document} Question {i}: what is it?")
                     for i in range(8)]
        before = dict(router.counts)
        got = [handle.remote(questions[0]).result(timeout_s=60)]
        deadline = time.monotonic() + 30
        while router._behind:  # the first question's keys are being made
            assert time.monotonic() < deadline, router.counts
            time.sleep(0.05)
        whole = router._keys.keys(router._tokens.of([questions[0]], {}))
        assert any(router.routed.pages(r, whole, 1) == len(whole)  # made late, counted
                   for r in list(router.routed._by_replica)), "the first's keys not counted"
        got += [handle.remote(q).result(timeout_s=60) for q in questions[1:]]
        counts = {k: router.counts[k] - before[k]
                  for k in ("routed", "spread", "keys_known", "keys_late")}
        if memo:  # the first is routed too if its tokenization ended before the lookup
            assert counts["keys_known"] == 7 and counts["keys_late"] == 1, router.counts
            assert counts["routed"] >= 7 and counts["routed"] + counts["spread"] == 8, \
                router.counts
            assert set(got) == {got[0]}, got
            # as if MAX_BEHIND requests' keys were being made (Serve runs a copy of the
            # router's module: its constant is read from the router itself)
            router._behind = type(router)._keys_within.__globals__["MAX_BEHIND"]
            before = dict(router.counts)
            again = handle.remote(SimpleNamespace(prompt=f"{document} Last?")).result(
                timeout_s=60)
            assert router.counts["keys_dropped"] - before["keys_dropped"] == 1
            assert router.counts["routed"] - before["routed"] == 1 and again == got[0]
            assert router._behind == type(router)._keys_within.__globals__["MAX_BEHIND"]
            router._behind = 0  # its keys were not made: nothing to count back
        else:
            assert counts == {"routed": 0, "spread": 8, "keys_known": 0, "keys_late": 8}, \
                router.counts
            assert set(got) == set(cluster.node_ids), got
    finally:
        serve.delete(name)


@pytest.mark.engine("ray.serve")
def test_a_stopped_node_actor_degrades_routing_to_power_of_two(cluster, apps):
    """Node 1's actor SIGSTOPped: the router hears nothing from it, so once its view
    of node 1 is stale every request is answered, routed by power of two choices (a
    partial view is not used: node 2's alone would send all of them to node 2, which
    holds the prefix in L3). Control: the same requests once node 1's actor runs again
    and the view heard from it are routed by residency. The router without its engine
    tier: with it, the requests sent by power of two during the stop would go back to
    the replica they went to (``test_a_prefix_the_router_sent_to_a_replica_goes_back_to_it``)."""
    handles, opts = apps
    handles = {"raykv": handles["raykv_no_engine"]}
    node1 = cluster.node_ids[0]
    shared = tokens(2)
    hold_on_node(cluster, opts, shared)
    prompts = [shared + tokens(300 + i, 8) for i in range(2)]
    router = learnt(handles["raykv"], opts, node1, shared)
    pid = ray.get(cluster.node_actors[node1].health.remote())["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        fresh_for = time.monotonic()
        while router.view.fresh(node1):  # its refreshes go unanswered: stale in stale_ms
            assert time.monotonic() - fresh_for < 30
            time.sleep(0.05)
        before = dict(router.counts)
        got = nodes_of(handles["raykv"], prompts)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(got) == len(prompts)
    assert router.counts["fallback"] - before["fallback"] == len(prompts)
    assert router.counts["routed"] == before["routed"]
    learnt(handles["raykv"], opts, node1, shared)  # heard from again
    before = dict(router.counts)
    assert set(nodes_of(handles["raykv"], prompts)) == {node1}
    assert router.counts["routed"] == before["routed"] + len(prompts)

