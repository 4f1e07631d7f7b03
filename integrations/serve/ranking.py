"""Ranking replicas by what they and their nodes hold of a request's pages (pure: no Ray).

A replica's *value* for a request is what it holds of it: the best of ``weight_engine``
times the leading pages the router itself sent to the replica lately (its stand-in for
the engine's own prefix cache: ``sent_keys``), and ``weight_l2``, ``weight_segment``,
``weight_l3`` times the pages its node holds in that tier, as a share of the request's
pages, less ``weight_load`` per request in its queue. A replica whose queue is longer
than the shortest known one by more than ``max_queue_gap`` requests is not in the first
group while a replica within the gap can get as many of the request's pages from some
tier: a hot prefix spreads over more replicas, which load it, instead of queueing on
the one that holds it (loading costs less than waiting); a prefix that only the queued
replica has (the engine tier: being computed there, not saved yet) stays with it, as
computing it a second time elsewhere costs more than the wait.
``rank`` returns Ray Serve's ranked groups: the best replicas (equal value) first, then
every other one, best first; None when residency tells the candidates apart in nothing
(no replica holds more of the request than another) or when a candidate's node did not
answer (a partial view would send every request to the nodes that answered, a stopped
node's share included), so the caller routes as it would without raykv.
With a ``Credit`` (the router knows a page's bytes and the engines' prefill speed), a
tier's pages count only for the share of their prefill time a load from that node
would save (``Credit.worth``, the load guard's objective: a page the guard would
recompute is worth nothing), from the node's own load estimates: a replica whose node
would load slowly ranks as if it held less.
``spread`` ranks candidates for a request residency tells nothing about: the replicas
queued shortest and, among those, sent the fewest requests lately first, so new
prefixes, which the requests after them follow, are spread evenly without waiting
behind a busy replica.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from raykv.controllers.load_guard import DEFAULT_MARGIN
from raykv.controllers.pool_layout import MiB
from raykv.controllers.residency import TIERS, Residency

R = TypeVar("R")
EPSILON = 1e-9


@dataclass(frozen=True)
class Weights:
    """What a page is worth per tier, what a queued request costs, and the queue gap
    that keeps a replica out of the first group (see the module docstring)."""

    engine: float = 1.05
    l2: float = 1.0
    segment: float = 0.8
    l3: float = 0.5
    load: float = 0.1
    max_queue_gap: int = 2


@dataclass(frozen=True)
class Credit:
    """What loading a page costs against computing it: ``page_bytes`` one rank loads
    per page, ``prefill_page_s`` the seconds an engine computes a page in, ``margin``
    the load guard's (``controllers.load_guard``)."""

    page_bytes: int
    prefill_page_s: float
    margin: float = DEFAULT_MARGIN

    def worth(self, load_s: Mapping[str, float]) -> dict[str, float]:
        """Per tier of ``load_s`` (a node's seconds to load one MiB from it), the share
        of a page's prefill time a load from there saves: ``1 - margin * load /
        prefill``, within [0, 1]. A tier without an estimate gets no entry (worth 1)."""
        return {tier: min(1.0, max(0.0, 1.0 - self.margin * s * self.page_bytes / MiB
                                   / self.prefill_page_s))
                for tier, s in load_s.items()}


def held(answer: Residency | None, w: Weights, engine: int = 0,
         worth: Mapping[str, float] | None = None) -> float:
    """The share of the request's pages a replica holds, weighed by tier: ``engine``
    pages routed to it, the rest as ``answer`` (its node's residency) says, each
    tier's pages times its ``worth`` (``Credit.worth``; a tier not in it: 1)."""
    if answer is None or answer.pages == 0:
        return 0.0
    f = worth or {}
    return max(w.engine * engine, w.l2 * answer.l2 * f.get("l2", 1.0),
               w.segment * answer.segment * f.get("segment", 1.0),
               w.l3 * answer.l3 * f.get("l3", 1.0)) / answer.pages


def rank(candidates: Sequence[R], node_of: Callable[[R], str],
         answers: Mapping[str, Residency], queue_len: Callable[[R], int | None],
         w: Weights, engine: Callable[[R], int] = lambda c: 0,
         worth: Mapping[str, Mapping[str, float]] | None = None) -> list[list[R]] | None:
    """Ranked groups of ``candidates`` (see the module docstring); ``node_of``: a
    replica's node id, ``answers``: residency per node id, ``queue_len``: a replica's
    known queue (None: unknown, counted 0), ``engine``: the request's leading pages
    routed to a replica lately, ``worth``: per node id its tiers' worth
    (``Credit.worth``; None or a node not in it: no credit)."""
    nodes = [node_of(c) for c in candidates]
    if not candidates or any(n not in answers for n in nodes):
        return None
    worths = [(worth or {}).get(n, {}) for n in nodes]
    routed = [engine(c) for c in candidates]
    per_replica = [held(answers[n], w, e, f)
                   for n, e, f in zip(nodes, routed, worths, strict=True)]
    if max(per_replica) - min(per_replica) < EPSILON:
        return None
    queues = [queue_len(c) or 0 for c in candidates]
    shortest = min(queues)
    within = [q <= shortest + w.max_queue_gap for q in queues]
    pages = [max(e, *(p for t, p in zip(TIERS, answers[n].best(), strict=True)
                      if f.get(t, 1.0) > 0))
             for n, e, f in zip(nodes, routed, worths, strict=True)]
    loadable = max(p for p, ok in zip(pages, within, strict=True) if ok)
    scored = sorted(((v - w.load * q, ok or p > loadable, i) for i, (v, q, ok, p)
                     in enumerate(zip(per_replica, queues, within, pages, strict=True))),
                    key=lambda s: s[0], reverse=True)
    top = max(s for s, eligible, _ in scored if eligible)
    first = [candidates[i] for s, eligible, i in scored if eligible and s >= top - EPSILON]
    rest = [candidates[i] for s, eligible, i in scored
            if not eligible or s < top - EPSILON]
    return [first, rest] if rest else [first]


def spread(candidates: Sequence[R], sent: Callable[[R], int],
           queue_len: Callable[[R], int | None]) -> list[list[R]]:
    """``candidates`` by queue (``queue_len``: None counted 0), then by requests sent
    lately (``sent``): the replicas shortest queued and, among those, sent the fewest
    first, then the others in that order."""
    key = {id(c): (queue_len(c) or 0, sent(c)) for c in candidates}
    order = sorted(candidates, key=lambda c: key[id(c)])
    best = key[id(order[0])]
    first = [c for c in order if key[id(c)] == best]
    rest = order[len(first):]
    return [first, rest] if rest else [first]
