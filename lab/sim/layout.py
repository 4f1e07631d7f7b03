"""What one simulated cluster is made of (pure): nodes, engines, tier sizes, placement,
routing."""

from __future__ import annotations

from dataclasses import dataclass

from raykv.cache_actors.node.eviction_order import check_eviction
from raykv.controllers.load_guard import GuardSettings
from raykv.controllers.node_settings import DEFAULTS, PLACEMENTS

ROUTINGS = ("raykv", "pow2", "round_robin")


@dataclass(frozen=True)
class Layout:
    """``nodes`` x ``engines_per_node`` engines, each with a GPU prefix cache of
    ``gpu_blocks`` blocks (0: none, an engine that keeps no prefix on its device) and a
    host tier of its own of ``host_blocks`` (0: none); each node an L2 of ``l2_blocks``
    (0: none, raykv's ``L2Index``), an L3 segment of ``l3_blocks`` (0 on every node:
    no L3) and a disk tier of ``disk_blocks`` (0: none). ``placement``: where L3 puts
    land (``own``, ``any``); ``routing``: ``raykv`` (the router's ranking), ``pow2``
    (power of two choices on queue length) or ``round_robin`` (the ``i``-th request to
    engine ``i`` modulo the engines: a choice a replay on a real cluster makes too);
    ``l2_eviction``: the L2 pools' eviction policy (``node_settings.L2_EVICTIONS``);
    ``load_guard``: the load guard's setting on the hits of L2 and L3 (``auto``, ``off``
    or a threshold in tokens, as ``GuardSettings.parse`` reads it; ``lab.sim.guard``).
    ``seed`` seeds every random choice."""

    nodes: int
    engines_per_node: int
    gpu_blocks: int
    host_blocks: int = 0
    l2_blocks: int = 0
    l3_blocks: int = 0
    placement: str = "own"
    routing: str = "pow2"
    l2_eviction: str = DEFAULTS.l2_eviction
    seed: int = 0
    disk_blocks: int = 0
    load_guard: str = "off"

    def __post_init__(self) -> None:
        for name in ("nodes", "engines_per_node"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"layout: {name} must be an integer >= 1, got {v!r}")
        for name in ("gpu_blocks", "host_blocks", "l2_blocks", "l3_blocks", "seed",
                     "disk_blocks"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ValueError(f"layout: {name} must be an integer >= 0, got {v!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"layout: placement must be one of {PLACEMENTS}, got "
                             f"{self.placement!r}")
        check_eviction(self.l2_eviction)
        GuardSettings.parse(self.load_guard)
        if self.routing not in ROUTINGS:
            raise ValueError(f"layout: routing must be one of {ROUTINGS}, got "
                             f"{self.routing!r}")

    @property
    def engines(self) -> int:
        return self.nodes * self.engines_per_node
