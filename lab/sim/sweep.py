"""Sweeps of ``raykv sim``: the comparisons at several host capacities per node and at
several node counts (pure; the figure is ``sweep_figure``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from raykv_lab.sim.compare import BOUNDS, Setup, compare
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.trace import BLOCK_TOKENS, Request

SWEEP_RUNS = ("local_host", "pooled", "raykv")
"""The timed runs of a sweep: a host tier per engine, one pooled store, raykv."""
L2_SHARE = 1 / 3
"""The part of a node's host memory a sweep gives L2 (the rest is its L3 segment): the
default comparison's 1M of 3M tokens."""


def split(setup: Setup, host_tokens: int) -> Setup:
    """``setup`` with ``host_tokens`` per node, ``L2_SHARE`` of it in L2 (at least a
    block each)."""
    l2 = max(BLOCK_TOKENS, round(host_tokens * L2_SHARE))
    return dataclasses.replace(setup, l2_tokens=l2,
                               l3_tokens=max(BLOCK_TOKENS, host_tokens - l2))


def point(result: dict) -> dict:
    """One sweep point of a comparison: per run its block hit rate, TTFT p50 and p99,
    network bytes; the references' hit rates."""
    return {"runs": {n: {"block_hit_rate": r["block_hit_rate"], "ttft_p50_s":
                         r["ttft_s"]["p50"], "ttft_p99_s": r["ttft_s"]["p99"],
                         "network_bytes": r["network_bytes"]}
                     for n, r in result["runs"].items()},
            "bounds": {n: result["bounds"][n]["block_hit_rate"] for n in BOUNDS}}


def sweep(requests: Sequence[Request], base: Setup, costs: Costs,
          host_tokens: Sequence[int], node_counts: Sequence[int]) -> dict:
    """The comparison (``SWEEP_RUNS`` and the references) at each of ``host_tokens`` per
    node (``base``'s nodes) and at each of ``node_counts`` (``base``'s host tokens):
    ``{"capacity": [...], "nodes": [...]}``, each point with its ``host_tokens`` and
    ``nodes``."""
    if not host_tokens or not node_counts:
        raise ValueError("a sweep needs some host capacities and some node counts")
    out: dict = {"setup": dataclasses.asdict(base), "requests": len(requests),
                 "capacity": [], "nodes": []}
    for tokens in host_tokens:
        setup = split(base, tokens)
        out["capacity"].append({"host_tokens": tokens, "nodes": setup.nodes,
                                **point(compare(requests, setup, costs, SWEEP_RUNS))})
    for n in node_counts:
        setup = dataclasses.replace(base, nodes=n)
        out["nodes"].append({"host_tokens": setup.l2_tokens + setup.l3_tokens, "nodes": n,
                             **point(compare(requests, setup, costs, SWEEP_RUNS))})
    return out
