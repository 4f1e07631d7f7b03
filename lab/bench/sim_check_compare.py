"""``sim_check``'s arithmetic (pure: no Ray, Mooncake or torch): the sample of a trace
both sides replay, the simulator's side of the check, and the per-tier comparison.

A real replay records per request where each of its leading blocks was found
(``TIERS``); ``tally`` turns such records into the simulator's own ``Tally``, so both
sides' figures are the same arithmetic (blocks, and tokens with the trace's 512-token
blocks: ``Request.hit_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence

from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.layout import Layout
from raykv_lab.sim.tally import Tally
from raykv_lab.sim.trace import Request, conversations

TIERS = ("l2", "l3_own", "l3_remote")
"""The tiers a replay through a node's L2 finds blocks in, nearest first (the
simulator's names, ``lab.sim.tally.TIERS``; no GPU cache, no per-engine host
tier); the rest is computed."""
GAP_S = 1000.0
"""Simulated seconds between two requests: far more than any request, its loads and its
write-behind take in the simulator's cost model, and than a lease (L2's 10 s, the
store's 5 s), so each request starts on a cluster at rest, as the real replay's do."""
MAX_DIFF_PP = 2.0
"""How far apart a tier's share may be on the two sides, in percentage points."""


def conversation_sample(requests: Sequence[Request], n: int, seed: int = 0) -> list[Request]:
    """Whole conversations of ``requests`` (grouped by their second block, their first
    when they have one: every request of the conversation trace starts with the same
    block), drawn in a seeded random order until they hold ``n`` requests; the first
    ``n`` of those in arrival order. ``ValueError`` if ``requests`` has fewer."""
    if n < 1 or n > len(requests):
        raise ValueError(f"a sample of {n} requests out of {len(requests)}")
    drawn: list[Request] = []
    for group in conversations(requests, seed):
        if len(drawn) >= n:
            break
        drawn += group
    return sorted(drawn, key=lambda r: r.at)[:n]


def one_at_a_time(requests: Sequence[Request]) -> list[Request]:
    """``requests`` in their order, ``GAP_S`` apart from time 0."""
    return [Request(i * GAP_S, r.input_tokens, r.output_tokens, r.blocks)
            for i, r in enumerate(requests)]


def layout(nodes: int, l2_blocks: int, l3_blocks: int, host_blocks: int = 0) -> Layout:
    """The simulated twin of a real replay: ``nodes`` nodes of one engine each, no GPU
    cache, a host tier of ``host_blocks`` per engine (0: none), an L2 of ``l2_blocks``
    (0: none) and a segment of ``l3_blocks`` per node, placement ``own``, round robin."""
    return Layout(nodes, 1, 0, host_blocks=host_blocks, l2_blocks=l2_blocks,
                  l3_blocks=l3_blocks, placement="own", routing="round_robin")


def simulate(requests: Sequence[Request], lay: Layout) -> tuple[dict, dict]:
    """``requests`` replayed one at a time (``one_at_a_time``) on ``lay`` with the
    default costs: the run's figures (``Tally.as_dict``) and its tiers' counters
    (``ClusterSim.stats``)."""
    sim = ClusterSim(lay, Costs(), one_at_a_time(requests))
    return sim.run().as_dict(), sim.stats()


def tally(requests: Sequence[Request], records: Sequence[dict], nodes: int,
          what: str) -> dict:
    """The figures (``Tally.as_dict``) of a real replay's ``records`` (one per request of
    ``requests``, in order: ``node`` and, under ``what``, blocks per tier of
    ``TIERS``)."""
    t = Tally(nodes)
    for r, rec in zip(requests, records, strict=True):
        t.served(r, rec["node"], rec[what])
    return t.as_dict()


def compare(real: dict, sim: dict, tiers: Sequence[str] = TIERS) -> dict:
    """Per tier of ``tiers`` and ``computed``, the share of blocks and of tokens on each
    side (percent, rounded to 2 places) and their difference (real - sim, points);
    ``max_diff_pp``: the largest difference, blocks or tokens."""
    rows = {}
    for tier in (*tiers, "computed"):
        row = {}
        for weight, rate in (("block", "block_hit_rate"), ("token", "token_hit_rate")):
            def share(d: dict, tier: str = tier, weight: str = weight,
                      rate: str = rate) -> float:
                return 100 * (1 - d[rate] if tier == "computed" else
                              d[f"tiers_{weight}"][tier])
            a, b = share(real), share(sim)
            row[weight] = {"real": round(a, 2), "sim": round(b, 2), "diff_pp": round(a - b, 2)}
        rows[tier] = row
    worst = max(abs(w["diff_pp"]) for row in rows.values() for w in row.values())
    return {"tiers": rows, "max_diff_pp": worst}
