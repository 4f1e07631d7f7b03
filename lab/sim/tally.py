"""What one simulated run measured (pure): per tier hits weighted by blocks and tokens,
TTFT and end-to-end percentiles, bytes over the network, load per node."""

from __future__ import annotations

import math
from collections.abc import Sequence

from raykv_lab.sim.trace import Request

TIERS = ("gpu", "host", "l2", "l3_own", "l3_remote", "l3_disk")
"""Where a request's leading blocks came from, nearest first: its engine's GPU prefix
cache, a per-engine host tier, its node's L2, L3 on its node's own segment, L3 on
another node's segment, L3 on a node's disk tier (any node's); the rest is computed."""


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank (the smallest value with
    at least ``q`` of them at or below it); 0.0 when empty."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class Tally:
    """The counts of one run over ``nodes`` nodes."""

    def __init__(self, nodes: int) -> None:
        self.blocks = {t: 0 for t in TIERS}
        self.tokens = {t: 0 for t in TIERS}
        self.all_blocks = self.all_tokens = 0
        self.ttft: list[float] = []
        self.e2e: list[float] = []
        self.network_bytes = 0
        self.requests_per_node = [0] * nodes
        self.computed_per_node = [0] * nodes
        self.log: list[tuple[float, int, int, int, int]] = []
        """Per request served: (arrival s, node, leading blocks found, blocks, of them
        from L2): ``scaling.Served``."""

    def add_node(self) -> None:
        """A node joined: its counts, zero."""
        self.requests_per_node.append(0)
        self.computed_per_node.append(0)

    def served(self, r: Request, node: int, counts: dict[str, int]) -> None:
        """Request ``r`` on ``node`` found ``counts[tier]`` blocks in each tier, in
        ``TIERS`` order (each tier's blocks follow the nearer tiers')."""
        done = 0
        for t in TIERS:
            n = counts.get(t, 0)
            if n:
                self.blocks[t] += n
                self.tokens[t] += r.hit_tokens(done + n) - r.hit_tokens(done)
                done += n
        self.all_blocks += len(r.blocks)
        self.all_tokens += r.input_tokens
        self.requests_per_node[node] += 1
        self.computed_per_node[node] += r.input_tokens - r.hit_tokens(done)
        self.log.append((r.at, node, done, len(r.blocks), counts.get("l2", 0)))

    def finished(self, ttft: float, e2e: float) -> None:
        """One request's time to first token and to its last, seconds."""
        self.ttft.append(ttft)
        self.e2e.append(e2e)

    def as_dict(self) -> dict:
        """The run's figures (rates rounded to 6 places, seconds to 4)."""
        hit_b = sum(self.blocks.values())
        hit_t = sum(self.tokens.values())
        per = self.computed_per_node
        mean = sum(per) / len(per) if per else 0.0
        return {
            "block_hit_rate": round(hit_b / self.all_blocks, 6) if self.all_blocks else 0.0,
            "token_hit_rate": round(hit_t / self.all_tokens, 6) if self.all_tokens else 0.0,
            "tiers_block": {t: round(n / self.all_blocks, 6) if self.all_blocks else 0.0
                            for t, n in self.blocks.items()},
            "tiers_token": {t: round(n / self.all_tokens, 6) if self.all_tokens else 0.0
                            for t, n in self.tokens.items()},
            "prefill_tokens_saved": hit_t,
            "ttft_s": {f"p{q}": round(percentile(self.ttft, q / 100), 4)
                       for q in (50, 90, 99)},
            "e2e_s": {f"p{q}": round(percentile(self.e2e, q / 100), 4) for q in (50, 90, 99)},
            "network_bytes": self.network_bytes,
            "requests_per_node": {"max": max(self.requests_per_node),
                                  "min": min(self.requests_per_node),
                                  "idle_nodes": self.requests_per_node.count(0),
                                  "all": list(self.requests_per_node)},
            "computed_tokens_max_over_mean": round(max(per) / mean, 4) if mean else 0.0,
        }
