"""Why a request's blocks are held or missed: the pure part of ``raykv why`` (no Ray, no
Mooncake).

``raykv why`` (``clusters.why``) names each full block of a prompt by its object keys
(``per_page`` keys a page: every rank's and pool's object), asks every node actor what
it knows of them (``NodeFacts``: its L2, its record of recent L2 evictions, its touch
journal, and from one node the store) and asks the same of the page hashes under the
other deployments it may name (``OtherHolding``). ``explain`` turns those answers into
one ``BlockWhy`` per block:

- held: the tiers holding every object of the block (``l2`` on which nodes, ``l3`` on
  which segments, ``l3_disk`` when the store holds it on no memory segment); a held block
  after a missing one is not loadable (``AFTER_GAP``): engines load leading blocks only;
  one held in the store only that a node's L2 evicted lately says so (``EVICTED_L2``:
  why it is no L2 hit).
- missing, with every reason that applies, the surest first: ``EVICTED_L2`` (a node's
  L2 evicted an object of it lately: when, and which node), ``EVICTED_L3`` (a node
  stored or read an object of it in the store, which no longer holds it),
  ``OTHER_IDENTITY`` (the same tokens are held under another deployment: which one, and
  the identity fields that differ), else ``NEVER_SAVED`` (no record of it anywhere this
  caller may look: records are bounded, so an eviction long ago reads as never saved).

``guard_view`` applies the load guard (``controllers.load_guard.choose_load``) to the
leading held blocks as an engine would, with the node's estimates when the group answer
carries them (``load_runs``) and none otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from raykv.controllers.load_guard import GuardSettings, LoadChoice, LoadRun, choose_load

NEVER_SAVED = "never_saved"
EVICTED_L2 = "evicted_l2"
EVICTED_L3 = "evicted_l3"
OTHER_IDENTITY = "other_identity"
AFTER_GAP = "after_gap"
SKIPPED_BY_GUARD = "skipped_by_guard"
TIER_ORDER = ("l2", "l3", "l3_disk")
"""Tiers a block can be held in, nearest first (``controllers.load_guard``'s names)."""


@dataclass(frozen=True)
class NodeFacts:
    """What one node knows of a list of keys: per key, whether it is ready in the node's
    L2 (pools of the caller's owner: ``l2``); when its L2 last evicted it
    (``evicted``: key -> wall-clock seconds; kept keys only); when it last stored or
    read it in the store (``touched``: key -> wall-clock seconds); and, from the node
    asked for the store, per key the memory segments holding a complete replica
    (``segments``; None: not asked, or a client that cannot locate) and whether the
    store holds it at all (``stored``, memory or disk; None: not asked)."""

    node_id: str
    l2: list[bool]
    evicted: dict[str, float] = field(default_factory=dict)
    touched: dict[str, float] = field(default_factory=dict)
    segments: list[list[str]] | None = None
    stored: list[bool] | None = None


@dataclass(frozen=True)
class OtherHolding:
    """Another deployment (``deployment_id``) whose identity differs from the asked one
    in ``differences`` (``Identity.differences``, theirs in parentheses), and per
    block of the asked prompt whether it holds every token of it (``covered``)."""

    deployment_id: str
    differences: list[str]
    covered: list[bool]


@dataclass
class BlockWhy:
    """One block: ``index`` in the prompt, its ``page_hash``; ``held``: tier -> where
    (node ids for ``l2``, segments for ``l3``, empty for ``l3_disk``); ``reasons``:
    ``(reason, detail)`` pairs, surest first, of why it is not served at all or (held
    in the store only, ``EVICTED_L2``) not from L2 (empty: held in L2 and loadable)."""

    index: int
    page_hash: str
    held: dict[str, list[str]] = field(default_factory=dict)
    reasons: list[tuple[str, str]] = field(default_factory=list)

    @property
    def nearest(self) -> str | None:
        """The nearest tier holding the block (None: missing)."""
        return next((t for t in TIER_ORDER if t in self.held), None)


def pages_of(keys: Sequence, per_page: int) -> list[Sequence]:
    """``keys`` (or per-key facts) cut into pages of ``per_page``."""
    return [keys[i:i + per_page] for i in range(0, len(keys), per_page)]


def covered(page_tokens: int, blocks: int, their_tokens: int,
            their_held: Sequence[bool]) -> list[bool]:
    """Per block of ``page_tokens`` tokens (``blocks`` of them), whether another
    deployment's held blocks of ``their_tokens`` tokens (``their_held``, in prompt
    order) hold every token of it: each of their blocks overlapping it is held."""
    out = []
    for i in range(blocks):
        start, end = i * page_tokens, (i + 1) * page_tokens
        first, last = start // their_tokens, (end - 1) // their_tokens
        out.append(last < len(their_held) and all(their_held[first:last + 1]))
    return out


def held_blocks(facts: Sequence[NodeFacts], per_page: int) -> list[bool]:
    """Per page, whether some tier holds every object of it (any node's L2, or the
    store)."""
    return [bool(where) for where in _held(facts, per_page, len(facts[0].l2) // per_page
                                           if facts else 0)]


def _held(facts: Sequence[NodeFacts], per_page: int, n: int) -> list[dict[str, list[str]]]:
    """Per page of ``n``, the tiers holding every object of it, and where."""
    out: list[dict[str, list[str]]] = [{} for _ in range(n)]
    for f in facts:
        for i, flags in enumerate(pages_of(f.l2, per_page)):
            if all(flags):
                out[i].setdefault("l2", []).append(f.node_id)
        if f.stored is not None:
            for i, flags in enumerate(pages_of(f.stored, per_page)):
                if not all(flags):
                    continue
                if f.segments is None:  # the store holds it; where, this node cannot say
                    out[i]["l3"] = []
                    continue
                segs = pages_of(f.segments, per_page)[i]
                if all(segs):  # every object on some memory segment
                    out[i]["l3"] = sorted(set().union(*map(set, segs)))
                else:
                    out[i]["l3_disk"] = []
    return out


def explain(hashes: Sequence[str], keys: Sequence[str], per_page: int,
            facts: Sequence[NodeFacts], others: Sequence[OtherHolding],
            now: float) -> list[BlockWhy]:
    """One ``BlockWhy`` per page hash of ``hashes`` (see the module docstring):
    ``keys``, ``per_page`` a page in that order, as ``facts`` answered them; ``now``:
    wall-clock seconds, to say how long ago a record was made."""
    out = []
    gap = None
    for i, where in enumerate(_held(facts, per_page, len(hashes))):
        block = BlockWhy(i, hashes[i], where)
        page = keys[i * per_page:(i + 1) * per_page]
        if "l2" not in where:
            for f in facts:
                when = [f.evicted[k] for k in page if k in f.evicted]
                if when:
                    block.reasons.append((EVICTED_L2,
                                          f"node {f.node_id[:12]}, {_ago(now, when)}"))
        if where:
            if gap is not None:
                block.reasons.append((AFTER_GAP, f"block {gap} before it is missing"))
            out.append(block)
            continue
        gap = i if gap is None else gap
        for f in facts:
            when = [f.touched[k] for k in page if k in f.touched]
            if when:
                block.reasons.append((EVICTED_L3, f"node {f.node_id[:12]} stored, read or served "
                                                  f"it {_ago(now, when)}"))
        for o in others:
            if o.covered[i]:
                block.reasons.append((OTHER_IDENTITY, f"held by deployment "
                                                      f"{o.deployment_id!r}: "
                                                      + ", ".join(o.differences)))
        if not block.reasons:
            block.reasons.append((NEVER_SAVED, "no node and no other deployment this "
                                               "caller may ask has a record of it"))
        out.append(block)
    return out


def load_runs(blocks: Sequence[BlockWhy], node_id: str | None) -> list[LoadRun]:
    """The leading held blocks as an engine on ``node_id`` loads them, as runs of one
    tier each without an estimate: ``l2`` where that node's L2 holds it, else the
    store's tier (another node's L2 is not this engine's)."""
    runs: list[LoadRun] = []
    for b in blocks:
        tiers = [t for t in TIER_ORDER if t in b.held and
                 (t != "l2" or node_id in b.held["l2"])]
        if not tiers:
            break
        if runs and runs[-1].tier == tiers[0]:
            runs[-1] = LoadRun(tiers[0], runs[-1].pages + 1)
        else:
            runs.append(LoadRun(tiers[0], 1))
    return runs


def guard_view(blocks: list[BlockWhy], runs: Sequence[LoadRun], page_tokens: int,
               prefill_tokens_per_s: float, settings: GuardSettings) -> LoadChoice:
    """The load guard's choice for ``runs`` (the group answer's ``load_runs``, else
    ``load_runs``) at ``prefill_tokens_per_s``; each skipped block of ``blocks`` gets
    a ``SKIPPED_BY_GUARD`` reason with both estimates ("no estimate" where unknown)."""
    choice = choose_load(runs, page_tokens, 1.0 / prefill_tokens_per_s, settings)
    total = sum(r.pages for r in runs)
    if choice.pages < total:
        detail = (f"{choice.reason}: load {_secs(choice.load_s)} vs prefill "
                  f"{_secs(choice.prefill_s)} for the {total} leading held block(s); "
                  f"guard {settings.describe()}")
        for b in blocks[choice.pages:total]:
            b.reasons.append((SKIPPED_BY_GUARD, detail))
    return choice


def _secs(s: float | None) -> str:
    return "no estimate" if s is None else f"{s * 1e3:.3f} ms"


def _ago(now: float, when: Sequence[float]) -> str:
    return f"{max(0.0, now - max(when)):.1f} s ago"
