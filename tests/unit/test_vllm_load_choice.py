"""The vLLM connector's load guard wiring (``integrations.vllm.load_choice``, pure): the
prefill estimate from the steps' metadata and outputs, the tier rates from the workers'
measured loads, the runs of a hit, the labelled choice, and the scheduler side's answer
that tells vLLM only the chosen pages."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from raykv.controllers.load_guard import GuardSettings, LoadRun
from raykv.integrations.vllm.connector_stats import ConnectorStats, StatsGrowth
from raykv.integrations.vllm.load_choice import (
    DECISIONS,
    LoadGuard,
    StepClock,
    TierRates,
    count,
    decide,
    decision_key,
    explain,
    hit_runs,
)
from raykv.integrations.vllm.load_times import LoadTimes

AUTO, OFF = GuardSettings.parse("auto"), GuardSettings.parse("off")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_step_clock_times_prefill_steps_one_at_a_time_and_with_a_batch_queue():
    now = Clock()
    clock = StepClock(now)
    assert clock.rate.per_unit() is None  # cold start: no estimate
    clock.output()  # nothing open: ignored
    # one at a time: built at 0, output at 2 -> 1000 tokens in 2 s
    clock.built(1000, True)
    now.t = 2.0
    clock.output()
    assert clock.rate.per_unit() == pytest.approx(0.002)
    # a decode step (no prefill) is not counted
    now.t = 3.0
    clock.built(4, False)
    now.t = 100.0
    clock.output()
    assert clock.rate.samples == 1
    # batch queue: step B built while A runs; B's time starts at A's output
    now.t = 200.0
    clock.built(500, True)   # A
    now.t = 200.5
    clock.built(500, True)   # B, queued behind A
    now.t = 201.0
    clock.output()           # A: 1 s for 500 tokens
    now.t = 202.0
    clock.output()           # B: from A's output, 1 s, not 1.5
    assert clock.rate.samples == 3
    per = clock.rate.per_unit()
    # the two queued steps measured the same 0.002 s/token as the first one
    assert per == pytest.approx(0.002)


def test_tier_rates_from_the_workers_sums_and_l3_disk_as_l3():
    rates = TierRates(page_bytes=1000, l2_prior=1e-9)
    assert rates.seconds("l2", 2) == pytest.approx(2e-6)
    assert rates.seconds("l3", 2) is None  # no prior: unknown until measured
    rates.observe(StatsGrowth(l3_load_us=2_000_000, l3_load_bytes=4000, loaded=3))
    assert rates.seconds("l3", 2) == pytest.approx(1.0)
    assert rates.seconds("l3_disk", 2) == pytest.approx(1.0)
    assert TierRates(page_bytes=0, l2_prior=1e-9).seconds("l2", 2) is None


def test_load_times_sums_reach_vllms_stats_once_and_the_export_still_sees_each_load():
    pytest.importorskip("vllm", reason="vllm_stats subclasses vLLM's stats")
    from raykv.integrations.vllm.vllm_stats import StatsDelta

    loads = LoadTimes()
    loads.record("l3", 0.5, 1000)
    loads.record("l3", 0.25, 500)
    loads.record("l2", 0.001, 100)
    delta = StatsDelta(ConnectorStats(), loads)
    assert delta.take().data == {"l3_load_us": 750_000, "l3_load_bytes": 1500,
                                 "l2_load_us": 1000, "l2_load_bytes": 100}
    assert delta.take() is None  # taken once
    assert len(loads.drain()) == 3  # the Ray metrics' records are their own


def test_hit_runs_use_the_group_answers_runs_else_the_own_l3_rate():
    rates = TierRates(page_bytes=100, l2_prior=1e-6)
    rates.observe(StatsGrowth(l3_load_us=1000, l3_load_bytes=100))  # 1e-5 s per byte
    assert hit_runs(3, 3, [], rates) == [LoadRun("l2", 3, pytest.approx(3e-4))]
    assert hit_runs(0, 2, [], rates) == [LoadRun("l3", 2, pytest.approx(2e-3))]
    runs = hit_runs(1, 4, [("l3", 1, 0.5), ("l3_disk", 2, None)], rates)
    assert runs == [LoadRun("l2", 1, pytest.approx(1e-4)), LoadRun("l3", 1, 0.5),
                    LoadRun("l3_disk", 2, pytest.approx(2e-3))]
    # runs that do not cover the L3 pages: one l3 run of the own rate
    assert hit_runs(0, 4, [("l3", 1, 0.5)], rates) == [
        LoadRun("l3", 4, pytest.approx(4e-3))]


@pytest.mark.parametrize(("runs", "prefill", "settings", "want"), [
    ([LoadRun("l2", 2, 0.001), LoadRun("l3", 2, 9.0)], 1e-3, AUTO,
     (2, "mixed", "slower_than_prefill", {"l3": 32})),
    ([LoadRun("l3", 2, 9.0)], 1e-3, AUTO, (0, "recompute", "slower_than_prefill",
                                           {"l3": 32})),
    ([LoadRun("l3", 2, 1e-6)], 1e-3, AUTO, (2, "load", "faster_than_prefill", {})),
    ([LoadRun("l3", 2, None)], 1e-3, AUTO, (2, "load", "no_estimate", {})),
    ([LoadRun("l3", 2, 9.0)], None, AUTO, (2, "load", "no_estimate", {})),
    ([LoadRun("l3", 2, 9.0)], 1e-3, OFF, (2, "load", "off", {})),
    ([LoadRun("l3", 2, 9.0)], 1e-3, GuardSettings.parse(33),
     (0, "recompute", "below_threshold", {"l3": 32})),
    ([LoadRun("l3", 2, 9.0)], 1e-3, GuardSettings.parse(32),
     (2, "load", "above_threshold", {})),
])
def test_decide_labels_every_choice(runs, prefill, settings, want):
    got = decide(runs, 16, prefill, settings)
    assert (got.pages, got.decision, got.reason, got.skipped_tokens) == want
    stats = ConnectorStats()
    count(stats, got)  # every label pair has its counter (AttributeError otherwise)
    assert getattr(stats, decision_key(got.decision, got.reason)) == 1
    assert (got.decision, got.reason) in DECISIONS


def test_explain_names_tiers_skipped_tokens_and_both_estimates():
    out = decide([LoadRun("l2", 2, 0.001), LoadRun("l3", 2, 9.0)], 16, 1e-3, AUTO)
    line = explain("r1", 64, 16, 32, out, 16)
    assert "asked 64 tokens past 16 cached; load 32 (l2:32)" in line
    assert "guard mixed (slower_than_prefill), skipped l3:32" in line
    assert "load_s 9.0010 prefill_s 0.0640" in line
    assert explain("r2", 64, 0, 0, None, 16).endswith("load 0 (none); no hit")


@pytest.fixture
def side():
    pytest.importorskip("vllm", reason="the connector's scheduler side imports vLLM")
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity
    from raykv.integrations.vllm.scheduler import RayKVConnectorScheduler

    opts = ConnectorOptions.parse({"l2_blocks": 4}, tp_size=1, pp_size=1, served_model="m",
                                  identity=KVIdentity("bfloat16", 16, "cpu.lm1"))
    return RayKVConnectorScheduler(opts, do_load=False, do_save=True, block_size=16,
                                   tp_size=1, pp_size=1)  # never attaches


def test_the_scheduler_tells_vllm_only_the_chosen_pages(side):
    """A hit of 2 L2 blocks then 2 L3 blocks whose L3 load is estimated slower than
    computing them: vLLM is told the L2 blocks only, counted as a mixed decision with
    the L3 tokens skipped, and no async load (nothing past L2). CONTROL: the same
    answer with the guard off loads all 4 blocks, 2 of them from L3."""
    guard = side._guard
    guard.rates = TierRates(page_bytes=1000, l2_prior=1e-9)
    guard.rates.observe(StatsGrowth(l3_load_us=10_000_000, l3_load_bytes=1000))  # 10 ms/B
    guard.clock.rate.observe(1000, 0.1)  # 0.1 ms per token

    def ask(settings):
        guard.settings = settings
        st = SimpleNamespace(request=SimpleNamespace(num_tokens=6 * 16, request_id="r"),
                             local_hit_tokens=0, l2_hit_blocks=0)
        return side._answer(st, 0, 5, (2, 4, []), 0), st.l2_hit_blocks

    assert ask(AUTO) == ((2 * 16, False), 2)
    stats = side.stats
    assert stats.guard_mixed_slower_than_prefill == 1
    assert stats.guard_skipped_l3_tokens == 2 * 16
    assert (stats.l2_hit_tokens, stats.l3_hit_tokens) == (2 * 16, 0)
    assert ask(OFF) == ((4 * 16, True), 2)  # CONTROL
    assert stats.guard_load_off == 1 and stats.l3_hit_tokens == 2 * 16


def test_the_schedulers_steps_feed_the_prefill_estimate(side):
    """``build_connector_meta`` then ``step_output``: a step prefilling a block and
    loading nothing is measured; a decode step is not."""
    def output(tokens: dict):
        return SimpleNamespace(num_scheduled_tokens=tokens,
                               total_num_scheduled_tokens=sum(tokens.values()),
                               scheduled_spec_decode_tokens={}, scheduled_new_reqs=[],
                               scheduled_cached_reqs=SimpleNamespace(req_ids=[]))

    side.build_connector_meta(output({"a": 1, "b": 1}))
    side.step_output()
    assert side._guard.clock.rate.samples == 0
    side.build_connector_meta(output({"a": 1, "c": 16}))
    side.step_output()
    assert side._guard.clock.rate.samples == 1


def test_load_guard_settings_in_the_extra_config():
    from raykv.integrations.vllm.options import ConnectorOptions, KVIdentity

    def parse(extra):
        return ConnectorOptions.parse(extra, tp_size=1, pp_size=1, served_model="m",
                                      identity=KVIdentity("bfloat16", 16, "cpu.lm1"))

    assert parse({}).load_guard == GuardSettings() and not parse({}).explain
    assert parse({"load_guard": "off"}).load_guard.mode == "off"
    got = parse({"load_guard": 256, "load_guard_margin": 2, "explain": True})
    assert (got.load_guard.threshold_tokens, got.load_guard.margin, got.explain) == (
        256, 2.0, True)
    for bad, words in [({"load_guard": "sometimes"}, "load_guard 'sometimes'"),
                       ({"load_guard": -1}, "threshold -1"),
                       ({"load_guard_margin": 0.1}, "margin 0.1"),
                       ({"load_guard_margin": "big"}, "must be a number"),
                       ({"explain": "yes"}, "explain must be true or false")]:
        with pytest.raises(ValueError, match=words):
            parse(bad)


def test_load_guard_wires_its_estimates():
    guard = LoadGuard(AUTO, 16, 1000, l2_prior=1e-9)
    assert guard.choose(2, 2, []).decision == "load"  # no prefill estimate: load
    guard.clock.rate.observe(1000, 1e-3)
    guard.rates.observe(StatsGrowth(l3_load_us=5_000_000, l3_load_bytes=1000))
    got = guard.choose(1, 3, [])
    assert (got.pages, got.decision) == (1, "mixed")
