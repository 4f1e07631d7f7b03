"""``raykv demo --engine vllm``: the multi-turn chat of ``raykv demo`` on real vLLM.

An embedded 2-node cluster (``start_local(num_nodes=2)``: two Ray nodes, a real
``mooncake_master``, one actor per node) runs two vLLM engines per node, each in a
Ray actor (in-process engine core, eager, one OMP thread: ``lab.engines.vllm_actors``),
on a random-weight Llama made locally (``lab.engines.vllm_model``): one with raykv's
``RayKVConnector`` and an L2 (``l2_blocks``: the node's shared host cache), one without
(stock vLLM). Both keep vLLM's own prefix cache on (its default), so "without raykv" is
vLLM as deployed: it reuses what its own engine computed; with raykv an engine also
loads the blocks any engine on the node saved (L2, a copy from shared memory) or any
engine on any node saved (L3: Mooncake, read into the node's L2 first).

The chat is ``ChatWorkload``'s (sessions share a system prompt; turn ``t`` of session
``s`` runs on node ``(s + t) % 2``); every request runs on its node's raykv engine, then
on the node's stock engine. TTFT is vLLM's own ``first_token_latency`` (the request's
arrival to its first token, in the engine). Per request: tokens from vLLM's prefix
cache, loaded from the node's L2, loaded from L3, computed (``tier_counts``: the node
actors' L2 hits and Mooncake gets around the request, with the worker's loaded blocks).
Then a long prompt: recomputed by node 0's stock engine, computed (and saved) by node 0's
raykv engine, then fully cached: loaded from L3 on node 1 (the blocks node 0 computed),
from node 0's own prefix cache, and from node 0's L2 after node 0's engine dropped its
prefix cache (as when vLLM evicts blocks: no Mooncake get). The three cached runs
compute the same last tokens over what must be the same KV: they must give the same
tokens, with every restorable block loaded. (bf16 results of vLLM's CPU
kernels depend on how a prefill is split, so a recomputed prompt is compared, not
required, to match.)
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import ray
from raykv import MiB
from raykv.example_engine.workload import ChatWorkload
from raykv.integrations.vllm.request_blocks import max_loadable_blocks
from raykv_lab.bench.toolkit import right_table, save
from raykv_lab.demo.chat import (
    demo_console,
    l3_traffic,
    long_prompt_tokens,
    machine,
    plot_ttft,
    print_l3_traffic,
    run_chat,
    run_steps,
    start_demo_cluster,
)
from raykv_lab.engines.vllm_actors import ready, start_engine
from raykv_lab.engines.vllm_model import VOCAB, LlamaDims, make_llama
from rich.console import Console

SETTLE_S = 30.0
"""How long the demo waits, at most, before and after a request for the nodes' L2
write-behind to end (``tier_counts``)."""

def run_vllm_demo(*, hidden: int = 384, layers: int = 6, head_dim: int = 64,
                  page_size: int = 128, sessions: int = 4, turns: int = 3,
                  system_tokens: int = 1024, user_tokens: int = 64, reply_tokens: int = 16,
                  long_prompt: int = 4096, out_dir: str = "raykv-out",
                  console: Console | None = None) -> dict:
    """Run the demo and write ``demo_vllm.json`` and ``demo_vllm.png`` to ``out_dir``;
    returns the result (``result["ok"]``: with the load guard off, node 1 loaded every
    restorable block of the long prompt from raykv and then gave the same tokens as node 0
    restoring the same prefix from vLLM's own prefix cache, i.e. the loaded KV is the KV
    node 0 computed).
    ``page_size`` is vLLM's block size (a multiple of 32 on CPU); the model is made once under
    ``out_dir/models``."""
    console = demo_console(console)
    started = time.perf_counter()
    phases: dict[str, float] = {}  # seconds per phase of the run

    def lap(name: str) -> None:
        phases[name] = time.perf_counter() - started - sum(phases.values())

    dims = LlamaDims.of(hidden, layers, head_dim)
    out = Path(out_dir)
    with console.status(f"making a random-weight Llama ({dims.params / 1e6:.0f} M parameters)"):
        model = make_llama(str(out / "models" / f"llama-{hidden}x{layers}-d{head_dim}"), dims)
    lap("model")
    work = ChatWorkload(sessions, turns, system_tokens, user_tokens, reply_tokens, VOCAB)
    longest = max(system_tokens + turns * (user_tokens + reply_tokens), long_prompt)
    max_model_len = -(-(longest + reply_tokens) // page_size) * page_size
    # Room for every prompt and reply of the run in vLLM's own cache (nothing evicted),
    # and in each node's L2 (every block the run saves).
    cached = system_tokens + sessions * turns * (user_tokens + reply_tokens) + longest
    kv_bytes = max(64 * MiB, 2 * cached * dims.kv_bytes_per_token)
    llm = dict(max_model_len=max_model_len, block_size=page_size,
               enable_prefix_caching=True, kv_cache_memory_bytes=kv_bytes)
    l2_blocks = -(-cached // page_size) + 8
    with start_demo_cluster(console, log_to_driver=False) as cluster:
        lap("cluster")
        with console.status("starting 4 vLLM engines (2 per node: with raykv, stock)"):
            # the load guard off: this demo shows every tier's exact loads, and a tiny
            # model on CPU computes a block about as fast as it loads it (the guard would
            # recompute; the example engine's demo shows the guard's choices)
            conf = {"model_name": f"demo/llama-{hidden}x{layers}", "l2_blocks": l2_blocks,
                    "load_guard": "off"}
            with_raykv = [start_engine(n, model, conf, **llm) for n in cluster.node_ids]
            stock = [start_engine(n, model, None, **llm) for n in cluster.node_ids]
            ready(*with_raykv, *stock)
            warm = random.Random("warm-up")
            ray.get([e.generate.remote([warm.randrange(3, VOCAB) for _ in
                                        range(2 * page_size + 1)], 2)
                     for e in with_raykv + stock])
        lap("engines")
        tiers = partial(tier_counts, cluster, with_raykv)
        requests = _chat(work, with_raykv, stock, page_size, tiers, console)
        lap("chat")
        long = _long_prompt(with_raykv, stock, long_prompt, reply_tokens, page_size,
                            tiers, console)
        lap("long_prompt")
        traffic = l3_traffic(cluster)
        for e in with_raykv + stock:
            ray.kill(e)
    summary = _summary(requests)
    summary["l3_bytes"] = traffic
    _print(console, requests, summary, long)
    import vllm

    ok = long["exact"] and long["raykv_loaded_blocks"] == long["max_hit_blocks"] and \
        long["recompute_cached_tokens"] == 0 and \
        long["cached_l2_blocks"] == long["max_hit_blocks"] and long["cached_l2_gets"] == 0
    result = dict(
        machine=machine() | {"vllm": vllm.__version__},
        config=dict(engine="vllm", model=asdict(dims) | {"params": dims.params,
                                                         "vocab": VOCAB, "dtype": "bfloat16"},
                    block_size=page_size, nodes=2, tp_size=1, workload=asdict(work),
                    l2_blocks=l2_blocks,
                    long_prompt=long_prompt, vllm=llm | {"enforce_eager": True,
                                                         "omp_threads": 1}),
        requests=requests, summary=summary, long_prompt=long, ok=ok, phases_s=phases,
        elapsed_s=time.perf_counter() - started)
    out.mkdir(parents=True, exist_ok=True)
    save(result, out, "demo_vllm", lambda r, path: plot_ttft(
        r["requests"], {"recompute\n(stock)": long["recompute_ms"],
                        "raykv L3\n(other node)": long["cached_raykv_ms"],
                        "raykv L2\n(same node)": long["cached_l2_ms"],
                        "vLLM's\nprefix cache": long["cached_vllm_ms"],
                        "recompute,\nsave to raykv": long["recompute_save_ms"]},
        long["tokens"], path, without=("ttft_stock_ms", "without raykv (stock vLLM)"),
        tiers=TIERS), console)
    console.print("[green]OK[/]: the long prompt restored from raykv (L3 on the other node, "
                  "L2 on its own node) gives the tokens of restoring it from vLLM's own "
                  "prefix cache" if ok else "[red]FAILED[/]")
    return result


TIERS = {"vllm_cached_tokens": "vLLM prefix cache", "l2_tokens": "raykv L2 (node)",
         "l3_tokens": "raykv L3 (Mooncake)", "computed_tokens": "computed"}
"""A request record's prompt tokens per tier (key -> the figure's label); they add up to
``prompt_tokens``."""


def _loaded(engine) -> tuple[int, int]:
    """Blocks the engine's (TP=1) worker connector has loaded and saved so far."""
    (s,) = ray.get(engine.worker_stats.remote())
    return s.counters.loaded, s.counters.saved


def tier_counts(cluster, engines: list) -> dict[str, int]:
    """Counters whose change around a request says where its loaded blocks came from,
    summed over nodes and raykv engines: ``l2_hits`` (blocks the node actors' L2 pools
    handed out ready: loaded from L2), ``l3_gets`` (objects the node actors got from
    Mooncake), ``filled`` (of those, read into L2 for a load), and the workers'
    ``loaded`` and ``saved`` blocks. Read once every node's L2 write-behind has ended
    for what was committed to it (at most ``SETTLE_S``), so that a request finds in L3
    what the requests before it saved, on whichever node, as a user's later request
    would (outside any request's TTFT)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = ray.get([a.stats.remote() for a in cluster.node_actors.values()])
        if time.monotonic() > deadline or all(
                s.l2.l3_put + s.l2.l3_put_failed >= s.l2.l3_put_submitted for s in stats):
            break
        time.sleep(0.05)
    workers = [_loaded(e) for e in engines]
    return dict(
        l2_hits=sum(p.hits for s in stats for p in s.l2.pools.values()),
        l3_gets=sum(s.counters.get("get_objects", 0) for s in stats),
        filled=sum(s.l2.filled for s in stats),
        loaded=sum(w[0] for w in workers), saved=sum(w[1] for w in workers))


def _served(engine, prompt: list[int], max_tokens: int, tiers, block: int, *,
            reset: bool = False) -> dict:
    """``engine.generate`` of ``prompt`` with the tier split of what it loaded:
    ``l2_blocks`` (from the node's L2), ``l3_blocks`` (from Mooncake), ``l3_gets``,
    ``saved_blocks``, and the tokens they count for (``raykv_tokens``, ``l2_tokens``,
    ``l3_tokens``: a prompt of whole blocks loaded to its end counts its last token as
    computed, which vLLM computes again over the loaded block); ``reset``: vLLM's own
    prefix cache dropped first."""
    if reset and not ray.get(engine.reset_prefix_cache.remote()):
        raise RuntimeError("vLLM refused to reset its prefix cache")
    before = tiers()
    got = ray.get(engine.generate.remote(prompt, max_tokens))
    d = {k: v - before[k] for k, v in tiers().items()}
    l2, l3 = d["l2_hits"], d["loaded"] - d["l2_hits"]
    short = int(d["loaded"] > 0 and got["cached"] == len(prompt) - 1)  # the last block's
    return got | dict(l2_blocks=l2, l3_blocks=l3, loaded_blocks=d["loaded"],
                      l3_gets=d["l3_gets"], saved_blocks=d["saved"],
                      raykv_tokens=d["loaded"] * block - short,
                      l2_tokens=l2 * block - (0 if l3 else short),  # L3's blocks come last
                      l3_tokens=l3 * block - (short if l3 else 0))


def _chat(work: ChatWorkload, with_raykv: list, stock: list, block: int, tiers,
          console: Console) -> list[dict]:
    """The chat: each request on its node's raykv engine, then on its stock engine."""
    def serve(node: int, prompt: list[int]) -> tuple[list[int], dict]:
        got = _served(with_raykv[node], prompt, work.reply_tokens, tiers, block)
        base = ray.get(stock[node].generate.remote(prompt, work.reply_tokens))
        raykv = got["raykv_tokens"]
        return got["tokens"], dict(
            prompt_tokens=len(prompt), vllm_cached_tokens=got["cached"] - raykv,
            raykv_tokens=raykv, l2_tokens=got["l2_tokens"],
            l3_tokens=got["l3_tokens"], computed_tokens=len(prompt) - got["cached"],
            l3_gets=got["l3_gets"], saved_blocks=got["saved_blocks"],
            ttft_ms=got["ttft_s"] * 1e3, ttft_stock_ms=base["ttft_s"] * 1e3,
            stock_cached_tokens=base["cached"], same_tokens=got["tokens"] == base["tokens"])

    return run_chat(work, len(with_raykv), console, serve)


def _long_prompt(with_raykv: list, stock: list, n: int, reply: int, block: int, tiers,
                 console: Console) -> dict:
    """TTFT of an ``n``-token prompt, in order: recomputed by node 0's stock engine (the
    reference); computed by node 0's raykv engine (raykv misses; its full blocks are
    saved into node 0's L2 inside its TTFT, the Mooncake put behind it); fully cached:
    loaded from L3 by node 1's raykv engine (the blocks node 0 computed), from node 0's
    raykv engine's own prefix cache, then from node 0's L2 by the same engine once its
    prefix cache was dropped."""
    prompt = long_prompt_tokens(n, VOCAB, first_id=3)
    a, b = with_raykv
    runs = (("recompute", stock[0], False), ("recompute_save", a, False),
            ("cached_raykv", b, False), ("cached_vllm", a, False), ("cached_l2", a, True))
    steps = run_steps(console, f"{n}-token prompt",
                      [(name, partial(_served, eng, prompt, reply, tiers, block, reset=r))
                       for name, eng, r in runs])
    ms = {k: v["ttft_s"] * 1e3 for k, v in steps.items()}
    want = steps["recompute"]["tokens"]
    cached = steps["cached_vllm"]["tokens"]
    return dict(tokens=n, max_hit_blocks=max_loadable_blocks(n, block),
                recompute_ms=ms["recompute"],
                recompute_save_ms=ms["recompute_save"],
                recompute_cached_tokens=steps["recompute_save"]["cached"],
                cached_raykv_ms=ms["cached_raykv"],
                raykv_loaded_blocks=steps["cached_raykv"]["loaded_blocks"],
                cached_raykv_l3_blocks=steps["cached_raykv"]["l3_blocks"],
                cached_raykv_gets=steps["cached_raykv"]["l3_gets"],
                cached_raykv_tokens=steps["cached_raykv"]["cached"],
                cached_vllm_ms=ms["cached_vllm"],
                cached_vllm_tokens=steps["cached_vllm"]["cached"],
                cached_l2_ms=ms["cached_l2"],
                cached_l2_blocks=steps["cached_l2"]["l2_blocks"],
                cached_l2_gets=steps["cached_l2"]["l3_gets"],
                cached_l2_tokens=steps["cached_l2"]["cached"],
                speedup_raykv=ms["recompute"] / ms["cached_raykv"],
                speedup_l2=ms["recompute"] / ms["cached_l2"],
                speedup_vllm=ms["recompute"] / ms["cached_vllm"],
                same_tokens_as_recompute={k: v["tokens"] == want for k, v in steps.items()},
                exact=steps["cached_raykv"]["tokens"] == cached == steps["cached_l2"]["tokens"])


def _summary(requests: list[dict]) -> dict:
    """Prompt tokens served per tier, with raykv (``raykv``: ``l2`` and ``l3``
    together) and without; TTFT totals."""
    tokens = sum(r["prompt_tokens"] for r in requests)
    vllm = sum(r["vllm_cached_tokens"] for r in requests)
    raykv = sum(r["raykv_tokens"] for r in requests)
    l2 = sum(r["l2_tokens"] for r in requests)
    stock = sum(r["stock_cached_tokens"] for r in requests)
    with_ms = sum(r["ttft_ms"] for r in requests)
    stock_ms = sum(r["ttft_stock_ms"] for r in requests)
    return dict(
        tier_hit_rate={"vllm_prefix_cache": vllm / tokens, "raykv": raykv / tokens,
                       "l2_node": l2 / tokens, "l3_mooncake": (raykv - l2) / tokens,
                       "computed": 1 - (vllm + raykv) / tokens},
        stock_hit_rate={"vllm_prefix_cache": stock / tokens, "computed": 1 - stock / tokens},
        ttft_ms_total=with_ms, ttft_stock_ms_total=stock_ms, speedup=stock_ms / with_ms,
        same_tokens=sum(r["same_tokens"] for r in requests), requests=len(requests))


def _print(console: Console, requests: list[dict], summary: dict, long: dict) -> None:
    table = right_table("Prompt tokens per tier (vLLM's prefix cache, raykv L2 on the node, "
                        "raykv L3 with its Mooncake gets, computed) and time to first "
                        "token (ms), vLLM with raykv vs stock",
                        ("sess", "turn", "node", "prompt", "vLLM", "L2", "L3", "comp",
                         "gets", "TTFT", "stock TTFT", "speedup", "stock vLLM", "same"))
    for r in requests:
        table.add_row(str(r["session"]), str(r["turn"]), str(r["node"]),
                      str(r["prompt_tokens"]), str(r["vllm_cached_tokens"]),
                      str(r["l2_tokens"]), str(r["l3_tokens"]), str(r["computed_tokens"]),
                      str(r["l3_gets"]),
                      f"{r['ttft_ms']:.0f}", f"{r['ttft_stock_ms']:.0f}",
                      f"{r['ttft_stock_ms'] / r['ttft_ms']:.1f}x",
                      str(r["stock_cached_tokens"]), "yes" if r["same_tokens"] else "no")
    console.print(table)
    tiers, stock = summary["tier_hit_rate"], summary["stock_hit_rate"]
    console.print(f"prompt tokens served with raykv: vLLM prefix cache "
                  f"{tiers['vllm_prefix_cache']:.0%}, raykv L2 (node) {tiers['l2_node']:.0%}, "
                  f"raykv L3 (Mooncake) {tiers['l3_mooncake']:.0%}, "
                  f"computed {tiers['computed']:.0%}; stock vLLM: prefix cache "
                  f"{stock['vllm_prefix_cache']:.0%}, computed {stock['computed']:.0%}")
    console.print(f"total TTFT {summary['ttft_ms_total']:.0f} ms with raykv vs "
                  f"{summary['ttft_stock_ms_total']:.0f} ms stock ({summary['speedup']:.1f}x); "
                  f"greedy tokens equal to stock vLLM's in {summary['same_tokens']} of "
                  f"{summary['requests']} requests")
    print_l3_traffic(console, summary["l3_bytes"])
    console.print(f"[bold]{long['tokens']}-token prompt[/]: recompute "
                  f"{long['recompute_ms']:.0f} ms (stock vLLM; "
                  f"{long['recompute_save_ms']:.0f} ms with raykv saving its blocks); fully "
                  f"cached from raykv L3 (other node, "
                  f"{long['raykv_loaded_blocks']} of {long['max_hit_blocks']} blocks loaded, "
                  f"{long['cached_raykv_gets']} Mooncake gets) "
                  f"{long['cached_raykv_ms']:.0f} ms ([bold]{long['speedup_raykv']:.1f}x "
                  f"lower[/]); from raykv L2 (same node, vLLM's cache dropped: "
                  f"{long['cached_l2_blocks']} blocks, {long['cached_l2_gets']} Mooncake "
                  f"gets) {long['cached_l2_ms']:.0f} ms ({long['speedup_l2']:.1f}x lower); "
                  f"from vLLM's own prefix cache {long['cached_vllm_ms']:.0f} ms "
                  f"({long['speedup_vllm']:.1f}x lower); same tokens: "
                  f"{'yes' if long['exact'] else 'NO'}")
