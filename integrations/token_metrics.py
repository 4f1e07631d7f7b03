"""An engine integration's token counters and load guard decisions as Ray metrics, for
any engine (SGLang's backend exports through ``TokenMetrics``; vLLM's connector
exports its own counts through the same ``token_counters`` in
``vllm.connector_metrics``):

- ``raykv_asked_tokens``: tokens a lookup asked raykv about (the hit rate's
  denominator);
- ``raykv_hit_tokens`` by ``tier``: tokens a lookup told the engine to load, by the tier
  they were found in (``l2``, ``l3``, ``l3_disk``);
- ``raykv_load_guard_decisions`` by ``decision`` (``load``: the whole hit, ``recompute``:
  none of it, ``mixed``: its leading runs) and ``reason`` (``none`` when all was
  loaded, else ``controllers.load_guard``'s: ``slower_than_prefill``,
  ``below_threshold``): one per lookup with a hit;
- ``raykv_load_guard_skipped_tokens`` by ``tier``: tokens of a hit the guard left to
  be recomputed, by the tier they were in.

Each also by the engine's ``tenant`` (``(none)`` without one), ``deployment`` and
``model``. The integration counts in a plain dict of ints (``TokenCounts`` names its
keys) on its own threads; a thread of this module reads it every ``export_s`` seconds
and hands Ray what grew since its last look, so no lookup makes a Ray metric call.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

from raykv.controllers.contract import StorageConfig
from raykv.controllers.deployments import deployment_id
from raykv.controllers.load_guard import LoadChoice

EXPORT_S = 5.0
"""Seconds between two looks at the counts (Ray ships metrics every few seconds)."""
ASKED = "asked_tokens"
HIT = "hit_tokens:"
DECISION = "load_guard:"
SKIPPED = "load_guard_skipped_tokens:"


def decision(choice: LoadChoice, hit_pages: int) -> str:
    """``load``, ``recompute`` or ``mixed``: what ``choice`` did with a hit of
    ``hit_pages`` pages."""
    return "load" if choice.pages >= hit_pages else "recompute" if not choice.pages \
        else "mixed"


def count_lookup(counts: Counter[str], asked_tokens: int, choice: LoadChoice,
                 hit_tiers: Mapping[str, int], page_tokens: int) -> None:
    """Count one lookup into ``counts``: ``asked_tokens``; the loaded pages of each
    tier (``hit_tiers``: tier -> pages of the hit, in prefix order, ``choice.skipped``
    among them); with a hit, the guard's decision and the pages it skipped."""
    counts[ASKED] += asked_tokens
    skipped: Counter[str] = Counter()
    for run in choice.skipped:
        skipped[run.tier] += run.pages
    for tier, pages in hit_tiers.items():
        if pages - skipped[tier] > 0:
            counts[HIT + tier] += (pages - skipped[tier]) * page_tokens
    for tier, pages in skipped.items():
        counts[SKIPPED + tier] += pages * page_tokens
    hit = sum(hit_tiers.values())
    if hit:
        counts[f"{DECISION}{decision(choice, hit)}:{choice.reason or 'none'}"] += 1


def token_counters(owner: Mapping[str, str]) -> tuple:
    """The four Ray counters of the module docstring (``raykv_asked_tokens``,
    ``raykv_hit_tokens``, ``raykv_load_guard_decisions``,
    ``raykv_load_guard_skipped_tokens``), with ``owner`` (``tenant``, ``deployment``,
    ``model``) as their default tags: the one definition every engine's export uses."""
    from ray.util import metrics

    counters = (
        metrics.Counter("raykv_asked_tokens", "Tokens a lookup asked raykv about (full "
                        "pages past the engine's own cache): the hit rate's denominator",
                        tag_keys=("tenant", "deployment", "model")),
        metrics.Counter("raykv_hit_tokens", "Tokens a lookup told the engine to load, by "
                        "the tier they were found in",
                        tag_keys=("tier", "tenant", "deployment", "model")),
        metrics.Counter("raykv_load_guard_decisions", "Lookups with a hit, by what the "
                        "load guard did (load, recompute, mixed) and why",
                        tag_keys=("decision", "reason", "tenant", "deployment",
                                  "model")),
        metrics.Counter("raykv_load_guard_skipped_tokens", "Tokens of a hit the load "
                        "guard left to be recomputed, by the tier they were in",
                        tag_keys=("tier", "tenant", "deployment", "model")))
    for m in counters:
        m.set_default_tags(dict(owner))
    return counters


class TokenMetrics:
    """Exports ``counts`` (read, never written; keys as ``count_lookup`` writes them)
    with ``owner`` (``tenant``, ``deployment``, ``model``), by a thread of its own until
    ``close``."""

    def __init__(self, counts: Mapping[str, int], owner: Mapping[str, str],
                 export_s: float = EXPORT_S) -> None:
        self._counts = counts
        self._asked, self._hit, self._decisions, self._skipped = token_counters(owner)
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()  # one export at a time
        self._stop = threading.Event()
        threading.Thread(target=self._loop, args=(export_s,), name="raykv-token-metrics",
                         daemon=True).start()

    @classmethod
    def for_rank(cls, counts: Mapping[str, int], config: StorageConfig
                 ) -> TokenMetrics | None:
        """The export of ``counts`` for the rank of ``config`` if it is its engine's
        first (TP, PP and context-parallel rank 0: every rank gets the same answers, so
        one counts for the engine), else None. Owner tags from ``config``."""
        if config.tp_rank or config.pp_rank or config.attn_cp_rank:
            return None
        return cls(counts, {"tenant": config.tenant or "(none)",
                            "deployment": deployment_id(config),
                            "model": config.model_name or "(none)"})

    def export(self) -> None:
        """Hand Ray what each count grew by since the last export (any thread)."""
        with self._lock:
            now = dict(self._counts)
            for name, total in now.items():
                if (grown := total - self._seen.get(name, 0)) <= 0:
                    continue
                if name == ASKED:
                    self._asked.inc(grown)
                elif name.startswith(HIT):
                    self._hit.inc(grown, tags={"tier": name[len(HIT):]})
                elif name.startswith(SKIPPED):
                    self._skipped.inc(grown, tags={"tier": name[len(SKIPPED):]})
                elif name.startswith(DECISION):
                    made, reason = name[len(DECISION):].split(":", 1)
                    self._decisions.inc(grown, tags={"decision": made, "reason": reason})
            self._seen = now

    def _loop(self, export_s: float) -> None:
        while not self._stop.wait(export_s):
            self.export()

    def close(self) -> None:
        """Export what is left and end the thread."""
        self._stop.set()
        self.export()
