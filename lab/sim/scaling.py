"""A simulated run's scale events and what they did (pure): one node leaving at a
simulated second (with its drain or without), one node joining (with its L2 warm-up or
without), and the hit rate in a window before and after each.

The defaults are the product's: a drain's deadline is ``LifecycleSettings``' drain
timeout, a warm-up reads ``NodeSettings``' ``l2_warm_bytes`` per ``l2_bytes`` of the
joining node's L2 (a quarter) within ``l2_warm_s``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.clusters.node_lifecycle import DRAIN_TIMEOUT_S
from raykv.controllers.node_settings import NodeSettings

_NODE = {f.name: f.default for f in dataclasses.fields(NodeSettings)}
WARM_SHARE = _NODE["l2_warm_bytes"] / _NODE["l2_bytes"]
"""The share of a new L2 a warm-up reads by default (the product's default budgets)."""
WARM_S = _NODE["l2_warm_s"]
"""The longest a warm-up runs by default, seconds (``NodeSettings.l2_warm_s``)."""

Served = tuple[float, int, int, int, int]
"""One request as ``Tally`` logs it: (arrival s, node, leading blocks found in any tier,
blocks, of them from the node's L2)."""


@dataclass(frozen=True)
class Scaling:
    """``remove_at``: the simulated second one node leaves (None: none does):
    ``leaving`` (None: the node whose L3 segment holds the most objects then), with its
    ``drain`` for at most ``drain_deadline_s``; ``add_at``: the second a node joins
    (None: none), its L2 warmed with ``warm_pages`` (None: ``WARM_SHARE`` of its L2; 0:
    no warm-up) within ``warm_s``. ``window_s``: the window before and after each
    event whose hit rates are reported; ``window_at``: a second to report them around
    too (a run without node changes: what the trace does there by itself)."""

    remove_at: float | None = None
    leaving: int | None = None
    drain: bool = True
    drain_deadline_s: float = DRAIN_TIMEOUT_S
    add_at: float | None = None
    warm_pages: int | None = None
    warm_s: float = WARM_S
    window_s: float = 600.0
    window_at: float | None = None

    def __post_init__(self) -> None:
        for name in ("remove_at", "add_at", "window_at"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int | float) and 0 <= v < math.inf):
                raise ValueError(f"scaling: {name} must be seconds >= 0, got {v!r}")
        for name in ("drain_deadline_s", "warm_s", "window_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and v > 0 and not math.isnan(v)):
                raise ValueError(f"scaling: {name} must be seconds > 0, got {v!r}")
        for name in ("leaving", "warm_pages"):
            v = getattr(self, name)
            if v is not None and (type(v) is not int or v < 0):
                raise ValueError(f"scaling: {name} must be an integer >= 0, got {v!r}")

    def warm_budget(self, l2_blocks: int) -> int:
        """Pages a joining node's warm-up reads at most into an L2 of ``l2_blocks``."""
        return self.warm_pages if self.warm_pages is not None else \
            int(WARM_SHARE * l2_blocks)


def window(log: Sequence[Served], start: float, end: float,
           node: int | None = None) -> dict:
    """The requests that arrived in [``start``, ``end``) (on ``node`` only, if given):
    how many, their blocks, the leading blocks found in any tier and in L2, and the
    block hit rate."""
    rows = [s for s in log if start <= s[0] < end and (node is None or s[1] == node)]
    blocks = sum(s[3] for s in rows)
    hits = sum(s[2] for s in rows)
    return {"requests": len(rows), "blocks": blocks, "hit_blocks": hits,
            "l2_blocks": sum(s[4] for s in rows),
            "hit_rate": round(hits / blocks, 6) if blocks else 0.0}


def around(log: Sequence[Served], at: float, window_s: float,
           node: int | None = None) -> dict:
    """``window`` before ``at`` and after it, after over before, and the ``timeline``:
    the block hit rate of each window from the one before ``at`` to the log's end."""
    before = window(log, at - window_s, at, node)
    after = window(log, at, at + window_s, node)
    ratio = round(after["hit_rate"] / before["hit_rate"], 4) if before["hit_rate"] else 0.0
    end = max((s[0] for s in log), default=at)
    starts = [at + k * window_s for k in range(-1, int((end - at) // window_s) + 1)]
    return {"window_s": window_s, "before": before, "after": after,
            "after_vs_before": ratio,
            "timeline": [[t, window(log, t, t + window_s, node)["hit_rate"]]
                         for t in starts]}
