"""The load guard in SGLang's backend (pure: no SGLang, no Ray import): how much of a
group answer ``batch_exists`` / ``batch_exists_v2`` report as the hit SGLang loads.

SGLang reduces each TP rank's hit with a MIN all-reduce (and intersects the ranks'
``restorable_prefix_pages``) before it loads, and its storage backend never sees the
scheduler's forward passes. So the guard decides only from values every rank of an
engine holds alike: the group answer's ``load_runs`` (the node shares one answer among
an engine's ranks) and the prefill rate the operator sets (``prefill_tokens_per_s``).
A rank-local measurement would differ between ranks, and the MIN would let the rank
with the slowest estimate decide for all.

Without ``load_runs`` (a node that gives no estimates) the hit is one run of unknown
cost: ``auto`` loads it; without ``prefill_tokens_per_s`` ``auto`` loads every hit. A
fixed threshold needs neither. The cut is then lowered to a prefix every pool can
restore (``restorable_prefix_pages``, where the answer has them).

SGLang asks in batches of at most 128 pages and asks the next batch only after a full
hit, so each batch is weighed on its own.

Threads: SGLang's storage threads call ``guard``; the counts are a ``Counter`` (one
increment per key, atomic under the GIL).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.load_guard import GuardSettings, LoadChoice, LoadRun, choose_load
from raykv.integrations.token_metrics import count_lookup


def hit_runs(hit: PoolTransferResult) -> list[LoadRun]:
    """The hit's runs: the answer's ``load_runs`` where they cover exactly its
    ``kv_hit_pages``, else one ``l3`` run of unknown cost (none for a miss)."""
    runs = [LoadRun(tier, pages, seconds) for tier, pages, seconds in hit.load_runs]
    if sum(r.pages for r in runs) == hit.kv_hit_pages and all(r.pages > 0 for r in runs):
        return runs
    return [LoadRun("l3", hit.kv_hit_pages)] if hit.kv_hit_pages else []


def restorable_cut(pages: int, restorable: Sequence[int]) -> int:
    """The longest prefix of at most ``pages`` pages in ``restorable`` (every prefix
    when ``restorable`` is empty: a KV-only answer)."""
    if not restorable:
        return pages
    return max((p for p in restorable if p <= pages), default=0)


@dataclass
class HitGuard:
    """``settings`` and the operator's prefill estimate ``prefill_s_per_token`` (None:
    none); ``page_tokens`` is set once SGLang registers its KV host pool."""

    settings: GuardSettings
    prefill_s_per_token: float | None = None
    page_tokens: int = 0

    def guard(self, hit: PoolTransferResult, asked_pages: int,
              counts: Counter[str] | None = None) -> tuple[int, LoadChoice]:
        """The pages of ``hit`` SGLang should load (a restorable prefix) and the choice
        made; counted into ``counts`` (``token_metrics.count_lookup``: ``asked_pages``
        asked, the hit by tier, the decision) unless None."""
        runs = hit_runs(hit)
        page_tokens = max(self.page_tokens, 1)
        choice = choose_load(runs, page_tokens, self.prefill_s_per_token, self.settings)
        pages = restorable_cut(choice.pages, hit.restorable_prefix_pages)
        if pages < choice.pages:  # the guard's cut is not restorable: load less
            choice = LoadChoice(pages, choice.load_s, choice.prefill_s,
                                _past(runs, pages),
                                choice.reason if choice.skipped else "not_restorable")
        if counts is not None:
            tiers: Counter[str] = Counter()
            for run in runs:
                tiers[run.tier] += run.pages
            count_lookup(counts, asked_pages * page_tokens, choice, tiers, page_tokens)
        return pages, choice


def _past(runs: Sequence[LoadRun], pages: int) -> tuple[LoadRun, ...]:
    """The parts of ``runs`` past the first ``pages`` pages."""
    out, at = [], 0
    for run in runs:
        if at + run.pages > pages:
            out.append(LoadRun(run.tier, run.pages - max(0, pages - at), run.seconds))
        at += run.pages
    return tuple(out)
