"""The load guard: load a hit only where it arrives sooner than the engine would compute
it (pure: no Ray, no Mooncake, no torch; any clock).

A hit is a prefix of pages; the pages come in **runs**, each from one tier (``l2``: the
node's L2, ``l3``: the store's memory on some segment, ``l3_disk``: a segment's disk),
in prefix order (``LoadRun``). Loading run ``i`` is only worth anything with runs
``0..i-1`` loaded too, so the choice is a cut: the leading ``k`` pages to load, the rest
recomputed. ``choose_load`` picks the cut that saves the most time:

    gain(k) = prefill_s(tokens of pages 0..k) - margin * load_s(pages 0..k)

over every run boundary (``k = 0``, recompute everything, has gain 0), where
``load_s`` is the sum of the runs' estimates and ``prefill_s`` the engine's measured
seconds per token times the tokens. A result can be mixed: load the L2 head, recompute
the remote tail. It never changes bytes: a recomputed page is what a miss gives.

Modes (``GuardSettings``, from the setting ``load_guard``):

- ``auto`` (the default): the cut above, from the estimates. A run with no estimate, or
  no prefill estimate yet, is loaded (nothing says it is slow: the first loads measure).
- ``off``: every hit is loaded (raykv before the guard).
- a number ``N`` (tokens): a fixed threshold, as SGLang's HiCache has one: the whole hit
  is loaded if it is at least ``N`` tokens, else none of it; no estimates are used.

The estimates are moving averages (``Rate``): what raykv's own loads took per byte on
each tier and link, and what the engine's recent steps took per token. Each is seeded
by a probe or a prior and moves with every measurement.

Threads: ``Rate`` is thread-safe (one lock around a few floats); ``choose_load`` and
``GuardSettings`` are pure values.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

OFF, AUTO = "off", "auto"
DEFAULT_MARGIN = 1.1
"""A load must be estimated this many times faster than computing its tokens to be
chosen: estimates are averages, and a load slower than computing is the one mistake
the guard exists to prevent. 1.1 keeps the guard within 10 % of always loading where
loading wins."""
MAX_THRESHOLD_TOKENS = 1 << 24

# Why a hit was loaded or not (``LoadChoice.reason``).
SLOWER = "slower_than_prefill"   # auto: loading the run costs more than computing it
BELOW_THRESHOLD = "below_threshold"  # a fixed threshold: the hit is too short
FASTER = "faster_than_prefill"   # auto: every run estimated to arrive sooner
NO_ESTIMATE = "no_estimate"      # auto: a run or the prefill has no estimate yet: loaded
ABOVE_THRESHOLD = "above_threshold"  # a fixed threshold: the hit is long enough


@dataclass(frozen=True)
class GuardSettings:
    """``mode``: ``auto``, ``off`` or ``threshold`` (``threshold_tokens`` then is the
    least hit, in tokens, that is loaded); ``margin``: see ``DEFAULT_MARGIN``."""

    mode: str = AUTO
    threshold_tokens: int = 0
    margin: float = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        if self.mode not in (AUTO, OFF, "threshold"):
            raise ValueError(f"load_guard mode {self.mode!r}: expected auto, off or a "
                             "number of tokens")
        if type(self.threshold_tokens) is not int or not \
                0 <= self.threshold_tokens <= MAX_THRESHOLD_TOKENS:
            raise ValueError(f"load_guard threshold {self.threshold_tokens!r}: expected "
                             f"an int of tokens in [0, {MAX_THRESHOLD_TOKENS}]")
        if not (isinstance(self.margin, int | float) and math.isfinite(self.margin)
                and 0.5 <= self.margin <= 10):
            raise ValueError(f"load_guard margin {self.margin!r}: expected a number in "
                             "[0.5, 10]")

    @classmethod
    def parse(cls, value: object, margin: float = DEFAULT_MARGIN) -> GuardSettings:
        """The setting ``load_guard`` as users write it: ``"auto"``, ``"off"``, or a
        number of tokens (an int, or a string of digits) for a fixed threshold; None is
        ``auto``. ``ValueError`` naming what was given otherwise."""
        if value is None:
            return cls(AUTO, margin=margin)
        if isinstance(value, str):
            text = value.strip().lower()
            if text in (AUTO, OFF):
                return cls(text, margin=margin)
            if text.isdigit():
                return cls("threshold", int(text), margin)
        elif type(value) is int:
            return cls("threshold", value, margin)
        raise ValueError(f"load_guard {value!r}: expected 'auto', 'off' or a number of "
                         "tokens (a fixed threshold)")

    def describe(self) -> str:
        """The setting as ``parse`` reads it back."""
        return str(self.threshold_tokens) if self.mode == "threshold" else self.mode


@dataclass(frozen=True)
class LoadRun:
    """``pages`` consecutive pages of a hit from one ``tier``, whose load is estimated to
    take ``seconds`` (None: no estimate)."""

    tier: str
    pages: int
    seconds: float | None = None


@dataclass(frozen=True)
class LoadChoice:
    """What the guard chose for one hit: load the leading ``pages`` (0: recompute all).

    ``load_s`` / ``prefill_s``: the estimates of the whole hit it weighed (None where
    unknown); ``skipped``: the runs not loaded; ``reason``: why (``SLOWER``,
    ``BELOW_THRESHOLD`` for what was skipped; ``FASTER``, ``NO_ESTIMATE``,
    ``ABOVE_THRESHOLD`` or ``OFF`` when all was loaded; empty for no hit)."""

    pages: int
    load_s: float | None = None
    prefill_s: float | None = None
    skipped: tuple[LoadRun, ...] = ()
    reason: str = ""


def _skipped(runs: Sequence[LoadRun], cut: int) -> tuple[LoadRun, ...]:
    """The runs that start at or after the first ``cut`` pages (cuts fall on run
    boundaries)."""
    out, at = [], 0
    for run in runs:
        if at >= cut:
            out.append(run)
        at += run.pages
    return tuple(out)


def choose_load(runs: Sequence[LoadRun], page_tokens: int, prefill_s_per_token: float | None,
                settings: GuardSettings) -> LoadChoice:
    """The leading pages of a hit to load (see the module docstring): ``runs`` in prefix
    order, ``page_tokens`` tokens per page, ``prefill_s_per_token`` the engine's
    estimate (None: none yet). ``ValueError`` for a run of no page."""
    if page_tokens < 1:
        raise ValueError(f"page_tokens {page_tokens!r}: expected at least 1")
    for run in runs:
        if run.pages < 1:
            raise ValueError(f"run {run!r}: a run holds at least one page")
    total = sum(r.pages for r in runs)
    known = all(r.seconds is not None for r in runs)
    load_s = sum(r.seconds for r in runs) if known and runs else None
    prefill_s = None if prefill_s_per_token is None else \
        prefill_s_per_token * total * page_tokens
    if total == 0:
        return LoadChoice(0, load_s, prefill_s)
    if settings.mode == OFF:
        return LoadChoice(total, load_s, prefill_s, reason=OFF)
    if settings.mode == "threshold":
        if total * page_tokens >= settings.threshold_tokens:
            return LoadChoice(total, load_s, prefill_s, reason=ABOVE_THRESHOLD)
        return LoadChoice(0, load_s, prefill_s, tuple(runs), BELOW_THRESHOLD)
    if prefill_s_per_token is None:
        return LoadChoice(total, load_s, prefill_s, reason=NO_ESTIMATE)
    best, best_gain, pages, cost = 0, 0.0, 0, 0.0
    for run in runs:
        pages += run.pages
        cost += run.seconds or 0.0  # unknown: nothing says it is slow
        gain = pages * page_tokens * prefill_s_per_token - settings.margin * cost
        if gain > best_gain:
            best, best_gain = pages, gain
    if best == total:
        return LoadChoice(total, load_s, prefill_s, reason=FASTER if known else NO_ESTIMATE)
    return LoadChoice(best, load_s, prefill_s, _skipped(runs, best), SLOWER)


@dataclass
class Rate:
    """A moving average of seconds per unit (per byte of a tier's loads, per token of an
    engine's prefill) and of a fixed cost per call, seeded by ``prior_per_unit`` /
    ``fixed_s`` (a probe's measurement, or None: unknown until the first ``observe``).

    ``observe(units, seconds)`` folds one measurement in: the call's time beyond the
    current fixed cost, per unit, with weight ``weight`` (the newest measurement's share
    of the average); ``seconds(units)`` is the estimate for a call of ``units`` (None
    while unknown). Bounded: each measurement is clamped to ``[0, max_seconds]`` so one
    stalled call cannot poison the average for longer than a few calls."""

    prior_per_unit: float | None = None
    fixed_s: float = 0.0
    weight: float = 0.2
    max_seconds: float = 600.0
    samples: int = 0
    _per_unit: float | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight {self.weight!r}: expected (0, 1]")
        self._per_unit = self.prior_per_unit

    def observe(self, units: float, seconds: float) -> None:
        """One call of ``units`` (> 0) that took ``seconds``; others are ignored."""
        if not (units > 0 and math.isfinite(seconds) and seconds >= 0):
            return
        per_unit = max(0.0, min(seconds, self.max_seconds) - self.fixed_s) / units
        with self._lock:
            self.samples += 1
            if self._per_unit is None:
                self._per_unit = per_unit
            else:
                self._per_unit += self.weight * (per_unit - self._per_unit)

    def per_unit(self) -> float | None:
        """The current seconds per unit (None: unknown)."""
        with self._lock:
            return self._per_unit

    def seconds(self, units: float) -> float | None:
        """Estimated seconds of a call of ``units`` (None while unknown)."""
        per_unit = self.per_unit()
        return None if per_unit is None else self.fixed_s + per_unit * units
