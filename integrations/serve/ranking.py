"""Ranking replicas by where their node holds a request's pages (pure: no Ray).

A replica's *value* for a request is what its node's residency answer is worth: the
best of ``weight_l2 * l2``, ``weight_segment * segment`` and ``weight_l3 * l3`` (pages
in that tier), as a share of the request's pages, less ``weight_load`` per request in
its queue. ``rank`` returns Ray Serve's ranked groups: the best replicas (equal value)
first, then every other one, best first; None when residency tells the candidates
apart in nothing (no node holds more of the request than another) or when a
candidate's node did not answer (a partial view would send every request to the nodes
that answered, a stopped node's share included), so the caller routes as it would
without raykv.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from raykv.controllers.residency import Residency

R = TypeVar("R")
EPSILON = 1e-9


@dataclass(frozen=True)
class Weights:
    """What a page is worth per tier, and what a queued request costs (see the module
    docstring)."""

    l2: float = 1.0
    segment: float = 0.8
    l3: float = 0.5
    load: float = 0.05


def held(answer: Residency | None, w: Weights) -> float:
    """The share of the request's pages ``answer``'s node holds, weighed by tier."""
    if answer is None or answer.pages == 0:
        return 0.0
    return max(w.l2 * answer.l2, w.segment * answer.segment, w.l3 * answer.l3) / answer.pages


def rank(candidates: Sequence[R], node_of: Callable[[R], str],
         answers: Mapping[str, Residency], queue_len: Callable[[R], int | None],
         w: Weights) -> list[list[R]] | None:
    """Ranked groups of ``candidates`` (see the module docstring); ``node_of``: a
    replica's node id, ``answers``: residency per node id, ``queue_len``: a replica's
    known queue (None: unknown, counted 0)."""
    nodes = [node_of(c) for c in candidates]
    if not candidates or any(n not in answers for n in nodes):
        return None
    values = {node: held(a, w) for node, a in answers.items()}
    per_replica = [values[n] for n in nodes]
    if max(per_replica) - min(per_replica) < EPSILON:
        return None
    scored = sorted(((v - w.load * (queue_len(c) or 0), i)
                     for i, (c, v) in enumerate(zip(candidates, per_replica, strict=True))),
                    reverse=True)
    top = scored[0][0]
    first = [candidates[i] for s, i in scored if s >= top - EPSILON]
    rest = [candidates[i] for s, i in scored if s < top - EPSILON]
    return [first, rest] if rest else [first]
