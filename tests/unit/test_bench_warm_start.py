"""The pure parts of the warm-start benchmark (``lab/bench/warm_workload``): the
trace's stretches, what the best cache could give, the per-tier shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from raykv import MiB
from raykv_lab.bench.warm_workload import (
    BLOCK_TOKENS,
    Request,
    Served,
    best_warm,
    by_slice,
    reachable,
    read_trace,
    shares,
    stretches,
)


def req(at_s: float, *blocks: int, last: int = BLOCK_TOKENS) -> Request:
    return Request(at_s, BLOCK_TOKENS * (len(blocks) - 1) + last, blocks)


def test_a_request_s_last_block_holds_what_is_left_of_its_prompt():
    assert req(0, 1, 2, 3, last=7).block_tokens() == [512, 512, 7]
    assert req(0, 1).block_tokens() == [512]


def test_read_trace_orders_by_arrival_and_refuses_a_prompt_its_blocks_cannot_hold(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 2000, "input_length": 600, "hash_ids": [0, 5]},
        {"timestamp": 500, "input_length": 10, "hash_ids": [0]}]) + "\n")
    assert read_trace(path) == [Request(0.5, 10, (0,)), Request(2.0, 600, (0, 5))]
    path.write_text(json.dumps({"timestamp": 0, "input_length": 512, "hash_ids": [0, 1]}))
    with pytest.raises(ValueError, match="t.jsonl:1"):
        read_trace(path)
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": []}))
    with pytest.raises(ValueError, match="0 blocks"):
        read_trace(path)


def test_stretches_split_at_the_join_and_end_after_it():
    rs = [req(t, t) for t in (0, 1, 2, 3, 4)]
    first, then = stretches(rs, 2, 2)
    assert first == rs[:2] and then == rs[2:4]
    for bad in [(0, 1), (1, 0), (10, 5)]:
        with pytest.raises(ValueError):
            stretches(rs, *bad)


def test_reachable_splits_leading_blocks_by_who_had_them_first():
    first = [req(0, 1, 2), req(1, 1, 3)]
    then = [req(5, 1, 2, 9, last=100),  # 1, 2 earlier; 9 new
            req(6, 1, 2, 9, 10),         # 1, 2 earlier; 9 own; 10 new
            req(7, 1, 4, 2)]             # 1 earlier; 4 new, so 2 after it is new too
    got = reachable(first, then)
    assert {k: v["pages"] for k, v in got.items()} == {"earlier": 5, "own": 1, "new": 4}
    assert got["new"]["tokens"] == 100 + 3 * BLOCK_TOKENS


def test_shares_count_tokens_per_tier_and_sum_to_one():
    rs = [req(0, 1, 2, 3, last=12), req(1, 1, 4)]
    got = shares(rs, [Served(1, 1), Served(2, 0)])
    assert {t: got[t]["pages"] for t in got} == {"l2": 3, "l3": 1, "missed": 1}
    assert got["missed"]["tokens"] == 12
    assert got["l2"]["share"] == pytest.approx(3 * 512 / (4 * 512 + 12))
    assert sum(t["share"] for t in got.values()) == pytest.approx(1)
    with pytest.raises(ValueError):
        shares(rs, [Served(1, 1)])
    with pytest.raises(ValueError):
        shares(rs, [Served(2, 2), Served(0, 0)])  # more served than the request has


def test_by_slice_groups_requests_by_arrival_from_the_join():
    rs = [req(100.5, 1), req(104, 2), req(125, 3)]
    got = by_slice(rs, [Served(1, 0), Served(0, 1), Served(0, 0)], 100, 10)
    assert [(s["from_s"], s["requests"]) for s in got] == [(0, 2), (20, 1)]
    assert got[0]["l2"]["share"] == got[0]["l3"]["share"] == 0.5
    assert got[1]["missed"]["share"] == 1.0
    with pytest.raises(ValueError):
        by_slice(rs, [Served(0, 0)] * 3, 100, 0)


def test_best_warm_takes_the_blocks_leading_the_most_requests_whole_leading_parts_first():
    first = [req(0, 1, 2, 3), req(1, 7, 8)]
    then = [req(5, 1, 2, 3), req(6, 1, 2, 9), req(7, 1, 4), req(8, 7, 8, last=10)]
    # leads: 1 x3, 2 x2, 3 x1, 7 x1, 8 x1 (10 tokens)
    assert best_warm(first, then, 1) == {"pages": 3, "tokens": 3 * 512}
    assert best_warm(first, then, 2) == {"pages": 5, "tokens": 5 * 512}
    # ties: the earlier place first (7 before 3 and 8 would be as good; 8 never before 7)
    assert best_warm(first, then, 3)["pages"] == 6
    assert best_warm(first, then, 99) == {
        "pages": reachable(first, then)["earlier"]["pages"],
        "tokens": reachable(first, then)["earlier"]["tokens"]}
    assert best_warm(first, then, 0) == {"pages": 0, "tokens": 0}


# ------------------------------------------- the recorded run docs/benchmarks.md quotes
ROOT = Path(__file__).resolve().parents[2]
RUN = json.loads((ROOT / "docs" / "warm_start.json").read_text())


def warm_start_lines(run: dict) -> list[str]:
    """The lines of docs/benchmarks.md that carry the recorded run's figures, rendered
    from ``run`` (docs/warm_start.json)."""
    st, m = run["settings"], run["machine"]
    lines = [f"`{run['command']}`", f"Recorded {run['date']}",
             f"[`warm_start.json`](warm_start.json), {run['seconds']:.0f} s;",
             f"load average {m['load_avg_start'][0]:.1f} when it started and "
             f"{m['load_avg_end'][0]:.1f} when it ended"]
    for name, t in run["traces"].items():
        total = sum(v["tokens"] for v in t["reachable"].values())
        share = {k: v["tokens"] / total for k, v in t["reachable"].items()}
        lines.append(
            f"| {name} | {t['first_requests']} ({t['first_pages']:,} pages, "
            f"{t['first_distinct_pages']:,} distinct) | {t['then_requests']} "
            f"({sum(v['pages'] for v in t['reachable'].values()):,} pages) | "
            f"{share['earlier']:.1%} | {share['own']:.1%} | {share['new']:.1%} | " +
            " / ".join(f"{t['best_warm'][str(n)]['tokens'] / total:.1%}"
                       for n in st["warm_pages"]) + " |")
        for budget, r in t["runs"].items():
            s, w = r["shares"], r["warmup"]
            first = r["by_slice"][0]
            cost = "-" if w is None else (f"{w['pages']:,} pages, {w['bytes'] / MiB:.0f} "
                                          f"MiB, {w['seconds']:.2f} s, {w['stopped']}")
            lines.append(
                f"| {name} | {'off' if budget == '0' else budget} | {s['l2']['share']:.1%} | "
                f"{s['l3']['share']:.1%} | {s['missed']['share']:.1%} | "
                f"{first['l2']['share']:.1%} | {cost} | {r['wrong_pages']} |")
    quarter = str(st["warm_pages"][0])
    gains, best = [], []
    for t in run["traces"].values():
        l2 = {k: r["shares"]["l2"]["share"] for k, r in t["runs"].items()}
        gains.append(f"+{100 * (l2[quarter] - l2['0']):.1f}")
        total = sum(v["tokens"] for v in t["reachable"].values())
        best.append(f"{t['best_warm'][quarter]['tokens'] / total:.1%}")
    lines.append(f"into L2: {' and '.join(gains)} points of L2 with a quarter of the pool, "
                 f"where a warm-up that chose well could have served {' and '.join(best)} "
                 "of the tokens")
    return lines


def last_seen_lead(trace: str, before_s: float, after_s: float,
                   budgets: tuple[int, ...]) -> tuple[list[int], int]:
    """How often the ``budgets`` blocks first seen last before the join lead a request of
    the minute after it (as leading blocks the first stretch had), and how often any
    block of the first stretch does."""
    first, then = stretches(read_trace(ROOT / "tests" / "data" / "traces" / trace),
                            before_s, after_s)
    order = list(dict.fromkeys(b for r in first for b in r.blocks))
    seen = set(order)
    leading = []
    for r in then:
        for b in r.blocks:
            if b not in seen:
                break
            leading.append(b)
    return [sum(b in set(order[-n:]) for b in leading) for n in budgets], len(leading)


def test_benchmarks_md_says_how_often_the_blocks_put_last_lead_the_minute():
    st = RUN["settings"]
    said = []
    for trace in ("conversation", "synthetic"):
        counts, total = last_seen_lead(f"{trace}_trace.jsonl", st["before_s"],
                                       st["after_s"], tuple(st["warm_pages"]))
        said.append(f"{' and '.join(map(str, counts))} times of {total:,} ({trace})")
    line = f"lead requests of the minute {' and '.join(said)}"
    flat = " ".join((ROOT / "docs" / "benchmarks.md").read_text().split())
    assert line in flat, line


def test_benchmarks_md_quotes_the_recorded_warm_start_run():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    flat = " ".join(text.split())
    lines = warm_start_lines(RUN)
    assert [line for line in lines if " ".join(line.split()) not in flat] == []
    assert "[`warm_start.json`](warm_start.json)" in text
    # CONTROL: another run's figures (one share changed) are caught
    other = json.loads(json.dumps(RUN))
    run = next(iter(other["traces"].values()))["runs"]["0"]
    run["shares"]["l2"]["share"] += 0.01
    assert any(" ".join(line.split()) not in flat for line in warm_start_lines(other))


def test_the_recorded_shares_agree_with_the_joined_node_s_own_counters():
    """Per run of docs/warm_start.json: the pages the rank counted from L2 and from L3
    are its L2 pool's hits and the node's fills; every block was saved; none read was
    wrong; the warm-up read what it chose, within its budget."""
    for t in RUN["traces"].values():
        for budget, r in t["runs"].items():
            assert r["shares"]["l2"]["pages"] == r["l2"]["hits"]
            assert r["shares"]["l3"]["pages"] == r["l2"]["filled"]
            assert r["unsaved"] == r["old_unsaved"] == r["wrong_pages"] == 0
            w = r["warmup"]
            assert (w is None) == (budget == "0")
            if w is not None:
                assert w["pages"] == w["chosen"] == r["l2"]["warmed"] <= int(budget)
