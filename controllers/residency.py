"""Where a chain of pages lives, as one node sees it (pure: no Ray, no Mooncake).

A *residency* answer counts, for the pages of one request's chain (each page
``per_page`` object keys: one per TP rank), how many *leading* pages every object of
which a tier holds: the node's L2 (``cache_actors.node.l2_pools``), the node's own
Mooncake segment, and L3 on any segment. Leading pages are what an engine can load
without recomputing: a page after a gap is worth nothing. The node actor answers it
(``cache_actors.node.residency_query``); a request router ranks nodes by it
(``integrations.serve``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

TIERS = ("l2", "segment", "l3")
"""The tiers a residency answer counts, nearest first."""


@dataclass(frozen=True)
class Residency:
    """Leading pages of ``pages`` asked that ``node_id``'s L2 holds (``l2``), that its
    own segment holds (``segment``, every object of the page there), and that the
    store holds on any segment (``l3``): ``segment <= l3`` always; ``l2`` may exceed
    ``l3`` (the node's L2 writes to L3 behind the writer's back). ``own_segment``: the
    segment's name (None: the node has none it knows, ``segment`` is 0)."""

    node_id: str
    pages: int
    l2: int
    segment: int
    l3: int
    own_segment: str | None = None

    def best(self) -> tuple[int, int, int]:
        """Pages per tier, nearest tier first (``TIERS``' order)."""
        return self.l2, self.segment, self.l3


def check_pages(keys: Sequence[str], per_page: int) -> int:
    """The number of pages of ``keys`` (``per_page`` consecutive keys each);
    ``ValueError`` unless ``per_page`` >= 1 divides ``len(keys)``."""
    if type(per_page) is not int or per_page < 1 or len(keys) % per_page:
        raise ValueError(f"{len(keys)} keys are no whole number of pages of {per_page!r}")
    return len(keys) // per_page


def leading(held: Sequence[bool], per_page: int) -> int:
    """How many leading pages of ``held`` (one flag per key, ``per_page`` keys a page)
    have every key held."""
    n = 0
    for i in range(0, len(held), per_page):
        if not all(held[i:i + per_page]):
            break
        n += 1
    return n


MAX_CHANGES = 16384
"""Changes one ``ResidencyChanges`` answer carries at most (the rest in the next)."""

Change = tuple[str, str, bool]
"""One residency change: ``(tier, key, held)``: object ``key`` came into (``held``) or
left tier ``tier`` (``"l2"`` or ``"segment"``) of one node."""


@dataclass(frozen=True)
class ResidencyChanges:
    """What ``node_id``'s residency log answers a router (``cache_actors.node.
    residency_log``): ``changes`` of the caller's owner, oldest first; ``seq``, the
    number to ask from next, with ``incarnation`` (the log's: a restarted node actor has
    another). ``reset``: the router forgets what it knew of this node first (its
    ``changes`` are then the node's L2 as it is, and the log from ``seq`` on).
    ``load_s``: seconds the node would take now to load one MiB, per tier it has an
    estimate for (``segment``: its own; ``l3``: the store's other segments;
    ``cache_actors.node.load_costs.tier_estimates``)."""

    node_id: str
    incarnation: str
    seq: int
    reset: bool
    changes: list[Change]
    load_s: dict[str, float] = field(default_factory=dict)
