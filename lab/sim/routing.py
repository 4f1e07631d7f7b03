"""Which engine a request goes to (pure): raykv's router (``integrations.serve``:
``rank`` on residency, ``spread`` for a prefix no tier tells apart, its engine tier
``RoutedKeys`` and ``RecentRoutes``), power of two choices on queue length, or round
robin."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from raykv.controllers.residency import Residency
from raykv.integrations.serve.ranking import Weights, rank, spread
from raykv.integrations.serve.route_keys import RouteOptions
from raykv.integrations.serve.sent_keys import SPREAD_WINDOW, RecentRoutes, RoutedKeys

ENGINE_BLOCKS = next(f.default for f in dataclasses.fields(RouteOptions)
                     if f.name == "engine_blocks")
"""The router's engine tier per replica: ``RouteOptions.engine_blocks``' default."""


class PowerOfTwo:
    """Two engines drawn at random, the one with the shorter queue (the first on a tie)."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng

    def choose(self, engines: Sequence[int], keys: Sequence[str],
               answers: Callable[[], dict[str, Residency]],
               queue_len: Callable[[int], int], node_of: Callable[[int], str]) -> int:
        if len(engines) == 1:
            return engines[0]
        a, b = self._rng.sample(engines, 2)
        return b if queue_len(b) < queue_len(a) else a


class RoundRobin:
    """The engines in turn, one request each, whatever their queues (a replay on a real
    cluster can make the same choices)."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, engines: Sequence[int], keys: Sequence[str],
               answers: Callable[[], dict[str, Residency]],
               queue_len: Callable[[int], int], node_of: Callable[[int], str]) -> int:
        chosen = engines[self._next % len(engines)]
        self._next += 1
        return chosen


class RayKVRouting:
    """``RayKVRouter``'s choice, as its ``choose_replicas`` ranks (``ranking``), then one
    engine of the first group at random (Ray Serve picks within a group)."""

    def __init__(self, rng: random.Random, weights: Weights | None = None,
                 engine_blocks: int = ENGINE_BLOCKS) -> None:
        self._rng = rng
        self.weights = weights or Weights()
        self.routed = RoutedKeys(engine_blocks)
        self.recent = RecentRoutes(SPREAD_WINDOW)
        self.counts = {"routed": 0, "spread": 0}

    def choose(self, engines: Sequence[int], keys: Sequence[str],
               answers: Callable[[], dict[str, Residency]],
               queue_len: Callable[[int], int], node_of: Callable[[int], str]) -> int:
        ranked = rank(engines, node_of, answers(), queue_len, self.weights,
                      lambda e: self.routed.pages(e, keys, 1))
        if ranked is None:
            self.counts["spread"] += 1
            ranked = spread(engines, self.recent.count, queue_len)
        else:
            self.counts["routed"] += 1
        chosen = self._rng.choice(ranked[0])
        self.routed.routed(chosen, keys)
        self.recent.routed(chosen)
        return chosen
