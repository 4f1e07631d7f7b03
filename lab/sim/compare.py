"""The comparisons of one ``raykv sim`` run (pure): the same trace and the same memory
per node through each way of caching, and the untimed references.

Timed runs (``cluster.ClusterSim``), each with the GPU prefix cache of every engine:

- ``gpu_only``: nothing else (stock vLLM), power of two routing;
- ``local_host``: a host tier per engine of the node's host memory shared out
  (``(l2 + l3) / engines``: vLLM's own CPU offload, LMCache without a remote store),
  power of two;
- ``pooled``: one store of the node's host memory per node as its segment, no L2, random
  placement, power of two (Mooncake's store alone);
- ``raykv``: L2 and L3 per node as given, raykv's placement, routing and load guard;
- ``raykv_pow2``: the same tiers and guard with power of two routing (what routing
  adds).

With ``disk_tokens``, ``pooled`` and both raykv runs have a disk tier of that size per
node (Mooncake's SSD offload under each segment); with a ``Scaling``, every timed run
has its node changes.

Untimed references (``bounds``): one global LRU and Belady's eviction over the whole
cluster's cache memory (GPU caches, L2 and L3 together: a bound on every run), the same
two over its host memory alone (L2 and L3: ``global_lru_host``, ``belady_host``, what
host-tier eviction could reach without the GPU caches), and unbounded.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.controllers.load_guard import GuardSettings
from raykv.controllers.node_settings import DEFAULTS
from raykv_lab.sim import bounds
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.layout import Layout
from raykv_lab.sim.scaling import Scaling
from raykv_lab.sim.trace import BLOCK_TOKENS, Request

RUNS = ("gpu_only", "local_host", "pooled", "raykv", "raykv_pow2")
BOUNDS = ("global_lru", "belady", "global_lru_host", "belady_host", "unbounded")


@dataclass(frozen=True)
class Setup:
    """One comparison: ``nodes`` x ``engines_per_node``; tokens of KV per engine's GPU
    prefix cache (``gpu_tokens``) and per node in L2 and L3 (``l2_tokens``,
    ``l3_tokens``: the node's host memory for caching is their sum); raykv's
    ``placement`` and L2 eviction policy (``l2_eviction``); ``seed``; ``disk_tokens``:
    each node's disk tier (0: none); ``load_guard``: raykv's load guard (``Layout``;
    default the product's, ``auto``)."""

    nodes: int = 16
    engines_per_node: int = 8
    gpu_tokens: int = 256_000
    l2_tokens: int = 1_000_000
    l3_tokens: int = 2_000_000
    placement: str = "own"
    seed: int = 0
    disk_tokens: int = 0
    l2_eviction: str = DEFAULTS.l2_eviction
    load_guard: str = GuardSettings().describe()

    def __post_init__(self) -> None:
        for name in ("gpu_tokens", "l2_tokens", "l3_tokens"):
            if getattr(self, name) < BLOCK_TOKENS:
                raise ValueError(f"{name} must be at least one block ({BLOCK_TOKENS} "
                                 f"tokens), got {getattr(self, name)}")

    def layouts(self) -> dict[str, Layout]:
        """Each timed run's layout (see the module docstring)."""
        b = BLOCK_TOKENS
        base = Layout(self.nodes, self.engines_per_node, self.gpu_tokens // b,
                      seed=self.seed)
        host = (self.l2_tokens + self.l3_tokens) // b
        disk = self.disk_tokens // b
        raykv = dataclasses.replace(base, l2_blocks=self.l2_tokens // b, disk_blocks=disk,
                                    l3_blocks=self.l3_tokens // b, placement=self.placement,
                                    routing="raykv", l2_eviction=self.l2_eviction,
                                    load_guard=self.load_guard)
        return {
            "gpu_only": base,
            "local_host": dataclasses.replace(
                base, host_blocks=max(1, host // self.engines_per_node)),
            "pooled": dataclasses.replace(base, l3_blocks=host, placement="any",
                                          disk_blocks=disk),
            "raykv": raykv,
            "raykv_pow2": dataclasses.replace(raykv, routing="pow2"),
        }

    def host_blocks(self) -> int:
        """Blocks of the cluster's host memory for caching: every node's L2 and L3."""
        return self.nodes * (self.l2_tokens // BLOCK_TOKENS + self.l3_tokens // BLOCK_TOKENS)

    def total_blocks(self) -> int:
        """Blocks of the whole cluster's cache memory: every GPU cache, L2 and L3."""
        return self.host_blocks() + \
            self.nodes * self.engines_per_node * (self.gpu_tokens // BLOCK_TOKENS)


def compare(requests: Sequence[Request], setup: Setup, costs: Costs,
            runs: Sequence[str] = RUNS, scaling: Scaling | None = None) -> dict:
    """Each of ``runs`` (timed, with ``scaling``'s node changes if given) and every
    reference on ``requests``: their figures (``Tally.as_dict``, the tiers' own
    counters, the simulator's seconds), the references' hit rates, and raykv's ratios
    when it ran."""
    bad = [r for r in runs if r not in RUNS]
    if bad or not runs:
        raise ValueError(f"runs must be some of {RUNS}, got {list(runs)}")
    layouts = setup.layouts()
    out: dict = {"setup": dataclasses.asdict(setup), "costs": dataclasses.asdict(costs),
                 "requests": len(requests), "runs": {}, "bounds": {}}
    if scaling is not None:
        out["scaling"] = dataclasses.asdict(scaling)
    for name in runs:
        t = time.perf_counter()
        sim = ClusterSim(layouts[name], costs, requests, scaling)
        figures = sim.run().as_dict()
        figures["counters"] = sim.stats()
        figures["simulator_s"] = round(time.perf_counter() - t, 3)
        out["runs"][name] = figures
    cap, host = setup.total_blocks(), setup.host_blocks()
    out["bounds"] = {"capacity_blocks": cap, "host_blocks": host,
                     "global_lru": bounds.global_lru(requests, cap).as_dict(),
                     "belady": bounds.belady(requests, cap).as_dict(),
                     "global_lru_host": bounds.global_lru(requests, host).as_dict(),
                     "belady_host": bounds.belady(requests, host).as_dict(),
                     "unbounded": bounds.unbounded(requests).as_dict()}
    if "raykv" in out["runs"]:
        out["ratios"] = ratios(out)
    return out


def ratios(result: dict) -> dict[str, float]:
    """raykv's block hit rate over each other run's and each reference's."""
    mine = result["runs"]["raykv"]["block_hit_rate"]
    others = {n: r["block_hit_rate"] for n, r in result["runs"].items() if n != "raykv"}
    others |= {n: result["bounds"][n]["block_hit_rate"] for n in BOUNDS}
    return {f"raykv_over_{n}": round(mine / v, 4) if v else 0.0 for n, v in others.items()}
