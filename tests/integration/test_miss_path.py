"""A miss is nearly free, on a real two-node cluster (Ray, ``mooncake_master``): what a
request that finds nothing sends, counted, not timed.

A rank that registered its deployment before its first group query (as engines do when
they start) sends one data op for it and nothing else, and its lookup home answers it
with one store lookup and no call to the controller; the control is the same first
query of a rank that did not register first (registration, the copy of the
deployment and the opening of the route then ride on it). The example engine
registers when it starts, and hands over its first token before it saves anything.
"""

import random
from dataclasses import asdict

import pytest
import ray
from raykv import CacheClient
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import GroupQueryStats
from raykv.example_engine import Engine
from raykv.example_engine.presets import build

from tests.integration.call_counts import counted, counting_rank, round_trips
from tests.integration.ranks import MHA

PS = 16
SIZES = dict(hidden=64, layers=2, head_dim=16, vocab=128)


def group_counts(cluster, node: str) -> GroupQueryStats:
    """``group_queries`` of ``node``'s actor (its ``stats``)."""
    return ray.get(cluster.node_actors[node].stats.remote()).group_queries


def grown(before: GroupQueryStats, after: GroupQueryStats) -> dict[str, int]:
    """The counts of ``group_counts`` that grew, by name and how much (seconds left
    out)."""
    then, now = asdict(before), asdict(after)
    return {k: now[k] - then[k] for k in now
            if k != "store_seconds" and now[k] != then[k]}


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "control_lazy"])
def test_a_first_miss_is_one_data_op_and_one_lookup(cluster, uid, registered):
    """A TP rank of a new deployment, on this node (its lookup home: the first rank's
    node), asks about pages nobody saved: one request over the local channel, answered
    by one store lookup, no deployment fetched. Control: registering at that first query
    costs a controller lookup and call, the home's copy and the channel's opening on
    the request's path."""
    here = ray.get_runtime_context().get_node_id()
    client = CacheClient(StorageConfig(tp_rank=0, tp_size=2, model_name=f"miss/{uid}",
                                       extra_config={"engine_id": "e"}))
    client.register_mem_pool_host(client.create_host_pool("mha", **MHA))
    try:
        if registered:
            client.register_deployment()
        before = group_counts(cluster, here)
        with counted() as sent:
            hit = client.group_exists([f"{uid}-{i}" for i in range(8)])
        assert hit.kv_hit_pages == 0
        after = group_counts(cluster, here)
        if registered:
            assert dict(sent) == {"channel:group_exists": 1}
            assert grown(before, after) == {"looked_up": 1, "store_calls": 1}
        else:
            assert {"get_actor", "register_rank", "copy_deployment", "channel_path",
                    "channel_connect"} <= set(sent) and sent["channel:group_exists"] == 1
            assert round_trips(sent) >= 6
            assert grown(before, after) == {"looked_up": 1, "store_calls": 1,
                                            "deployment_fetches": 1}
        # every later miss: the same one request and one lookup
        with counted() as sent:
            assert client.group_exists([f"{uid}-later-{i}" for i in range(8)]
                                       ).kv_hit_pages == 0
        assert dict(sent) == {"channel:group_exists": 1}
    finally:
        client.close()


@pytest.mark.parametrize("registered", [True, False], ids=["registered", "control_lazy"])
def test_a_lookup_home_on_another_node_is_one_ray_call(cluster, uid, registered):
    """TP rank 1 runs on the other node; rank 0 registered here first, so the group's
    lookup home is this node. Registered first, rank 1's first miss is one Ray call to
    that node's actor (its handle kept since registration, no lookup by name). Control:
    registering at the first query adds the controller and the actor lookups."""
    here = ray.get_runtime_context().get_node_id()
    (there,) = [n for n in cluster.node_ids[:2] if n != here]
    config = dict(tp_size=2, model_name=f"far/{uid}", extra_config={"engine_id": "e"})
    r0 = CacheClient(StorageConfig(tp_rank=0, **config))
    r0.register_mem_pool_host(r0.create_host_pool("mha", **MHA))
    try:
        r0.register_deployment()  # home: here
        r1 = counting_rank(there, StorageConfig(tp_rank=1, **config))
        if registered:
            ray.get(r1.register.remote())
        before = group_counts(cluster, here)
        hit, sent = ray.get(r1.group_exists.remote([f"{uid}-{i}" for i in range(8)]))
        assert hit == 0
        if registered:
            assert sent == {"group_exists": 1}
            assert grown(before, group_counts(cluster, here)) == {"looked_up": 1,
                                                                  "store_calls": 1}
        else:
            assert {"get_actor", "register_rank", "copy_deployment"} <= set(sent)
            assert sent["group_exists"] == 1 and round_trips(sent) >= 4
        hit, sent = ray.get(r1.group_exists.remote([f"{uid}-later-{i}" for i in range(8)]))
        assert (hit, sent) == (0, {"group_exists": 1})  # the handle is kept
    finally:
        r0.close()


@pytest.fixture(scope="module")
def engine(cluster):
    """A hybrid TP=2 example engine with a draft model on the first node, with that
    node's group counts just before it started and just after."""
    node = cluster.node_ids[0]
    target, draft = build("hybrid-draft", "test/missfree", **SIZES)
    before = group_counts(cluster, node)
    eng = Engine(target, node, draft=draft, page_size=PS, max_tokens=256, host_pages=24,
                 state_slots=24)
    return eng, before, group_counts(cluster, node)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(SIZES["vocab"]) for _ in range(n)]


def test_an_engine_registers_when_it_starts(cluster, engine):
    """The engine's ranks registered and their node copied the deployment while the
    engine started; its first request, a miss, then costs its node one lookup and no
    deployment fetch, and both ranks got one answer (the engine checks that). Control:
    the fetch did happen, at the start."""
    eng, before, started = engine
    deps = ray.get(cluster.controller.deployments.remote())
    assert deps["test-missfree_"]["ranks"] == {"0,0": eng.node_id, "1,0": eng.node_id}
    assert grown(before, started) == {"deployment_fetches": 1}  # CONTROL: at the start
    gen = eng.generate(tokens(3 * PS + 5, seed=1), 2)
    assert gen.hit_pages == 0 and gen.query_s > 0  # asked, and found nothing
    answered = grown(started, group_counts(cluster, eng.node_id))
    shared = answered.pop("inflight", 0) + answered.pop("recent", 0)  # rank 1: rank 0's
    assert (answered, shared) == ({"looked_up": 1, "store_calls": 1}, 1)


def puts(cluster, node: str) -> int:
    """Objects ``node``'s actor has put into the store so far."""
    return ray.get(cluster.node_actors[node].stats.remote()).counters.get(
        "put_objects", 0)


def test_the_first_token_comes_before_anything_is_saved(cluster, engine):
    """At its first token a request has saved nothing (the node actor that stores the
    engine's pages has put no object since the request began); once the caller asks
    for more, the prompt's new pages are saved. Control: the same count, read after the
    first token, sees the save."""
    eng = engine[0]
    prompt = tokens(3 * PS + 5, seed=2)
    start = puts(cluster, eng.node_id)
    steps = eng.stream(prompt, 3)
    first = next(steps)
    assert len(first.tokens) == 1 and first.ttft_s > 0 and first.offloaded_pages == {}
    assert puts(cluster, eng.node_id) == start
    last = next(steps)
    assert last is first and len(last.tokens) == 3
    assert last.offloaded_pages == {"kv": 3, "mamba": 3, "draft": 3}
    assert puts(cluster, eng.node_id) > start  # CONTROL: the count sees the save
    assert next(steps, None) is None
