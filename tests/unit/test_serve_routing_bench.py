"""The pure parts of the end-to-end routing benchmark: its seeded workload
(``serve_workload``) and its arithmetic (``serve_summary``)."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
from raykv_lab.bench.serve_summary import Outcome, percentile, summarize, verdict
from raykv_lab.bench.serve_workload import WorkloadShape, workload

SMALL = WorkloadShape(sessions=3, turns=4, opening_words=20, user_words=5, answer_words=3,
                      docs=2, doc_words=30, questions=3, question_words=4, rate=2.0)


def test_the_workload_is_the_same_for_a_seed_and_differs_across_seeds():
    assert workload(SMALL, 3) == workload(SMALL, 3)
    assert workload(SMALL, 3) != workload(SMALL, 4)


def test_each_turn_extends_the_previous_prompt_with_an_answer_and_user_text():
    sessions = [s for s in workload(SMALL, 0) if s.kind == "session"]
    assert len(sessions) == SMALL.sessions
    for s in sessions:
        assert len(s.prompts) == len(s.think_s) == SMALL.turns and s.think_s[0] == 0
        for before, after in pairwise(s.prompts):
            assert after.startswith(before)
            added = after[len(before):]
            assert added.startswith("\nAnswer:") and "\nUser:" in added
            # whole words joined by spaces: a tokenizer splits the prefix alike
            assert len(added.split()) == 2 + SMALL.answer_words + SMALL.user_words


def test_questions_share_their_document_and_ask_different_things():
    questions = [s for s in workload(SMALL, 0) if s.kind == "question"]
    assert len(questions) == SMALL.docs * SMALL.questions
    for j in range(SMALL.docs):
        prompts = [q.prompts[0] for q in questions if q.name.startswith(f"d{j}q")]
        docs = {p.split("\nQuestion")[0] for p in prompts}
        assert len(docs) == 1 and len(set(prompts)) == SMALL.questions
        assert len(next(iter(docs)).split()) == 2 + SMALL.doc_words


def test_streams_start_at_increasing_times_from_zero():
    starts = [s.start_s for s in workload(SMALL, 0)]
    assert starts[0] == 0 and starts == sorted(starts) and len(set(starts)) == len(starts)
    # the mean gap follows the rate: 50 streams at 2/s span about 25 s
    many = workload(replace(SMALL, sessions=20, questions=10, rate=2.0), 0)
    assert 10 < many[-1].start_s < 50


@pytest.mark.parametrize("field,value", [("turns", 0), ("sessions", -1), ("rate", 0.0),
                                         ("think_s", -1.0), ("docs", 1.5)])
def test_a_bad_shape_is_refused(field, value):
    with pytest.raises(ValueError, match=field):
        replace(SMALL, **{field: value})


def test_percentile_interpolates_between_ranks():
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile(list(map(float, range(101))), 0.95) == pytest.approx(95.0)
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def _o(replica: str | None, prompt: int, cached: int, ttft: float | None = 0.1,
       error: str | None = None) -> Outcome:
    return Outcome("s0", 0, ttft, prompt, cached, replica, error)


def test_summarize_counts_computed_tokens_and_requests_per_replica():
    got = summarize([_o("a", 100, 60, 0.1), _o("a", 100, 20, 0.3), _o("b", 200, 0, 0.2),
                     _o(None, 50, 50, 0.4), _o("b", 0, 0, None, "boom")], ["a", "b", "c"])
    assert got["requests"] == 5 and got["failed"] == 1
    assert got["computed_fraction"] == pytest.approx(1 - 130 / 450)
    assert got["per_replica"] == {"a": 2, "b": 1, "c": 0} and got["unplaced"] == 1
    assert got["requests_max_over_min"] is None  # c ran none
    assert got["ttft_p50_ms"] == pytest.approx(250.0)
    even = summarize([_o("a", 10, 0), _o("b", 10, 0), _o("b", 10, 0)], ["a", "b"])
    assert even["requests_max_over_min"] == 2.0 and even["computed_fraction"] == 1.0


def test_verdict_compares_raykv_with_the_other_routers():
    runs = {"pow2": {"computed_fraction": 0.8, "ttft_p95_ms": 100.0},
            "prefix_affinity": {"computed_fraction": 0.5, "ttft_p95_ms": 50.0},
            "raykv": {"computed_fraction": 0.3, "ttft_p95_ms": 45.0, "per_replica": {},
                      "requests_max_over_min": 3.0, "overhead_p99_ms": 2.0}}
    got = verdict(runs)
    assert got["computed_vs_pow2"] == {"value": pytest.approx(0.375), "target": 0.5,
                                       "met": True}
    assert got["computed_vs_prefix_affinity"]["value"] == pytest.approx(0.6)
    assert got["ttft_p95_vs_prefix_affinity"]["met"] is False  # 0.9 > 0.8
    assert got["requests_max_over_min"]["met"] is False
    assert got["overhead_p99_ms"]["met"] is True
    # a replica that ran nothing is an imbalance past any target, not a missing figure
    runs["raykv"]["requests_max_over_min"] = None
    assert verdict(runs)["requests_max_over_min"]["met"] is False
    assert verdict({"raykv": runs["raykv"]})["computed_vs_pow2"]["met"] is None


def test_computed_floor_counts_each_block_chain_once_and_every_tail():
    from raykv_lab.bench.serve_workload import computed_floor

    a = list(range(10))  # 2 full blocks of 4, a tail of 2
    assert computed_floor([a], 4) == 10
    assert computed_floor([a, a], 4) == 8 + 2 + 2  # the blocks once, both tails
    assert computed_floor([a, a[:8]], 4) == 8 + 2 + 1  # whole blocks: its last token
    other = [99] + a[1:]  # differs in the first block: a chain of its own
    assert computed_floor([a, other], 4) == 8 + 8 + 2 + 2
    assert computed_floor([a[:4] + [7, 7, 7, 7], a], 4) == 4 + 4 + 4 + 1 + 2
    assert computed_floor([], 4) == 0
