"""Which pages a warm-up reads into a new L2 pool, within its budget (pure: no Ray, no
Mooncake).

A node that opens an L2 pool of a deployment's rank for the first time warms it
(``cache_actors.node.l2_warmup``): it asks its peers for their touch journals' latest
entries of the deployment's keys (``TouchJournal.recent``) and reads the hottest of that
rank's pages from L3 into the pool. This module chooses them.

Runs. A page of a chain is worth something only with every page before it (a lookup
counts leading pages), but a key does not say which chain it belongs to or where in it
(page hashes are opaque). What a journal does show is which objects one store call
touched together: a rank's put or get names its pages in chain order, and the journal
keeps one call's keys in that order, at one touch time. So a warm-up takes *runs*: the
objects a peer's store call touched at one time, in that call's order, the most
recently touched run first (``hottest``'s order); when the budget ends inside a run it
takes that run's leading part, never a later page of a run without the earlier ones. A
run may hold several chains' pages one after the other (a write-behind put carries what
a step committed) or a chain's later pages only (a fill reads what L2 lacked): its
leading part is then still the part a lookup can use first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

from raykv.cache_actors.node.touch_journal import MAX_ANSWER, Touch, hottest
from raykv.controllers.ownership import TENANT_KEYS

ANSWER_SLACK = 2
"""A peer is asked for this many times the entries the budget could use (its journal
holds every rank's keys of the deployment): a run cut off by the answer's end is not
taken (``warm_runs``)."""
MIN_ANSWER = 1024
"""Entries per rank a peer is asked for at least (a small budget still sees whole runs
of a write-behind put, ``write_behind.BATCH`` objects)."""
MAX_PEERS = 16
"""Peers one warm-up asks at most (the deployment's nodes first)."""


def answer_limit(pages: int, ranks: int = 1) -> int:
    """The journal entries a warm-up of ``pages`` pages asks each peer for, for a
    deployment of ``ranks`` ranks (TP x PP): ``ANSWER_SLACK`` x ``pages``, at least
    ``MIN_ANSWER``, per rank; at most ``MAX_ANSWER``."""
    return min(MAX_ANSWER, max(ANSWER_SLACK * pages, MIN_ANSWER) * ranks)


def rank_objects(prefix: str, suffix: str, size: int) -> Callable[[str, Touch], bool]:
    """Whether a journal entry is an object of one rank's L2 pool: its key starts with the
    deployment's key ``prefix`` and ends with the rank's ``suffix`` (``KeyScheme.suffixes``
    of its vLLM blocks), its size is the pool's object ``size``; with no prefix (the
    default deployment), no tenant's key."""
    def wanted(key: str, touch: Touch) -> bool:
        return key.startswith(prefix) and key.endswith(suffix) and touch.size == size and \
            (bool(prefix) or not key.startswith(TENANT_KEYS))
    return wanted


def warm_runs(views: Iterable[Mapping[str, Touch]], wanted: Callable[[str, Touch], bool],
              pages: int, limit: int) -> list[list[str]]:
    """The keys to warm, as runs (module docstring) in the order to read them, at most
    ``pages`` keys in all. ``views``: the peers' journal answers, each most recent first
    (``TouchJournal.recent``, at most ``limit`` entries); only entries ``wanted`` accepts
    count. A view of ``limit`` entries may end inside a run, cut off its leading pages
    (a call's first keys are its oldest): its oldest run is left out."""
    if pages <= 0:
        return []
    place: dict[str, tuple[float, int]] = {}  # key -> its latest touch, place in that view
    kept = []
    for view in views:
        cut = next(reversed(view.values())).last if view and len(view) >= limit else None
        mine = {k: t for k, t in view.items() if wanted(k, t) and t.last != cut}
        for i, (key, touch) in enumerate(mine.items()):
            if key not in place or touch.last > place[key][0]:
                place[key] = (touch.last, i)
        kept.append(mine)
    runs: list[list[str]] = []
    last = None
    for key, touch in hottest(kept):  # one store call's keys share their touch time
        if touch.last != last:
            runs.append([])
            last = touch.last
        runs[-1].append(key)
    chosen = []
    for run in runs:
        run.sort(key=lambda k: -place[k][1])  # the call's order (a view is newest first)
        chosen.append(run[:pages])
        pages -= len(chosen[-1])
        if not pages:
            break
    return chosen


def peers_to_ask(nodes: Iterable[str], prefer: Sequence[str], me: str, most: int) -> list[str]:
    """The nodes a warm-up asks, at most ``most``: those of ``nodes`` (the controller's
    list) but ``me``, the ``prefer``red ones (the deployment's nodes) first, each once."""
    listed = set(nodes)
    return [n for n in dict.fromkeys([*prefer, *sorted(listed)])
            if n in listed and n != me][:most]
