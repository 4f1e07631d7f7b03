"""The pure parts of the vLLM tier benchmarks: the block digest check, the LMCache
head to head's bookkeeping, the eviction run's plan and token judgement, and the fault
run's step phases."""

from __future__ import annotations

import pytest
from raykv_lab.bench import lmcache_h2h as h2h
from raykv_lab.bench.block_digests import check_loads
from raykv_lab.bench.l2_eviction import PROMPT_BLOCKS, judge_tokens, schedule, split, tally
from raykv_lab.bench.l2_faults import phases, step_cost


def test_check_loads_accepts_any_saved_version_and_flags_the_rest():
    saved = [{"h1": ["a"], "h2": ["b"]}, {"h1": ["a2"]}]  # h1 saved twice, other bytes
    ok = check_loads(saved, [[["h1", "a"], ["h2", "b"]], [["h1", "a2"]]])
    assert ok == {"checked": 3, "wrong": 0, "never_saved": 0, "examples": []}
    bad = check_loads(saved, [[["h1", "b"]], [["h3", "a"], ["h2", "b"]]])
    assert (bad["checked"], bad["wrong"], bad["never_saved"]) == (3, 1, 1)
    assert bad["examples"] == [["h1", "b"], ["h3", "a"]]
    assert check_loads(saved, [])["checked"] == 0


def test_check_loads_keeps_five_examples():
    res = check_loads([{}], [[[f"h{i}", "x"] for i in range(9)]])
    assert res["never_saved"] == 9 and len(res["examples"]) == 5


@pytest.mark.parametrize("tokens", [256, 4096])
def test_h2h_tokens_are_whole_chunks(tokens):
    assert h2h.check_tokens(tokens) == tokens


@pytest.mark.parametrize("tokens", [0, -256, 1000, 4097])
def test_h2h_refuses_partial_chunks(tokens):
    with pytest.raises(ValueError, match="multiple of 256"):
        h2h.check_tokens(tokens)


def test_h2h_sides_alternate():
    assert [h2h.side_order(r) for r in range(3)] == [
        ("raykv", "lmcache"), ("lmcache", "raykv"), ("raykv", "lmcache")]


def test_h2h_server_args_name_the_shared_l2_folder():
    args = h2h.server_args(5611, "/dev/shm/x")
    assert args[args.index("--port") + 1] == "5611"
    assert args[args.index("--chunk-size") + 1] == "256"
    assert args[args.index("--supported-transfer-mode") + 1] == "auto"
    assert '"base_path": "/dev/shm/x"' in args[args.index("--l2-adapter") + 1]


def test_h2h_answers_are_result_lines_only():
    assert h2h.parse_answer('RESULT {"cached": 3}') == {"cached": 3}
    assert h2h.parse_answer("INFO vLLM says hello") is None


def test_h2h_niced_is_relative_to_this_process():
    import os

    argv = h2h.niced(15, ["python", "x"])
    assert argv[:2] == ["nice", "-n"] and int(argv[2]) == 15 - os.nice(0)
    assert argv[3:] == ["python", "x"]


def test_h2h_lines_keeps_what_one_read_brought_beyond_the_line_it_wanted():
    """Regression: the READY line and the answer after it arriving in one pipe read
    (a buffered reader behind ``select`` would wait for the answer forever)."""
    import subprocess
    import sys
    import time

    text = 'vLLM noise\nREADY\nRESULT {"cached": 7}\n'
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdout.write({text!r})"],
                            stdout=subprocess.PIPE, bufsize=0)
    lines = h2h._Lines(proc, "printer")
    try:
        assert lines.wait(time.monotonic() + 30) == "READY"
        got = lines.wait(time.monotonic() + 30, want=lambda ln: ln.startswith("RESULT"))
        assert h2h.parse_answer(got) == {"cached": 7}
        with pytest.raises(RuntimeError, match="exited with code 0"):
            lines.wait(time.monotonic() + 30)
    finally:
        proc.wait(timeout=30)


def _res(ms: float, tokens: list[int], cached: int = 3968) -> dict:
    return {"ttft_s": ms / 1000, "cached": cached, "tokens": tokens}


def test_h2h_rows_ratios_and_summary():
    own, cold = _res(20, [1, 2]), _res(900, [1, 3])
    rows = []
    for rk, lm in [(50, 100), (80, 100), (30, 60)]:
        row = {"own_prefix_cache": h2h.case_row(own, own, cold)}
        row["raykv"] = {c: h2h.case_row(_res(rk, [1, 2]), own, cold) for c in h2h.CASES}
        row["lmcache"] = {c: h2h.case_row(_res(lm, [1, 3], 4095), own, cold)
                          for c in h2h.CASES}
        row["ratios"] = h2h.round_ratios(row)
        rows.append(row)
    assert rows[0]["ratios"] == {"same_node": 0.5, "cross_node": 0.5}
    assert rows[0]["raykv"]["same_node"] == {"ttft_ms": 50.0, "cached": 3968,
                                             "same_tokens_as_own": True,
                                             "same_tokens_as_cold": False}
    s = h2h.summary(rows)
    assert s["ratio_same_node"] == {"median": 0.5, "min": 0.5, "max": 0.8}
    assert s["raykv_cross_node"]["ttft_ms_median"] == 50.0
    assert s["lmcache_same_node"]["cached"] == [4095]
    assert s["lmcache_same_node"]["same_tokens_as_cold"] == "3/3"
    assert s["lmcache_same_node"]["same_tokens_as_own"] == "0/3"
    assert s["own_prefix_cache_ttft_ms_median"] == 20.0


def test_eviction_schedule_is_seeded_and_in_range():
    plan = schedule(3, 5, 10, seed=4)
    assert plan == schedule(3, 5, 10, seed=4) and plan != schedule(3, 5, 10, seed=5)
    assert len(plan) == 10 and all(len(s) == 3 and all(0 <= i < 5 for i in s)
                                   for s in plan)


def test_eviction_judges_full_and_empty_loads_only():
    cold, restored = [1, 2], [1, 3]

    def judge(loaded: int, tokens: list[int]) -> str:
        return judge_tokens({"loaded": loaded, "tokens": tokens}, cold, restored)

    assert judge(PROMPT_BLOCKS, [1, 3]) == "full_same"
    assert judge(PROMPT_BLOCKS, [1, 2]) == "full_differ"
    assert judge(0, [1, 2]) == "none_same"
    assert judge(0, [1, 3]) == "none_differ"
    assert judge(3, [9]) == "partial"
    assert tally(["a", "b", "a"]) == {"a": 2, "b": 1}


def test_eviction_split_counts_failed_loads_as_recomputed():
    rows = [{"cached": 7 * 128, "loaded": 7, "load_failed": 0},
            {"cached": 7 * 128, "loaded": 3, "load_failed": 4},  # found, 4 not loaded
            {"cached": 0, "loaded": 0, "load_failed": 0}]
    assert split(rows) == {"requests": 3, "blocks_looked_up": 14, "blocks_loaded": 10,
                           "blocks_load_failed": 4, "blocks_recomputed": 11,
                           "requests_by_load": {"full": 1, "partial": 1, "none": 1}}


def test_fault_phases_split_steps_by_the_stop_window():
    starts = [0.0, 1.0, 2.0, 5.5, 9.0]
    ends = [0.9, 1.9, 5.4, 6.0, 9.5]
    by = phases(ends, starts, stop=2.5, cont=6.5)
    assert {k: pytest.approx(v) for k, v in by.items()} == {
        "before": [0.9, 0.9], "stopped": [3.4, 0.5], "after": [0.5]}
    cost = step_cost(by, budget_s=1.0)
    assert cost["stopped"]["steps"] == 2
    assert cost["longest_stopped_extra_budgets"] == pytest.approx(3.4 - 0.9)
    assert step_cost({"before": [], "stopped": [1.0], "after": []}, 1.0)["before"] == {
        "steps": 0}
