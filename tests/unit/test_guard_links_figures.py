"""docs/benchmarks.md's table of the load guard across emulated hosts is the recorded
``docs/bench_guard_links.json``, row for row, and the claims said of it hold there.
Control: a changed figure no longer matches."""

from __future__ import annotations

import json
from pathlib import Path

from raykv_lab.bench.guard_summary import TABLE_COLUMNS, table_row

DOCS = Path(__file__).resolve().parents[2] / "docs"
HEADER = "| " + " | ".join(TABLE_COLUMNS) + " |"


def recorded() -> dict:
    return json.loads((DOCS / "bench_guard_links.json").read_text())


def table(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_the_docs_table_is_the_recorded_run():
    text = (DOCS / "benchmarks.md").read_text()
    want = [table_row(r) for r in recorded()["rows"]]
    assert table(text) == want
    changed = text.replace(f"| {want[0][3]} |", "| 1 |", 1)  # control
    assert table(changed) != want


def test_the_claims_hold_in_the_recorded_run():
    rows = recorded()["rows"]
    assert len(rows) == 12 and all(r["crossover_match"] for r in rows)
    recomputed = [r for r in rows if not r["guard_loaded"]]
    loaded = [r for r in rows if r["guard_loaded"]]
    assert {r["link"] for r in recomputed} == {"10mbit", "100mbit"}
    assert {r["link"] for r in loaded} == {"1gbit", "10gbit"}
    assert min(r["auto_over_cold"] for r in recomputed) >= 0.845  # 0.85x, rounded
    assert max(r["auto_over_cold"] for r in recomputed) <= 1.29
    assert min(r["auto_over_off"] for r in loaded) >= 0.875  # 0.88x, rounded
    assert max(r["auto_over_off"] for r in loaded) <= 1.09
    slow = [r["off_s"] / r["cold_s"] for r in rows if r["link"] == "10mbit"]
    assert min(slow) >= 18 and max(slow) < 24
