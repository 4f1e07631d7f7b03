"""The disk-tier benchmark (``lab/bench/disk_tier``): its trace sample and LRU
references (pure), and the recorded run docs/benchmarks.md quotes (docs/disk_tier.json):
whole, every page read checked, and quoted as rendered here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from raykv import KiB
from raykv_lab.bench.disk_tier import conversation_sample, lru_hit_rate
from raykv_lab.bench.warm_workload import BLOCK_TOKENS, Request

ROOT = Path(__file__).resolve().parents[2]
RUN = json.loads((ROOT / "docs" / "disk_tier.json").read_text())


def req(at_s: float, *blocks: int) -> Request:
    return Request(at_s, BLOCK_TOKENS * len(blocks), blocks)


def test_the_sample_draws_whole_groups_until_enough_distinct_blocks_in_arrival_order():
    # groups by second block: 1 (three requests), 2, 3; a one-block request is its own
    rs = [req(0, 0, 1), req(1, 0, 2, 5), req(2, 0, 1, 6), req(3, 0, 3), req(4, 0, 1, 6, 7),
          req(5, 9)]
    got = conversation_sample(rs, 5, seed=0)
    assert got == sorted(got, key=lambda r: r.at_s)
    assert len({b for r in got for b in r.blocks}) >= 5
    groups = {r.blocks[min(1, len(r.blocks) - 1)] for r in got}
    assert [r for r in rs if r.blocks[min(1, len(r.blocks) - 1)] in groups] == got
    assert conversation_sample(rs, 5, seed=0) == got  # seeded
    with pytest.raises(ValueError, match="fewer than 10"):
        conversation_sample(rs, 10)


def test_lru_hit_rate_counts_leading_blocks_over_all_blocks():
    rs = [req(0, 1, 2), req(1, 1, 2, 3), req(2, 4), req(3, 1, 2)]
    assert lru_hit_rate(rs, 100) == pytest.approx((0 + 2 + 0 + 2) / 8)
    # 3 blocks: request 3 pushes 1 out (2, 3, 4 left), so the last request finds nothing
    assert lru_hit_rate(rs, 3) == pytest.approx((0 + 2 + 0 + 0) / 8)


# ---------------------------------------- the recorded run docs/benchmarks.md quotes
def page_name(page: str) -> str:
    n = int(page)
    return f"{n // KiB} KiB" if n < 1024 * KiB else f"{n // (1024 * KiB)} MiB"


def doc_lines(run: dict) -> list[str]:
    """The lines of docs/benchmarks.md's *Disk tier* section that carry the run's
    figures, rendered from ``run``."""
    m, st = run["machine"], run["settings"]
    lines = [f"Recorded {run['date']} ([`disk_tier.json`](disk_tier.json), "
             f"{run['seconds']:.0f} s; load average {m['load_avg_start'][0]:.1f} when it "
             f"started, {m['load_avg_end'][0]:.1f} when it ended), command `{run['command']}`"]
    for name in ("sealed", "raw"):
        d = run["device"][name]
        lines.append(f"| {name} | {d['cold']['median_gbps']:.2f} | "
                     f"{d['warm']['median_gbps']:.2f} | {d['direct']['median_gbps']:.2f} | "
                     f"{d['files']} files, {d['bytes'] / 2**20:.0f} MiB |")
    for page in map(str, st["pages"]):
        for name in ("sealed", "raw"):
            g, r = run["disk_gets"][name][page], run["ratios"][name][page]
            lines.append(
                f"| {page_name(page)} | {name} | {g['cold']['median_gbps']:.2f} | "
                f"**{r['cold_vs_device']:.2f}x** | {g['warm']['median_gbps']:.2f} | "
                f"**{r['warm_vs_device']:.2f}x** | {r['cold_vs_direct']:.2f}x | "
                f"{g['on_disk']} |")
    seal = run["seal"]
    for page in map(str, st["pages"]):
        mem, ms = run["memory_gets"], seal["ms_per_batch"][page]
        lines.append(
            f"| {page_name(page)} | {mem['sealed'][page]['median_gbps']:.2f} | "
            f"{mem['raw'][page]['median_gbps']:.2f} | "
            f"**{seal['sealed_vs_raw_memory'][page]:.2f}x** | {ms['sealed']:.1f} | "
            f"{ms['raw']:.1f} | {ms['lookup']:.2f} | {ms['checks']:.1f} | "
            f"{seal['check'][page]['ms_per_mib']:.2f} |")
    h = run["hit_rate"]
    lines.append(f"| with a disk tier | **{h['disk']['hit_rate']:.1%}** | "
                 f"{h['disk']['served'].get('memory', 0):,} | "
                 f"{h['disk']['served'].get('disk', 0):,} | {h['disk']['put_seconds']:.0f} |")
    lines.append(f"| memory only | **{h['memory_only']['hit_rate']:.1%}** | "
                 f"{h['memory_only']['served'].get('memory', 0):,} | 0 | "
                 f"{h['memory_only']['put_seconds']:.0f} |")
    w = h["whole_trace"]
    lines.append(f"{h['requests']} requests, {h['distinct_blocks']:,} distinct blocks, "
                 f"{h['disk']['blocks']:,} blocks looked up; one LRU of the segment's "
                 f"{h['capacity_objects']} objects would hit {h['lru_segment']:.1%}, an "
                 f"unbounded one {h['lru_unbounded']:.1%}; over the whole trace, an LRU "
                 f"of a quarter of its {w['distinct_blocks']:,} distinct blocks "
                 f"{w['lru_quarter']:.1%}, an unbounded one {w['lru_unbounded']:.1%}")
    return lines


def test_benchmarks_md_quotes_the_recorded_disk_tier_run():
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    flat = " ".join(text.split())
    assert [line for line in doc_lines(RUN) if " ".join(line.split()) not in flat] == []
    # CONTROL: another run's figures (one ratio changed) are caught
    other = json.loads(json.dumps(RUN))
    other["ratios"]["sealed"][str(2**20)]["cold_vs_device"] += 0.01
    assert any(" ".join(line.split()) not in flat for line in doc_lines(other))


def test_the_recorded_run_is_whole():
    """Every page read was checked and none was wrong or missing; the disk figures are
    of objects on disk alone (none came back to memory, the sealed client counted them
    as disk hits); nothing of the replay went unsaved."""
    passes = 2 * RUN["settings"]["passes"] + 1  # cold, one into the page cache, warm
    for name, gets in RUN["disk_gets"].items():
        for page, g in gets.items():
            assert g["wrong"] == g["failed"] == g["in_memory_after"] == 0, (name, page)
            assert g["read"] == passes * g["on_disk"] > 0
    served = RUN["slots"]["sealed"]["tier_stats"]["served"]
    assert served["disk"] == passes * sum(
        g["on_disk"] for g in RUN["disk_gets"]["sealed"].values())
    for gets in RUN["memory_gets"].values():
        assert all(g["wrong"] == g["failed"] == 0 for g in gets.values())
    for h in (RUN["hit_rate"]["disk"], RUN["hit_rate"]["memory_only"]):
        assert h["wrong"] == h["unsaved"] == 0
        assert sum(h["served"].values()) == h["hits"]
