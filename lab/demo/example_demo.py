"""``raykv demo``: a multi-turn chat on a 2-node cluster, with and without raykv.

An example engine (``example_engine``: a TP=2 transformer on Ray actors, hybrid with a
Mamba-like layer and a draft model by default) runs on each of the two nodes of an
embedded cluster. Sessions share a long system prompt and are routed round-robin over
the nodes, so prefixes are reused from the node's own host pool (L2) and from the other
node through Mooncake (L3). Every request runs twice: with raykv (group hit, fetch,
compute the rest) and without (recompute the whole prompt); the first-token logits must
be bit-identical. Then a long prompt is timed: recomputed vs fully cached (from L3 on
the other node, and from L2). Figures go to the console, ``demo.json`` and ``demo.png``.

The engines run the load guard (``load_guard``: ``auto`` by default, ``off``, or a
threshold in tokens): each request records what it loaded and what the guard
recomputed instead, per tier, and its time to first token with raykv against
recomputing the whole prompt (``ttft_ratio``; ``TTFT_SLACK`` says when a request counts
as later than recomputing).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch
from raykv import MiB
from raykv.example_engine import Engine, Generation
from raykv.example_engine.presets import build
from raykv.example_engine.workload import ChatWorkload
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
from rich.console import Console

TTFT_SLACK = (1.1, 5.0)
"""A request's first token with raykv counts as later than recomputing it when its TTFT
exceeds ``1.1 x`` recomputing's ``+ 5 ms`` (timing noise of two runs on a shared
machine)."""


def later_than_recompute(ttft_ms: float, recompute_ms: float) -> bool:
    """Whether ``ttft_ms`` with raykv is later than ``recompute_ms`` (``TTFT_SLACK``)."""
    factor, extra_ms = TTFT_SLACK
    return ttft_ms > factor * recompute_ms + extra_ms


def _record(gen: Generation, base: Generation) -> dict:
    """One request's figures (``base``: the same prompt recomputed without raykv)."""
    return dict(prompt_tokens=gen.prompt_tokens, prompt_pages=gen.prompt_pages,
                hit_pages=gen.hit_pages, l2_pages=gen.l2_pages, l3_pages=gen.l3_pages,
                state_tier=gen.state_tier, computed_tokens=gen.computed_tokens,
                ttft_ms=gen.ttft_s * 1e3, ttft_recompute_ms=base.ttft_s * 1e3,
                query_ms=gen.query_s * 1e3, fetch_ms=gen.fetch_s * 1e3,
                fetched_bytes=gen.fetched_bytes, offloaded_pages=gen.offloaded_pages,
                ttft_ratio=gen.ttft_s / base.ttft_s,
                later=later_than_recompute(gen.ttft_s * 1e3, base.ttft_s * 1e3),
                skipped_pages=gen.skipped_pages, guard_reason=gen.guard_reason,
                offload_ms=gen.offload_s * 1e3, decode_ms=gen.decode_s * 1e3,
                reply_tokens=len(gen.tokens), draft_proposed=gen.proposed,
                draft_accepted=gen.accepted,
                exact=bool(torch.equal(gen.logits[0], base.logits[0])))


def _summary(requests: list[dict], page_size: int, hybrid: bool, draft: bool) -> dict:
    """Hit rates per tier (prompt tokens served by L2, L3, computed) and per pool
    (pages or checkpoints), and bytes fetched from L3 per pool."""
    tokens = sum(r["prompt_tokens"] for r in requests)
    pages = sum(r["prompt_pages"] for r in requests)
    l2 = sum(r["l2_pages"] for r in requests)
    l3 = sum(r["l3_pages"] for r in requests)
    tiers = {"l2_local_pool": l2 * page_size / tokens, "l3_mooncake": l3 * page_size / tokens,
             "computed": sum(r["computed_tokens"] for r in requests) / tokens}
    kv = {"l2": l2 / pages, "l3": l3 / pages, "miss": 1 - (l2 + l3) / pages}
    pools = {"kv": kv} | ({"draft": dict(kv)} if draft else {})
    if hybrid:
        tier = [r["state_tier"] for r in requests]
        pools["mamba"] = {t: tier.count(t) / len(tier) for t in ("l2", "l3")}
        pools["mamba"]["miss"] = tier.count(None) / len(tier)
    fetched: dict[str, int] = {}
    for r in requests:
        for pool, b in r["fetched_bytes"].items():
            fetched[pool] = fetched.get(pool, 0) + b
    with_ms = sum(r["ttft_ms"] for r in requests)
    without_ms = sum(r["ttft_recompute_ms"] for r in requests)
    skipped: dict[str, int] = {}
    for r in requests:
        for tier, n in r["skipped_pages"].items():
            skipped[tier] = skipped.get(tier, 0) + n * page_size
    return dict(tier_hit_rate=tiers, pool_hit_rate=pools, fetched_bytes=fetched,
                ttft_ms_total=with_ms, ttft_recompute_ms_total=without_ms,
                speedup=without_ms / with_ms, all_exact=all(r["exact"] for r in requests),
                guard_loaded_tokens={"l2": l2 * page_size, "l3": l3 * page_size},
                guard_recomputed_tokens=skipped,
                worst_ttft_ratio=max(r["ttft_ratio"] for r in requests),
                later_than_recompute=sum(r["later"] for r in requests))


def run_demo(*, variant: str = "hybrid-draft", hidden: int = 512, layers: int = 8,
             head_dim: int = 64, page_size: int = 64, sessions: int = 4, turns: int = 3,
             system_tokens: int = 1024, user_tokens: int = 64, reply_tokens: int = 16,
             long_prompt: int = 4096, load_guard: str = "auto", out_dir: str = "raykv-out",
             console: Console | None = None) -> bool:
    """Run the demo; returns True if every request's first-token logits with raykv equal
    those of recomputing, and the cached long prompt restored every page it could or
    the load guard recomputed it (``load_guard``: ``auto``, ``off`` or a threshold in
    tokens, as ``GuardSettings.parse`` reads it)."""
    console = demo_console(console)
    target, draft = build(variant, f"demo/{variant}-{hidden}x{layers}", hidden=hidden,
                          layers=layers, head_dim=head_dim)
    work = ChatWorkload(sessions, turns, system_tokens, user_tokens, reply_tokens,
                        target.vocab)
    longest = system_tokens + turns * (user_tokens + reply_tokens)
    max_tokens = -(-(max(longest, long_prompt) + reply_tokens + 8) // page_size) * page_size
    host_pages = max_tokens // page_size + (sessions * turns * (user_tokens + reply_tokens)
                                            + system_tokens) // page_size + 8
    with start_demo_cluster(console) as cluster:
        with console.status(f"loading {variant} model ({hidden} hidden, {layers} layers, "
                            "TP=2) on each node"):
            engines = [Engine(target, node, draft=draft, page_size=page_size,
                              max_tokens=max_tokens, host_pages=host_pages,
                              state_slots=host_pages, name=f"demo-n{i}",
                              load_guard=load_guard)
                       for i, node in enumerate(cluster.node_ids)]
            for eng in engines:  # warm-up: first calls of every path, nothing cached
                eng.generate(list(range(page_size + 1)), 4, use_cache=False)
        requests = _chat(work, engines, console)
        long = _long_prompt(engines, long_prompt, target.vocab, console)
        traffic = l3_traffic(cluster)
    summary = _summary(requests, page_size, target.ssm_layers > 0, draft is not None)
    summary["l3_bytes"] = traffic
    _print(console, requests, summary, long, load_guard)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(variant=variant, target=asdict(target),
                  draft=asdict(draft) if draft else None, page_size=page_size, tp_size=2,
                  nodes=2, workload=asdict(work), long_prompt=long_prompt,
                  load_guard=load_guard)
    bars = {"recompute": long["recompute_ms"],
            "cached (L3,\nother node)": long["cached_l3_ms"],
            "cached (L2,\nlocal pool)": long["cached_l2_ms"]}
    save(dict(machine=machine(), config=config, requests=requests, summary=summary,
              long_prompt=long), out, "demo",
         lambda r, path: plot_ttft(r["requests"], bars, long["tokens"], path), console)
    ok = summary["all_exact"] and long["exact"] and long["recompute_hit_pages"] == 0 and \
        all(long[f"cached_{t}_hit_pages"] + long[f"cached_{t}_skipped_pages"]
            == long["max_hit_pages"] for t in ("l2", "l3"))
    console.print("[green]OK[/]: with raykv, every first token's logits equal recomputing "
                  "them, bit for bit" if ok else "[red]FAILED[/]")
    return ok


def _chat(work: ChatWorkload, engines: list[Engine], console: Console) -> list[dict]:
    """The chat: each request with raykv, then recomputed without it (one token)."""
    def serve(node: int, prompt: list[int]) -> tuple[list[int], dict]:
        gen = engines[node].generate(prompt, work.reply_tokens)
        base = engines[node].generate(prompt, 1, use_cache=False)
        return gen.tokens, _record(gen, base)

    return run_chat(work, len(engines), console, serve)


def _long_prompt(engines: list[Engine], n: int, vocab: int, console: Console) -> dict:
    """TTFT of an ``n``-token prompt: computed from scratch on node 0 (nothing cached:
    the group query misses, every token is computed, pages are offloaded after the first
    token), then fully cached: restored from L3 on node 1, and from node 0's L2."""
    prompt = long_prompt_tokens(n, vocab)
    a, b = engines
    steps = run_steps(console, f"{n}-token prompt",
                      [(name, partial(eng.generate, prompt, 1))
                       for name, eng in (("recompute", a), ("cached_l3", b), ("cached_l2", a))])
    base = steps["recompute"]
    return dict(tokens=n, max_hit_pages=(n - 1) // a.page_size,
                recompute_ms=base.ttft_s * 1e3, recompute_hit_pages=base.hit_pages,
                cached_l3_ms=steps["cached_l3"].ttft_s * 1e3,
                cached_l3_query_ms=steps["cached_l3"].query_s * 1e3,
                cached_l3_fetch_ms=steps["cached_l3"].fetch_s * 1e3,
                cached_l2_ms=steps["cached_l2"].ttft_s * 1e3,
                cached_l3_hit_pages=steps["cached_l3"].l3_pages,
                cached_l2_hit_pages=steps["cached_l2"].l2_pages,
                cached_l3_skipped_pages=sum(steps["cached_l3"].skipped_pages.values()),
                cached_l2_skipped_pages=sum(steps["cached_l2"].skipped_pages.values()),
                cached_l3_ratio=steps["cached_l3"].ttft_s / base.ttft_s,
                cached_l2_ratio=steps["cached_l2"].ttft_s / base.ttft_s,
                l3_fetched_bytes=steps["cached_l3"].fetched_bytes,
                speedup_l3=base.ttft_s / steps["cached_l3"].ttft_s,
                speedup_l2=base.ttft_s / steps["cached_l2"].ttft_s,
                exact=all(torch.equal(steps[k].logits[0], base.logits[0])
                          for k in ("cached_l3", "cached_l2")))


def _guard_cell(skipped: dict[str, int]) -> str:
    """The table's guard column: ``load``, or the pages recomputed per tier."""
    return ", ".join(f"{t.upper()} {n}p recomputed" for t, n in sorted(skipped.items())) \
        or "load"


def _print(console: Console, requests: list[dict], summary: dict, long: dict,
           load_guard: str) -> None:
    table = right_table("Time to first token per request (ms)",
                        ("session", "turn", "node", "prompt", "L2 pages", "L3 pages",
                         "guard", "computed", "raykv", "recompute", "ratio", "L3 MiB",
                         "state", "exact"))
    for r in requests:
        table.add_row(str(r["session"]), str(r["turn"]), str(r["node"]),
                      str(r["prompt_tokens"]), str(r["l2_pages"]), str(r["l3_pages"]),
                      _guard_cell(r["skipped_pages"]), str(r["computed_tokens"]),
                      f"{r['ttft_ms']:.0f}", f"{r['ttft_recompute_ms']:.0f}",
                      ("[red]" if r["later"] else "") + f"{r['ttft_ratio']:.2f}",
                      f"{sum(r['fetched_bytes'].values()) / MiB:.1f}", r["state_tier"] or "-",
                      "yes" if r["exact"] else "[red]NO")
    console.print(table)
    tiers = summary["tier_hit_rate"]
    console.print(f"prompt tokens served: L2 (local host pool) {tiers['l2_local_pool']:.0%}, "
                  f"L3 (Mooncake) {tiers['l3_mooncake']:.0%}, computed {tiers['computed']:.0%}"
                  f"; total TTFT {summary['ttft_ms_total']:.0f} ms with raykv vs "
                  f"{summary['ttft_recompute_ms_total']:.0f} ms "
                  f"({summary['speedup']:.1f}x)")
    loaded, skipped = summary["guard_loaded_tokens"], summary["guard_recomputed_tokens"]
    console.print(f"load guard ({load_guard}): loaded L2 {loaded['l2']} tokens, L3 "
                  f"{loaded['l3']}; recomputed instead "
                  + (", ".join(f"{t.upper()} {n}" for t, n in sorted(skipped.items()))
                     or "none")
                  + f"; TTFT raykv / recompute at worst {summary['worst_ttft_ratio']:.2f}, "
                  f"{summary['later_than_recompute']} of {len(requests)} requests later "
                  f"than recomputing (over {TTFT_SLACK[0]}x + {TTFT_SLACK[1]:.0f} ms)")
    for pool, rates in summary["pool_hit_rate"].items():
        console.print(f"  pool {pool}: " + ", ".join(f"{t} {v:.0%}" for t, v in rates.items())
                      + f"; fetched from L3 {summary['fetched_bytes'].get(pool, 0) / MiB:.1f} MiB")
    print_l3_traffic(console, summary["l3_bytes"])
    console.print(f"[bold]{long['tokens']}-token prompt[/]: recompute "
                  f"{long['recompute_ms']:.0f} ms; fully cached from L3 (other node) "
                  f"{long['cached_l3_ms']:.0f} ms ({long['speedup_l3']:.1f}x lower; group "
                  f"query {long['cached_l3_query_ms']:.0f} ms, fetch of "
                  f"{sum(long['l3_fetched_bytes'].values()) / MiB:.0f} MiB "
                  f"{long['cached_l3_fetch_ms']:.0f} ms), from "
                  f"L2 (local pool) {long['cached_l2_ms']:.0f} ms "
                  f"({long['speedup_l2']:.1f}x lower); {long['cached_l3_hit_pages']} of "
                  f"{long['max_hit_pages']} restorable pages loaded from L3 "
                  f"({long['cached_l3_skipped_pages']} recomputed by the load guard)")
