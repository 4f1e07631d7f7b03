"""The load guard where the engines apply it (pure): the example engine's runs of a hit
(``example_engine.load_estimates``), SGLang's backend's cut of a group answer
(``integrations.sglang.hit_guard``) and its extra-config keys, and the token counts
both export (``integrations.token_metrics``)."""

from __future__ import annotations

from collections import Counter

import pytest
from raykv.controllers.contract import PoolTransferResult
from raykv.controllers.load_guard import (
    BELOW_THRESHOLD,
    SLOWER,
    GuardSettings,
    LoadChoice,
    LoadRun,
    Rate,
)
from raykv.example_engine.load_estimates import EngineGuard, remote_runs
from raykv.integrations.sglang.config import BackendOptions
from raykv.integrations.sglang.hit_guard import HitGuard, hit_runs, restorable_cut
from raykv.integrations.token_metrics import count_lookup, decision

PAGE_BYTES = 1000


def measured(l2: float, l3: float, prefill: float) -> EngineGuard:
    """An engine guard whose rates are known: seconds per byte, per token."""
    return EngineGuard(GuardSettings(), Rate(prefill), Rate(l2), Rate(l3))


# ----------------------------------------------------------- example engine
def test_remote_runs_skip_the_head_and_split_a_run_by_its_share():
    runs = [("l2", 3, 0.3), ("l3", 4, 0.8), ("l3_disk", 2, None)]
    assert remote_runs(runs, 2, 5) == [LoadRun("l2", 1, pytest.approx(0.1)),
                                       LoadRun("l3", 4, 0.8)]
    assert remote_runs(runs, 3, 6) == [LoadRun("l3", 4, 0.8), LoadRun("l3_disk", 2, None)]
    # runs that do not cover the pages give none: the engine's own estimate then
    assert remote_runs(runs, 3, 7) == [] and remote_runs([], 0, 2) == []


def test_engine_runs_fall_back_to_its_own_l3_rate_plus_the_l2_copy():
    guard = measured(l2=1e-6, l3=1e-5, prefill=1e-3)
    runs = guard.runs(4, 7, [], PAGE_BYTES, hybrid=False)
    assert runs == [LoadRun("l2", 4, pytest.approx(4e-3)),
                    LoadRun("l3", 3, pytest.approx(3e-2 + 3e-3))]
    # the node's estimates replace the engine's own for the tail
    runs = guard.runs(4, 7, [("l2", 4, 1.0), ("l3", 3, 0.5)], PAGE_BYTES, hybrid=False)
    assert runs[1] == LoadRun("l3", 3, pytest.approx(0.5 + 3e-3))


def test_a_hybrid_engine_merges_its_remote_runs_so_the_cut_keeps_its_checkpoint():
    guard = measured(l2=1e-6, l3=1e-5, prefill=1e-3)
    node = [("l3", 2, 0.01), ("l3_disk", 3, 0.5)]
    assert len(guard.runs(0, 5, node, PAGE_BYTES, hybrid=False)) == 2
    merged = guard.runs(0, 5, node, PAGE_BYTES, hybrid=True)
    assert merged == [LoadRun("l3_disk", 5, pytest.approx(0.51 + 5e-3))]


def test_an_engine_recomputes_a_slow_l3_tail_and_loads_its_l2_head():
    guard = measured(l2=1e-7, l3=1e-3, prefill=1e-4)   # L3: 1 s per page, prefill 1.6 ms
    choice = guard.choose(guard.runs(4, 7, [], PAGE_BYTES, hybrid=False), 16)
    assert (choice.pages, choice.reason) == (4, SLOWER)
    assert [r.tier for r in choice.skipped] == ["l3"]
    # CONTROL: a fast L3 is loaded; nothing measured yet is loaded (the load measures)
    fast = measured(l2=1e-7, l3=1e-8, prefill=1e-4)
    assert fast.choose(fast.runs(4, 7, [], PAGE_BYTES, hybrid=False), 16).pages == 7
    cold = EngineGuard()
    assert cold.choose(cold.runs(4, 7, [], PAGE_BYTES, hybrid=False), 16).pages == 7
    off = EngineGuard(GuardSettings.parse("off"), Rate(1e-4), Rate(1e-7), Rate(1e-3))
    assert off.choose(off.runs(4, 7, [], PAGE_BYTES, hybrid=False), 16).pages == 7


# ------------------------------------------------------------------- SGLang
def answer(pages: int, runs=(), restorable=()) -> PoolTransferResult:
    return PoolTransferResult(pages, {}, list(restorable), list(runs))


def test_hit_runs_use_the_answer_s_runs_only_where_they_cover_the_hit():
    assert hit_runs(answer(5, [("l2", 2, 0.1), ("l3", 3, 0.2)])) == [
        LoadRun("l2", 2, 0.1), LoadRun("l3", 3, 0.2)]
    assert hit_runs(answer(5, [("l2", 2, 0.1)])) == [LoadRun("l3", 5, None)]
    assert hit_runs(answer(0)) == []


def test_restorable_cut_is_the_longest_restorable_prefix_within_the_cut():
    assert restorable_cut(6, []) == 6
    assert restorable_cut(6, [2, 5, 8]) == 5
    assert restorable_cut(1, [2, 5]) == 0


def test_sglang_guard_cuts_a_slow_tail_from_the_answers_runs_and_counts_it():
    guard = HitGuard(GuardSettings(), prefill_s_per_token=1e-4, page_tokens=16)
    counts: Counter[str] = Counter()
    hit = answer(6, [("l2", 2, 1e-4), ("l3", 4, 2.0)])
    pages, choice = guard.guard(hit, 8, counts)
    assert (pages, choice.reason) == (2, SLOWER)
    assert counts == {"asked_tokens": 128, "hit_tokens:l2": 32,
                      "load_guard_skipped_tokens:l3": 64,
                      "load_guard:mixed:slower_than_prefill": 1}
    # CONTROL: the guard off loads the whole hit; fast runs are loaded whole
    off = HitGuard(GuardSettings.parse("off"), 1e-4, 16)
    assert off.guard(hit, 8)[0] == 6
    assert guard.guard(answer(6, [("l2", 2, 1e-4), ("l3", 4, 1e-3)]), 8)[0] == 6


def test_sglang_guard_without_estimates_loads_and_a_threshold_needs_none():
    hit = answer(3)
    assert HitGuard(GuardSettings(), None, 16).guard(hit, 4)[0] == 3   # no prefill rate
    assert HitGuard(GuardSettings(), 1e-4, 16).guard(hit, 4)[0] == 3   # no load runs
    counts: Counter[str] = Counter()
    pages, choice = HitGuard(GuardSettings.parse(64), None, 16).guard(hit, 4, counts)
    assert (pages, choice.reason) == (0, BELOW_THRESHOLD)
    assert counts["load_guard:recompute:below_threshold"] == 1
    assert counts["load_guard_skipped_tokens:l3"] == 48 and "hit_tokens:l3" not in counts
    assert HitGuard(GuardSettings.parse(48), None, 16).guard(hit, 4)[0] == 3  # control


def test_sglang_guard_lowers_its_cut_to_a_restorable_prefix():
    guard = HitGuard(GuardSettings(), 1e-4, 16)
    hit = answer(6, [("l2", 3, 1e-4), ("l3", 3, 2.0)], restorable=[2, 6])
    pages, choice = guard.guard(hit, 6)
    assert pages == 2 and choice.pages == 2 and choice.reason == SLOWER
    assert sum(r.pages for r in choice.skipped) == 4
    assert guard.guard(answer(6, [("l2", 3, 1e-4), ("l3", 3, 1e-3)], [2, 6]), 6)[0] == 6


def test_backend_options_read_and_check_the_guard_keys():
    opts = BackendOptions.from_extra({"load_guard": "off", "prefill_tokens_per_s": 4000})
    assert opts.load_guard == GuardSettings.parse("off")
    assert opts.prefill_s_per_token == pytest.approx(2.5e-4)
    assert BackendOptions.from_extra({"load_guard": 512}).load_guard.threshold_tokens == 512
    defaults = BackendOptions.from_extra({})
    assert defaults.load_guard.mode == "auto" and defaults.prefill_s_per_token is None
    with pytest.raises(ValueError, match="extra-config load_guard 'fast'"):
        BackendOptions.from_extra({"load_guard": "fast"})
    assert BackendOptions.from_extra({"prefill_tokens_per_s": "500"}
                                     ).prefill_s_per_token == pytest.approx(2e-3)
    for bad in (0, -5, "fast", "nan", True, float("inf"), [1000]):
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            BackendOptions.from_extra({"prefill_tokens_per_s": bad})


# -------------------------------------------------------------- token counts
def test_count_lookup_names_each_decision():
    assert decision(LoadChoice(5), 5) == "load"
    assert decision(LoadChoice(0), 5) == "recompute"
    assert decision(LoadChoice(2), 5) == "mixed"
    counts: Counter[str] = Counter()
    count_lookup(counts, 64, LoadChoice(0), {}, 16)          # a miss: no decision
    count_lookup(counts, 64, LoadChoice(2), {"l2": 2}, 16)
    assert counts == {"asked_tokens": 128, "hit_tokens:l2": 32, "load_guard:load:none": 1}


def test_token_metrics_export_what_grew_with_declared_labels(monkeypatch):
    import sys
    from types import SimpleNamespace

    import ray.util
    from raykv.controllers.contract import StorageConfig
    from raykv.integrations.token_metrics import TokenMetrics

    from tests.unit.test_node_metrics import FakeMetric

    made: dict[str, FakeMetric] = {}

    def make(name, *args, **kwargs):
        made[name] = FakeMetric(name, *args, **kwargs)
        return made[name]

    fake = SimpleNamespace(Counter=make)
    monkeypatch.setattr(ray.util, "metrics", fake, raising=False)
    monkeypatch.setitem(sys.modules, "ray.util.metrics", fake)
    config = StorageConfig(tp_rank=0, tp_size=2, model_name="org/m")
    # only the engine's first rank exports (every rank gets the same answers)
    assert TokenMetrics.for_rank({}, StorageConfig(tp_rank=1, tp_size=2)) is None
    counts: Counter[str] = Counter()
    m = TokenMetrics.for_rank(counts, config)
    guard = HitGuard(GuardSettings(), 1e-4, 16)
    guard.guard(answer(6, [("l2", 2, 1e-4), ("l3", 4, 2.0)]), 8, counts)
    m.export()
    m.export()  # nothing grew: nothing more
    assert made["raykv_asked_tokens"].calls == [("inc", 128, {})]
    assert made["raykv_hit_tokens"].calls == [("inc", 32, {"tier": "l2"})]
    assert made["raykv_load_guard_skipped_tokens"].calls == [("inc", 64, {"tier": "l3"})]
    assert made["raykv_load_guard_decisions"].calls == [
        ("inc", 1, {"decision": "mixed", "reason": "slower_than_prefill"})]
    assert made["raykv_asked_tokens"].defaults == {
        "tenant": "(none)", "deployment": "org-m_", "model": "org/m"}
    m.close()
