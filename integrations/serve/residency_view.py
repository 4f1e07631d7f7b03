"""A router's view of where pages live, kept from the node actors' residency logs
(pure: no Ray; the clock is passed in).

Choosing a replica must not wait for a Ray call (on a busy host one to a node actor
costs milliseconds at the median and ten at the 99th percentile), so a router keeps,
per node it routes to, the keys the node said were ready in its L2 and the keys it put
on its own segment, and learns what changed by asking each node's residency log in the
background (``RayKVRouter``; ``cache_actors.node.residency_log``). A request's
residency is then read from the view (``answer``) in microseconds.

What the view may get wrong, and what that costs: it lags the nodes by up to one
refresh (a block stored since is not seen yet: the request is routed as if it were
not there); a key Mooncake evicted or expired from a segment is still counted (the
logs cannot see it) until the view forgets it (``SEGMENT_KEYS`` per node, least
recently told first). Either costs a hit, never bytes: the router never decides a
load, each engine's connector looks up what it loads. A node not heard from for
``stale_s`` (its actor stopped, dead or slow) counts as not answering: ``answer`` is
None for it, and ``ranking.rank`` then routes the request as if raykv were not there.

Each answer also carries the node's load estimates (``load_s``: seconds to load a MiB
from its own segment and from the others), kept as last told for ``ranking``'s credit.

Bounds: at most ``L2_KEYS`` and ``SEGMENT_KEYS`` keys per node (least recently told
dropped first), and the estimates of ``CREDITED`` tiers only, whatever a node sends.

Threads: one (the router's event loop); nothing here blocks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from raykv.controllers.residency import Residency, ResidencyChanges, leading

L2_KEYS = 1 << 20
"""Keys of one node's L2 a view keeps at most (more than an L2 of 64 GiB holds in
pages of 64 KiB)."""
SEGMENT_KEYS = 1 << 18
"""Keys of one node's own segment a view keeps at most."""
CREDITED = ("segment", "l3")
"""The tiers whose load estimates a view keeps (anything else a node sends is dropped)."""


@dataclass
class _Node:
    since: tuple[str, int] | None = None
    heard: float = float("-inf")
    l2: OrderedDict[str, None] = field(default_factory=OrderedDict)
    segment: OrderedDict[str, None] = field(default_factory=OrderedDict)
    load_s: dict[str, float] = field(default_factory=dict)


class ResidencyView:
    """What this router knows of the nodes it watches (see the module docstring).
    ``stale_s``: a node not heard from for longer counts as not answering; ``clock``:
    seconds (``time.monotonic``). Counters in ``counts``."""

    def __init__(self, stale_s: float, clock: Callable[[], float]) -> None:
        if not stale_s > 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s!r}")
        self.stale_s, self._clock = stale_s, clock
        self._nodes: dict[str, _Node] = {}
        self._l3: dict[str, int] = {}  # key -> nodes whose segment view holds it
        self.counts = {"changes": 0, "resets": 0}

    @property
    def nodes(self) -> list[str]:
        """The nodes watched."""
        return list(self._nodes)

    def watch(self, node_ids: Iterable[str]) -> None:
        """Watch exactly ``node_ids`` (those of the replicas now): new ones start
        unknown, the others are forgotten."""
        wanted = set(node_ids)
        for node in set(self._nodes) - wanted:
            self._clear(self._nodes.pop(node))
        for node in wanted - set(self._nodes):
            self._nodes[node] = _Node()

    def since(self, node_id: str) -> tuple[str, int] | None:
        """What to ask ``node_id``'s log from (None: from the start)."""
        node = self._nodes.get(node_id)
        return None if node is None else node.since

    def apply(self, answer: ResidencyChanges) -> None:
        """Take a node's answer in (an answer of a node not watched is dropped)."""
        node = self._nodes.get(answer.node_id)
        if node is None:
            return
        if answer.reset or node.since is None or node.since[0] != answer.incarnation:
            self._clear(node)
            self.counts["resets"] += 1
        for tier, key, held in answer.changes:
            if tier == "l2":
                _tell(node.l2, key, held, L2_KEYS)
            elif tier == "segment" and held:
                if key not in node.segment:
                    self._l3[key] = self._l3.get(key, 0) + 1
                _tell(node.segment, key, True, SEGMENT_KEYS, self._unheld)
        self.counts["changes"] += len(answer.changes)
        node.load_s = {t: float(v) for t, v in answer.load_s.items()
                       if t in CREDITED and isinstance(v, int | float) and 0 <= v < math.inf}
        node.since = (answer.incarnation, answer.seq)
        node.heard = self._clock()

    def fresh(self, node_id: str) -> bool:
        """Whether ``node_id`` was heard from within ``stale_s``."""
        node = self._nodes.get(node_id)
        return node is not None and self._clock() - node.heard <= self.stale_s

    def load_s(self, node_id: str) -> dict[str, float]:
        """``node_id``'s last told seconds to load one MiB per tier (``segment``,
        ``l3``; ``ResidencyChanges.load_s``); empty for a node not watched or not told."""
        node = self._nodes.get(node_id)
        return {} if node is None else dict(node.load_s)

    def answer(self, node_id: str, keys: list[str], per_page: int) -> Residency | None:
        """``keys``' residency (``per_page`` keys a page) on ``node_id`` as this view
        has it; None for a node not watched or not fresh. ``l3``: pages every key of
        which some watched node put on its own segment."""
        if not self.fresh(node_id):
            return None
        node = self._nodes[node_id]
        l2, seg, l3 = node.l2, node.segment, self._l3
        return Residency(node_id, len(keys) // per_page,
                         leading([k in l2 for k in keys], per_page),
                         leading([k in seg for k in keys], per_page),
                         leading([k in l3 for k in keys], per_page))

    # ---------------------------------------------------------------- helpers
    def _clear(self, node: _Node) -> None:
        for key in node.segment:
            self._unheld(key)
        node.l2.clear()
        node.segment.clear()

    def _unheld(self, key: str) -> None:
        """One node's segment view dropped ``key``."""
        n = self._l3.get(key, 0) - 1
        if n > 0:
            self._l3[key] = n
        else:
            self._l3.pop(key, None)


def _tell(keys: OrderedDict[str, None], key: str, held: bool, bound: int,
          dropped: Callable[[str], None] | None = None) -> None:
    """``key`` came into (``held``) or left ``keys``, which keeps at most ``bound``
    (the least recently told dropped first, each told to ``dropped``)."""
    if not held:
        keys.pop(key, None)
        return
    keys[key] = None
    keys.move_to_end(key)
    while len(keys) > bound:
        old, _ = keys.popitem(last=False)
        if dropped is not None:
            dropped(old)
