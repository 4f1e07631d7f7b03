"""``RayKVRouter`` routing real Ray Serve deployments by what real node actors hold.

A two-node raykv cluster (real Ray, real ``mooncake_master``); Ray Serve with two
replicas per app, one per node (``max_replicas_per_node=1``), each answering its node
id. The pages of a long prefix are written into node 1's L2 (write-behind to node 1's
own segment) under the keys raykv's vLLM connector gives them. What is verified: the
router computes those keys (checked against the client's own keying), asks both node
actors, and every request sharing the prefix lands on node 1's replica; the controls
are the same requests through Serve's default power-of-two router, a prompt no node
holds, and node 1's actor SIGSTOPped (both fall back to power of two within the
deadline, and every request is answered). Not verified here: vLLM replicas (Ray Serve
LLM's start takes 24-51 s a replica on this machine); ``RAYKV_SLOW_ROUTER_TESTS=1``
runs ``test_router_llm.py`` for that.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from types import SimpleNamespace

import pytest
import ray
from raykv.controllers.pool_layout import PoolLayout
from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions

BLOCK = 8
TOKENS = 129  # 16 full blocks that an engine could load (the last token is computed)
REQUESTS = 16  # a router that is not routing by residency puts them all on one
# node with chance 2^-15
DEADLINE_MS = 2000.0


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
    """Two apps of ``where``: ``raykv`` (``RayKVRouter``) and ``pow2`` (Serve's default
    router), both with their replicas on both nodes; their handles."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    serve.start(proxy_location="Disabled")
    model = f"org/route-{os.getpid()}"
    # a generous deadline: this checks where requests go, on a loaded 2-core machine
    kwargs = {"model_name": model, "block_size": BLOCK, "deadline_ms": DEADLINE_MS}
    try:
        routed = where().options(request_router_config=RequestRouterConfig(
            request_router_class="raykv.integrations.serve.router:RayKVRouter",
            request_router_kwargs=kwargs))
        handles = {"raykv": serve.run(routed.bind(), name="raykv", route_prefix=None),
                   "pow2": serve.run(where().bind(), name="pow2", route_prefix=None)}
        yield handles, RouteOptions.parse(kwargs)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()


def tokens(seed: int, n: int = TOKENS) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 30000) for _ in range(n)]


def nodes_of(handle, prompts: list[list[int]]) -> list[str]:
    return [handle.remote(SimpleNamespace(prompt=p)).result(timeout_s=60) for p in prompts]


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
        pool = link.open(PoolLayout.vllm(page_size=BLOCK, size=BLOCK * len(hashes),
                                         layer_num=1, head_num=1, head_dim=8,
                                         dtype="bfloat16", itemsize=2), len(hashes))
        pages = link.reserve(pool.name, hashes)
        assert link.commit(pool.name, hashes, pages, [True] * len(hashes)) == len(hashes)
        for _ in range(200):
            if client.stats()["l2"]["l3_put"] >= len(hashes):
                break
            time.sleep(0.05)
    finally:
        client.close()


def test_a_repeated_prefix_lands_on_the_node_that_holds_it(cluster, apps):
    handles, opts = apps
    node1 = cluster.node_ids[0]
    shared = tokens(1)
    hold_on_node(cluster, opts, shared)
    prompts = [shared + tokens(100 + i, 8) for i in range(REQUESTS)]
    assert set(nodes_of(handles["raykv"], prompts)) == {node1}
    assert router_of(handles["raykv"]).counts["routed"] == REQUESTS
    # controls: Serve's own router, and a prefix no node holds, spread over both nodes
    assert set(nodes_of(handles["pow2"], prompts)) == set(cluster.node_ids)
    cold = [tokens(200 + i) for i in range(REQUESTS)]
    assert set(nodes_of(handles["raykv"], cold)) == set(cluster.node_ids)


def test_a_stopped_node_actor_degrades_routing_to_power_of_two(cluster, apps):
    """Node 1's actor SIGSTOPped: no residency answer from it within the deadline, so
    every request is answered, routed by power of two choices (a partial view is not
    used: node 2's answer alone would send all of them to node 2, which holds the
    prefix in L3). Control: the same requests once node 1's actor runs again are
    routed by residency."""
    handles, opts = apps
    shared = tokens(2)
    hold_on_node(cluster, opts, shared)
    prompts = [shared + tokens(300 + i, 8) for i in range(2)]
    router = router_of(handles["raykv"])
    pid = ray.get(cluster.node_actors[cluster.node_ids[0]].health.remote())["pid"]
    before = dict(router.counts)
    os.kill(pid, signal.SIGSTOP)
    try:
        got = nodes_of(handles["raykv"], prompts)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(got) == len(prompts)
    assert router.counts["fallback"] - before["fallback"] == len(prompts)
    assert router.counts["routed"] == before["routed"]
    assert set(nodes_of(handles["raykv"], prompts)) == {cluster.node_ids[0]}
    assert router.counts["routed"] == before["routed"] + len(prompts)

