"""The load guard's choice and its moving averages (pure)."""

from __future__ import annotations

import pytest
from raykv.controllers.load_guard import (
    BELOW_THRESHOLD,
    SLOWER,
    GuardSettings,
    LoadRun,
    Rate,
    choose_load,
)

AUTO = GuardSettings()


def test_a_load_faster_than_prefill_is_taken_whole():
    runs = [LoadRun("l2", 4, 0.004), LoadRun("l3", 4, 0.02)]
    choice = choose_load(runs, 16, 1e-3, AUTO)  # 128 tokens: 128 ms to compute, 24 to load
    assert choice.pages == 8 and choice.skipped == () and choice.reason == "faster_than_prefill"
    assert choice.load_s == pytest.approx(0.024) and choice.prefill_s == pytest.approx(0.128)


def test_a_slow_remote_tail_is_recomputed_and_the_l2_head_loaded():
    runs = [LoadRun("l2", 4, 0.004), LoadRun("l3", 4, 1.2)]
    choice = choose_load(runs, 16, 1e-3, AUTO)
    assert choice.pages == 4 and choice.reason == SLOWER
    assert choice.skipped == (LoadRun("l3", 4, 1.2),)
    # control: the same runs with the guard off load everything
    off = choose_load(runs, 16, 1e-3, GuardSettings.parse("off"))
    assert (off.pages, off.reason) == (8, "off")


def test_a_slow_head_makes_the_whole_hit_recomputed():
    choice = choose_load([LoadRun("l3", 8, 1.0)], 16, 1e-3, AUTO)
    assert choice.pages == 0 and choice.skipped == (LoadRun("l3", 8, 1.0),)


def test_a_fast_tail_can_pay_for_a_slow_head():
    # loading 2 pages alone loses (0.05 > 0.032), all 10 wins (0.06 < 0.16)
    runs = [LoadRun("l3", 2, 0.05), LoadRun("l2", 8, 0.01)]
    assert choose_load(runs, 16, 1e-3, AUTO).pages == 10


def test_the_margin_decides_near_the_crossover():
    runs = [LoadRun("l3", 4, 0.060)]  # 64 tokens at 1 ms: 64 ms against 60 ms
    assert choose_load(runs, 16, 1e-3, GuardSettings(margin=1.0)).pages == 4
    assert choose_load(runs, 16, 1e-3, GuardSettings(margin=1.1)).pages == 0


def test_unknown_estimates_load():
    for runs, prefill in (([LoadRun("l3", 4, None)], 1e-3), ([LoadRun("l3", 4, 9.0)], None)):
        choice = choose_load(runs, 16, prefill, AUTO)
        assert (choice.pages, choice.reason) == (4, "no_estimate")
    assert choose_load([LoadRun("l3", 4, 9.0)], 16, 1e-3, AUTO).pages == 0  # control


def test_the_cut_falls_on_a_run_boundary():
    runs = [LoadRun("l2", 2, 0.0), LoadRun("l3", 3, 3.0)]
    choice = choose_load(runs, 1, 1.5, GuardSettings(margin=1.0))
    assert choice.pages == 5  # 7.5 s of prefill against 3 s of load
    choice = choose_load(runs, 1, 0.5, GuardSettings(margin=1.0))
    assert choice.pages == 2 and choice.skipped == (LoadRun("l3", 3, 3.0),)


def test_a_fixed_threshold_loads_long_hits_only():
    runs = [LoadRun("l3", 4, 100.0)]
    s = GuardSettings.parse("128")
    assert choose_load(runs, 16, 1e-3, s).pages == 0
    assert choose_load(runs, 16, 1e-3, s).reason == BELOW_THRESHOLD
    choice = choose_load(runs, 32, 1e-3, s)  # 128 tokens: loaded, slow or not
    assert (choice.pages, choice.reason) == (4, "above_threshold")


@pytest.mark.parametrize("value,mode,tokens", [
    (None, "auto", 0), ("auto", "auto", 0), (" OFF ", "off", 0), ("256", "threshold", 256),
    (256, "threshold", 256), (0, "threshold", 0)])
def test_settings_parse(value, mode, tokens):
    s = GuardSettings.parse(value)
    assert (s.mode, s.threshold_tokens) == (mode, tokens)
    assert GuardSettings.parse(s.describe()) == s


@pytest.mark.parametrize("value", ["on", "1.5", -1, 1.5, True, [], "1e3", 1 << 30])
def test_settings_refuse_what_they_cannot_read(value):
    with pytest.raises(ValueError, match="load_guard"):
        GuardSettings.parse(value)


def test_bad_margin_and_runs_are_refused():
    with pytest.raises(ValueError, match="margin"):
        GuardSettings(margin=float("nan"))
    with pytest.raises(ValueError, match="at least one page"):
        choose_load([LoadRun("l2", 0, 0.0)], 16, 1e-3, AUTO)
    with pytest.raises(ValueError, match="page_tokens"):
        choose_load([], 0, 1e-3, AUTO)


def test_rate_starts_at_its_prior_and_moves_towards_measurements():
    r = Rate(prior_per_unit=1e-9, fixed_s=0.001, weight=0.5)
    assert r.seconds(1e6) == pytest.approx(0.002)
    r.observe(1e6, 0.011)  # 10 ns per byte beyond the fixed cost
    assert r.per_unit() == pytest.approx(5.5e-9)
    for _ in range(30):
        r.observe(1e6, 0.011)
    assert r.per_unit() == pytest.approx(1e-8, rel=1e-3)
    assert r.samples == 31


def test_rate_without_prior_is_unknown_until_measured_and_ignores_nonsense():
    r = Rate()
    assert r.seconds(10) is None
    for units, seconds in ((0, 1.0), (10, float("nan")), (10, -1.0), (-5, 1.0)):
        r.observe(units, seconds)
    assert r.seconds(10) is None and r.samples == 0
    r.observe(10, 1.0)
    assert r.seconds(10) == pytest.approx(1.0)


def test_one_stalled_call_is_clamped():
    r = Rate(prior_per_unit=0.0, weight=0.5, max_seconds=10.0)
    r.observe(1, 1e9)
    assert r.per_unit() == pytest.approx(5.0)
    with pytest.raises(ValueError, match="weight"):
        Rate(weight=0)
