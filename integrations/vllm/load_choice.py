"""The load guard in raykv's vLLM connector (pure: no vLLM, no Ray, no torch; any clock):
the estimates the scheduler side weighs and its choice per lookup
(``controllers.load_guard.choose_load``).

Estimates, all kept on the scheduler side (one per engine), so that it alone decides
and every worker loads the same prefix:

- **prefill** (``StepClock``): seconds per token of the engine's own recent steps. vLLM's
  scheduler calls ``build_connector_meta`` once per scheduled step and, for each step's
  output, in the same order, ``update_connector_output`` then the scheduler's
  ``get_kv_connector_stats`` (``Scheduler.update_from_output``, once per step, whether
  the engine steps one at a time or keeps a batch queue: async scheduling, pipeline
  parallel). A step's time is from its output back to the later of its metadata and the
  previous step's output (one engine computes one step at a time: with a batch queue the
  next step was built while this one ran and starts when it ends). Only steps that
  prefill at least a block (some request scheduled ``page_tokens`` or more) and load
  nothing on the step count: decode steps say nothing of prefill, and a load on the
  step is in the step's time. Cold start: no estimate until the first such step ends;
  until then the guard loads (the first loads measure the tiers meanwhile).
- **l2** and **l3** (``TierRates``): seconds per byte of one TP rank's loads, from
  what the workers measured (``load_times.LoadTimes``) and handed vLLM in their
  connector stats (``{tier}_load_us`` / ``{tier}_load_bytes``, summed over the ranks
  by vLLM and read in ``update_connector_output``). ``l2`` starts from a probe (a timed
  copy of ``PROBE_BYTES`` in this process, ``copy_probe``); ``l3`` has no prior: a run
  of the group answer's ``load_runs`` with the answering node's estimate is taken as
  it is, any other L3 run (``l3``, ``l3_disk``) is estimated from the workers' L3 loads,
  and until one was measured it is loaded.

Threads: everything here runs on vLLM's scheduler thread (``Rate`` is thread-safe
anyway).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from raykv.controllers.load_guard import (
    ABOVE_THRESHOLD,
    BELOW_THRESHOLD,
    FASTER,
    NO_ESTIMATE,
    OFF,
    SLOWER,
    GuardSettings,
    LoadChoice,
    LoadRun,
    Rate,
    choose_load,
)
from raykv.integrations.vllm.connector_stats import ConnectorStats, StatsGrowth

L2, L3, L3_DISK = "l2", "l3", "l3_disk"
GUARD_TIERS = (L2, L3, L3_DISK)
PROBE_BYTES = 4 << 20
"""Bytes of the L2 prior's copy probe."""
OPEN_STEPS = 64
"""Steps built and not yet answered that ``StepClock`` keeps (the oldest dropped)."""

# Decisions and their reasons, as counted (``ConnectorStats``' ``guard_*``) and labelled
# (``raykv_load_guard_decisions``): every hit a lookup found past vLLM's own cache.
LOAD, RECOMPUTE, MIXED = "load", "recompute", "mixed"
DECISIONS = ((LOAD, OFF), (LOAD, FASTER), (LOAD, NO_ESTIMATE), (LOAD, ABOVE_THRESHOLD),
             (RECOMPUTE, SLOWER), (RECOMPUTE, BELOW_THRESHOLD), (MIXED, SLOWER))


def decision_key(decision: str, reason: str) -> str:
    """The connector counter (a ``ConnectorStats`` field) of one decision and reason."""
    return f"guard_{decision}_{reason}"


def skipped_key(tier: str) -> str:
    """The connector counter of the tokens the guard left to recompute from ``tier``."""
    return f"guard_skipped_{tier}_tokens"


def copy_probe(nbytes: int = PROBE_BYTES) -> float:
    """Seconds per byte of one copy of ``nbytes`` in this process's memory (the L2
    prior: an L2 load is a copy out of shared host memory)."""
    src, dst = bytearray(nbytes), bytearray(nbytes)
    view = memoryview(dst)
    t0 = time.perf_counter()
    view[:] = src
    return max(time.perf_counter() - t0, 1e-9) / nbytes


class StepClock:
    """The prefill estimate from the engine's steps (see the module docstring):
    ``built`` per step's metadata, ``output`` per step's output, in vLLM's order."""

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self.rate = Rate()  # seconds per token; no prior
        self._now = now
        # (built at, tokens or 0); bounded: vLLM keeps at most a batch queue of steps
        # in flight, and a step never answered must not grow it
        self._open: deque[tuple[float, int]] = deque(maxlen=OPEN_STEPS)
        self._last_output: float | None = None

    def built(self, tokens: int, prefills: bool) -> None:
        """A step of ``tokens`` scheduled tokens was built; ``prefills``: it counts."""
        self._open.append((self._now(), tokens if prefills else 0))

    def output(self) -> None:
        """The oldest open step's output came back (nothing open: ignored)."""
        now = self._now()
        if not self._open:
            return
        built, tokens = self._open.popleft()
        start = built if self._last_output is None else max(built, self._last_output)
        self._last_output = now
        if tokens:
            self.rate.observe(tokens, now - start)


class TierRates:
    """Seconds per byte of one rank's loads per tier (``L2`` from ``l2_prior``, ``L3``
    from the first measurement) and the bytes of one rank's page."""

    def __init__(self, page_bytes: int, l2_prior: float | None) -> None:
        self.page_bytes = page_bytes
        self.rates = {L2: Rate(l2_prior), L3: Rate()}

    def observe(self, growth: StatsGrowth) -> None:
        """Fold in the workers' loads of one step (their connector stats' load sums,
        summed over ranks)."""
        for tier, nbytes, us in ((L2, growth.l2_load_bytes, growth.l2_load_us),
                                 (L3, growth.l3_load_bytes, growth.l3_load_us)):
            if nbytes > 0:
                self.rates[tier].observe(nbytes, us / 1e6)

    def seconds(self, tier: str, pages: int) -> float | None:
        """The estimate of loading ``pages`` from ``tier`` (``l3_disk`` as ``l3``); None
        while unknown or without a page size."""
        if not self.page_bytes:
            return None
        return self.rates[L2 if tier == L2 else L3].seconds(pages * self.page_bytes)


def hit_runs(l2: int, hit: int, load_runs: Sequence[tuple[str, int, float | None]],
             rates: TierRates) -> list[LoadRun]:
    """The runs of a hit of ``hit`` leading pages, the first ``l2`` in the node's L2:
    one ``l2`` run, then the L3 pages as the group answer's ``load_runs`` name them
    (their estimate, else ``rates``'), or, when those do not cover them, one ``l3``
    run estimated by ``rates``."""
    runs = [LoadRun(L2, l2, rates.seconds(L2, l2))] if l2 > 0 else []
    rest = hit - l2
    if rest <= 0:
        return runs
    if sum(p for _, p, _ in load_runs) >= rest and all(p > 0 for _, p, _ in load_runs):
        for tier, pages, seconds in load_runs:
            pages = min(pages, rest)
            if pages <= 0:
                break
            runs.append(LoadRun(tier, pages, rates.seconds(tier, pages)
                                if seconds is None else seconds))
            rest -= pages
        return runs
    return [*runs, LoadRun(L3, rest, rates.seconds(L3, rest))]


@dataclass(frozen=True)
class GuardOutcome:
    """One lookup's choice: load the leading ``pages`` of the hit; ``decision`` /
    ``reason``: its labels (``DECISIONS``); ``skipped_tokens``: per tier, the tokens
    left to recompute; ``runs`` and ``choice``: what was weighed."""

    pages: int
    decision: str
    reason: str
    skipped_tokens: dict[str, int]
    runs: tuple[LoadRun, ...]
    choice: LoadChoice


def decide(runs: Sequence[LoadRun], page_tokens: int, prefill_s_per_token: float | None,
           settings: GuardSettings) -> GuardOutcome:
    """``choose_load`` over ``runs`` (a hit of at least one page), labelled."""
    choice = choose_load(runs, page_tokens, prefill_s_per_token, settings)
    skipped: dict[str, int] = {}
    for run in choice.skipped:
        skipped[run.tier] = skipped.get(run.tier, 0) + run.pages * page_tokens
    decision = LOAD if not choice.skipped else MIXED if choice.pages else RECOMPUTE
    reason = choice.reason
    return GuardOutcome(choice.pages, decision, reason, skipped, tuple(runs), choice)


def count(stats: ConnectorStats, outcome: GuardOutcome) -> None:
    """Add ``outcome`` to the connector's counters (its ``guard_*`` fields;
    ``AttributeError`` for a decision or tier without one)."""
    name = decision_key(outcome.decision, outcome.reason)
    setattr(stats, name, getattr(stats, name) + 1)
    for tier, tokens in outcome.skipped_tokens.items():
        name = skipped_key(tier if tier in GUARD_TIERS else L3)
        setattr(stats, name, getattr(stats, name) + tokens)


def _s(value: float | None) -> str:
    return "none" if value is None else f"{value:.4f}"


def explain(req_id: str, asked_tokens: int, local_tokens: int, load_tokens: int,
            outcome: GuardOutcome | None, page_tokens: int) -> str:
    """The per-request line of the ``explain`` setting: the tokens asked about (past
    vLLM's ``local_tokens``), which tier serves which of the ``load_tokens`` told to
    vLLM, and what the guard skipped with both estimates (seconds)."""
    served, at = [], 0
    runs = outcome.runs if outcome else ()
    for run in runs:
        tokens = min(run.pages * page_tokens, max(0, load_tokens - at))
        if tokens:
            served.append(f"{run.tier}:{tokens}")
        at += tokens
    line = (f"RayKVConnector explain {req_id}: asked {asked_tokens} tokens past "
            f"{local_tokens} cached; load {load_tokens} ({' '.join(served) or 'none'})")
    if outcome is None:
        return line + "; no hit"
    c = outcome.choice
    skipped = " ".join(f"{t}:{n}" for t, n in outcome.skipped_tokens.items()) or "none"
    return (f"{line}; guard {outcome.decision} ({outcome.reason}), skipped {skipped}, "
            f"load_s {_s(c.load_s)} prefill_s {_s(c.prefill_s)}")


class LoadGuard:
    """The scheduler side's load guard: its ``settings``, its estimates (``clock``:
    prefill per token, ``rates``: per tier) and its choice per lookup (``choose``)."""

    def __init__(self, settings: GuardSettings, page_tokens: int, page_bytes: int,
                 l2_prior: float | None, now: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.page_tokens = page_tokens
        self.clock = StepClock(now)
        self.rates = TierRates(page_bytes, l2_prior)

    def choose(self, l2: int, hit: int,
               load_runs: Sequence[tuple[str, int, float | None]]) -> GuardOutcome:
        """The choice over a hit of ``hit`` (>= 1) leading pages, the first ``l2`` in the
        node's L2, the rest as ``load_runs`` name them (``hit_runs``)."""
        return decide(hit_runs(l2, hit, load_runs, self.rates), self.page_tokens,
                      self.clock.rate.per_unit(), self.settings)
