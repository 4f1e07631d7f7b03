"""What routing by residency costs: the node actor's residency query, a look-up that
asks the node actors per request, and ``RayKVRouter``'s look-up from its residency view.

Run: ``python -m raykv_lab.bench.routing [--pages 64] [--iters 500] [--out DIR]``
(a two-node embedded cluster of its own; Ray must not be running in this process).
Node 1's L2 holds ``pages`` pages of one deployment (written back to its own segment);
then, per iteration: the query inside node 1's actor (``in_actor``: ``ResidencyQuery``
alone, no Ray call), the same query as a Ray call from the driver (``ray_call``), a
look-up that asks per request (``asked``: the page hashes and keys of a prompt of
``pages`` full blocks of 16 tokens, plus one residency call to each of the two node
actors at once, under a 1 s deadline, on an event loop), and one call to node 1's
residency log as a router's view makes it every ``refresh_ms`` (``changes_call``: the
first a reset, the others nothing new).
Then Ray Serve: an app of two replicas, one per node, routed by ``RayKVRouter`` (its
defaults), once its view has learnt node 1's L2: the router's own time per request
(``serve_router``, from its ``recent_s``; of it, the keys' and the view's answers',
``serve_keys`` and ``serve_view``) and where ``requests`` requests whose prompt extends
the held prefix landed (``on_holder``: the share on node 1's replica), against an app
on Serve's own router (``pow2_on_holder``); then ``requests`` text requests (a 16 kB
document), eight at once, through a router that tokenizes them with a local tokenizer
(``serve_router_text``, and each wave's wall time, ``text_wave_wall``; its prompt
text memo's counters, ``text_memo``; ``--no-text`` skips it). Percentiles in
milliseconds. Writes ``routing.json`` to ``--out``. Numbers only: nothing asserts a
speed. All nodes share one host here: Ray calls never cross a network.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import ray

BLOCK = 16


def _ms(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"p50_ms": statistics.median(s) * 1e3, "p99_ms": s[int(0.99 * (len(s) - 1))] * 1e3,
            "n": len(s)}


def _in_actor(actor, keys: list[str], claim, iters: int) -> list[float]:
    def measure(self, keys, claim, iters):  # runs in the node actor's process
        out = []
        for _ in range(iters):
            t = time.perf_counter()
            self._residency.residency(keys, 1, claim, time.monotonic() + 1.0)
            out.append(time.perf_counter() - t)
        return out
    return ray.get(actor.__ray_call__.remote(measure, keys, claim, iters))


class Where:
    """A Serve replica that answers its node id."""

    def __call__(self, request) -> str:
        return ray.get_runtime_context().get_node_id()


def _document() -> str:
    """About 16 kB of text: the start of a module of Python's own library."""
    import inspect
    import json.decoder

    return inspect.getsource(json.decoder)[:16000]


def _text(app, opts: dict, tokenizer: str, requests: int, wave: int) -> dict:
    """``requests`` text requests (a 16 kB document and a question of its own), ``wave``
    at once, through a ``RayKVRouter`` that tokenizes them (``tokenizer``): its time per
    request (which leaves out a request's wait for an event loop that another request's
    tokenization holds) and the wall time of each wave, once its tokenizer is loaded."""
    from types import SimpleNamespace

    from ray import serve

    handle = serve.run(app.options(request_router_config={
        "request_router_class": "raykv.integrations.serve.router:RayKVRouter",
        "request_router_kwargs": opts | {"tokenizer": tokenizer}}).bind(), name="text",
        route_prefix=None)
    doc = _document()
    handle.remote(SimpleNamespace(prompt=doc)).result(timeout_s=60)
    router = handle._router._asyncio_router.request_router
    deadline = time.monotonic() + 60
    while not router._tokens.ready and time.monotonic() < deadline:
        time.sleep(0.1)
    router.recent_s.clear()
    asks = [SimpleNamespace(prompt=f"{doc}\nQuestion {i}: what does line {i} do?")
            for i in range(requests)]
    waves = []
    for lo in range(0, requests, wave):
        t = time.perf_counter()
        for r in [handle.remote(a) for a in asks[lo:lo + wave]]:
            r.result(timeout_s=60)
        waves.append(time.perf_counter() - t)
    return {"serve_router_text": _ms(list(router.recent_s)), "text_wave": wave,
            "text_wave_wall": _ms(waves),
            "text_counts": dict(router.counts), "text_memo": router.text_memo()}


def _serve(holder: str, prompt: list[int], chain: list[str], requests: int,
           tokenizer: str | None) -> dict:
    from types import SimpleNamespace

    from ray import serve

    opts = {"model_name": "bench/routing", "block_size": BLOCK}
    app = serve.deployment(Where, num_replicas=2, max_replicas_per_node=1,
                           ray_actor_options={"num_cpus": 0})
    serve.start(proxy_location="Disabled")
    try:
        routed = serve.run(app.options(request_router_config={
            "request_router_class": "raykv.integrations.serve.router:RayKVRouter",
            "request_router_kwargs": opts}).bind(), name="raykv", route_prefix=None)
        plain = serve.run(app.bind(), name="pow2", route_prefix=None)
        rnd = random.Random(1)
        asks = [SimpleNamespace(prompt=prompt + [rnd.randrange(3, 30000) for _ in range(8)])
                for _ in range(requests)]
        routed.remote(asks[0]).result(timeout_s=60)  # makes the handle's router
        router = routed._router._asyncio_router.request_router
        learnt = time.monotonic() + 60
        while time.monotonic() < learnt:
            got = router.view.answer(holder, chain, 1)
            if got is not None and got.l2 == len(chain):
                break
            time.sleep(0.05)
        router.recent_s.clear()
        router.recent_parts.clear()
        on = [routed.remote(a).result(timeout_s=60) for a in asks]
        on_pow2 = [plain.remote(a).result(timeout_s=60) for a in asks]
        parts = list(router.recent_parts)
        text = {} if tokenizer is None else _text(app, opts, tokenizer, requests, 8)
        return {"serve_router": _ms(list(router.recent_s)), "requests": requests, **text,
                "serve_keys": _ms([k for k, _ in parts]),
                "serve_view": _ms([a for _, a in parts]),
                "on_holder": on.count(holder) / requests,
                "pow2_on_holder": on_pow2.count(holder) / requests,
                "router_counts": dict(router.counts)}
    finally:
        serve.shutdown()


def run(pages: int, iters: int, out: Path, requests: int = 200, text: bool = True) -> dict:
    from raykv.cache_actors.rank.client import CacheClient
    from raykv.cache_actors.rank.rank_owner import RankOwner
    from raykv.clusters.local import local_settings, start_local
    from raykv.controllers.pool_layout import PoolLayout
    from raykv.integrations.serve.node_answers import NodeAnswers
    from raykv.integrations.serve.route_keys import RouteKeys, RouteOptions

    opts = RouteOptions.parse({"model_name": "bench/routing", "block_size": BLOCK})
    keys = RouteKeys(opts)
    rnd = random.Random(0)
    prompt = [rnd.randrange(3, 30000) for _ in range(pages * BLOCK + 1)]
    hashes = keys.page_hashes(prompt)
    with start_local(settings=local_settings(global_segment_size=256 << 20),
                     num_nodes=2) as cluster:
        node1 = cluster.node_ids[0]
        client = CacheClient(keys.config, node_id=node1)
        link = client.l2()
        pool = link.open(PoolLayout.vllm(page_size=BLOCK, size=BLOCK * pages, layer_num=2,
                                         head_num=2, head_dim=64, dtype="bfloat16",
                                         itemsize=2), pages)
        slots = link.reserve(pool.name, hashes)
        link.commit(pool.name, hashes, slots, [True] * pages)
        while client.stats().l2.l3_put < pages:
            time.sleep(0.05)
        chain = keys.keys(prompt)
        claim = client.owner_claim(node1)
        actor = cluster.node_actors[node1]
        answer = ray.get(actor.residency.remote(chain, 1, claim))
        in_actor = _in_actor(actor, chain, claim, iters)
        calls = []
        for _ in range(iters):
            t = time.perf_counter()
            ray.get(actor.residency.remote(chain, 1, claim))
            calls.append(time.perf_counter() - t)
        nodes = NodeAnswers(opts.namespace, RankOwner.of_config(keys.config))

        async def routes() -> list[float]:
            out = []
            for _ in range(iters):
                t = time.perf_counter()
                got = await nodes.ask(cluster.node_ids, keys.keys(prompt), 1, 1.0)
                out.append(time.perf_counter() - t)
                assert len(got) == 2
            return out
        asked = asyncio.run(routes())
        log_calls, since = [], None
        for _ in range(iters):
            t = time.perf_counter()
            c = ray.get(actor.residency_changes.remote(since, claim))
            log_calls.append(time.perf_counter() - t)
            since = (c.incarnation, c.seq)
        client.close()
        tokenizer = None
        if text:
            from raykv_lab.engines.vllm_model import make_llama

            tokenizer = make_llama(str(out / "tiny-llama"))
        serve_result = _serve(node1, prompt, chain, requests, tokenizer)
    result = {"pages": pages, "iters": iters, "answer": [answer.l2, answer.segment, answer.l3],
              "in_actor": _ms(in_actor), "ray_call": _ms(calls), "asked": _ms(asked),
              "changes_call": _ms(log_calls),
              **serve_result}
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "raykv-bench")
    p.add_argument("--no-text", action="store_true",
                   help="skip the text requests (they need a local tokenizer: ~10 s)")
    args = p.parse_args()
    print(json.dumps(run(args.pages, args.iters, args.out, args.requests,
                         not args.no_text), indent=2))


if __name__ == "__main__":
    main()
