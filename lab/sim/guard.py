"""The load guard in the simulator (pure): raykv's own ``controllers.load_guard.choose_load``
on each request's hit, as a node would weigh it.

A request's hit beyond its engine's own caches is its node's L2 run, then L3's blocks
in prefix order, grouped into runs of consecutive blocks on one segment's memory
(``l3``, own or another node's) or one node's disk (``l3_disk``). Each run's estimate is
what the cost model says its load takes when the request starts: an L2 run the node
actor's call and the copy to the GPU; an L3 run its read at the tier's and the links'
rates after the queues as they are then (``Links.estimate``), the first with the store
call's fixed cost, each with the copy to the GPU through L2 when the node has one. The
prefill estimate is the cost model's GPU speed (``Costs.prefill_tokens_per_s``). The
simulator loads the leading pages ``choose_load`` keeps; the skipped tail is computed,
as a miss is (no bytes read, no L2 filled, counted a miss in the tally).

The estimates are exact for a run issued alone: the model knows the rates a real node
learns from its moving averages, so this is the guard with perfect estimates, and runs
to several segments are summed as ``choose_load`` sums them (the reads overlap in the
simulator).
"""

from __future__ import annotations

from collections.abc import Sequence

from raykv.controllers.load_guard import OFF, GuardSettings, LoadRun, choose_load
from raykv_lab.sim.costs import GB, Costs
from raykv_lab.sim.links import Links
from raykv_lab.sim.trace import BLOCK_TOKENS

TIERS = ("l2", "l3", "l3_disk")


def hit_runs(node: int, l2_blocks: int, segs: Sequence[tuple[int, bool]], links: Links,
             costs: Costs, t: float, through_l2: bool) -> list[LoadRun]:
    """The runs of a hit on ``node`` at ``t``: ``l2_blocks`` leading blocks in its L2, then
    ``segs`` (segment, on disk) of L3's, with their estimated seconds (module
    docstring); ``through_l2``: L3 reads reach the GPU through the node's L2."""
    copy = costs.block_bytes / (costs.l2_load_gbps * GB)
    runs = [LoadRun("l2", l2_blocks, costs.l2_call_s + l2_blocks * copy)] if l2_blocks else []
    i = 0
    while i < len(segs):
        j = i
        while j < len(segs) and segs[j] == segs[i]:
            j += 1
        seg, on_disk = segs[i]
        n = j - i
        s = links.estimate(node, seg, on_disk, n, t) + (n * copy if through_l2 else 0.0)
        if i == 0:
            s += costs.store_call_s
        runs.append(LoadRun("l3_disk" if on_disk else "l3", n, s))
        i = j
    return runs


class SimGuard:
    """One simulated cluster's guard under ``settings``, prefill at ``costs``' GPU speed.
    ``counts``: requests whose hit it cut, and the blocks it skipped per tier."""

    def __init__(self, settings: GuardSettings, costs: Costs) -> None:
        self.settings = settings
        self.prefill_s_per_token = 1.0 / costs.prefill_tokens_per_s
        self.counts = {"requests_cut": 0, "blocks_skipped": 0} | \
            {f"{t}_skipped": 0 for t in TIERS}

    @property
    def off(self) -> bool:
        return self.settings.mode == OFF

    def pages(self, runs: Sequence[LoadRun]) -> int:
        """How many leading pages of the hit ``runs`` to load (all of them when off)."""
        total = sum(r.pages for r in runs)
        if self.off or not total:
            return total
        choice = choose_load(runs, BLOCK_TOKENS, self.prefill_s_per_token, self.settings)
        if choice.pages < total:
            self.counts["requests_cut"] += 1
            self.counts["blocks_skipped"] += total - choice.pages
            for run in choice.skipped:
                self.counts[f"{run.tier}_skipped"] += run.pages
        return choice.pages
