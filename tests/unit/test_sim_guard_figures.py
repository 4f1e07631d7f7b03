"""benchmarks.md's *Load or recompute in the simulator* tables are the recorded study
(docs/sim_guard.json), and its guard-off runs are the figures recorded before the
guard existed (docs/sim_disk.json, docs/sim_placement.json), exactly."""

import json
from pathlib import Path

import pytest

DOCS = Path(__file__).parent.parent.parent / "docs"
SAME = ("block_hit_rate", "token_hit_rate", "tiers_block", "ttft_s", "network_bytes")


def _tables() -> list[list[list[str]]]:
    text = (DOCS / "benchmarks.md").read_text()
    start = text.index("### Load or recompute in the simulator")
    section = text[start:text.index("\n## ", start)]
    tables = [b for b in section.split("\n\n") if b.lstrip().startswith("| ")]
    return [[[c.strip() for c in line.strip().strip("|").split("|")]
             for line in t.strip().splitlines()[2:]] for t in tables]


def _close(shown: str, value: float) -> bool:
    decimals = len(shown.replace(",", "").partition(".")[2])
    return float(shown.replace(",", "")) == pytest.approx(value, abs=0.51 * 10 ** -decimals)


def _check(run: dict, hit: str, disk: str, ttft: str, computed: str) -> None:
    assert _close(hit, 100 * run["block_hit_rate"])
    assert _close(disk, 100 * run["tiers_block"]["l3_disk"])
    p50, p99 = ttft.split(" / ")
    assert _close(p50, run["ttft_s"]["p50"]) and _close(p99, run["ttft_s"]["p99"])
    want = run["load_guard"]["blocks_skipped"] if "load_guard" in run else "-"
    assert computed.replace(",", "") == str(want)


def test_the_tables_are_the_recorded_study():
    study = json.loads((DOCS / "sim_guard.json").read_text())
    capacities, links = _tables()
    assert len(capacities) == sum(len(c["runs"]) for t in study["capacities"].values()
                                  for c in t.values()) == 14
    for trace_cap, guard, hit, disk, ttft, computed in capacities:
        trace, cap = trace_cap.split(", ")
        _check(study["capacities"][trace][cap]["runs"][guard.strip("`")], hit, disk, ttft,
               computed)
    points = {p["link_gbit"]: p["runs"] for p in study["links"]["points"]}
    assert len(links) == sum(len(r) for r in points.values()) == 15
    for link, guard, hit, disk, ttft, computed in links:
        _check(points[float(link.split()[0]) / (1000 if "Mbit" in link else 1)]
               [guard.strip("`")], hit, disk, ttft, computed)


def test_guard_off_is_the_replay_recorded_before_the_guard():
    """CONTROL for every guard figure: with the guard off the simulator gives, to the
    last digit, what it gave before the guard was modelled."""
    study = json.loads((DOCS / "sim_guard.json").read_text())["capacities"]
    disk = json.loads((DOCS / "sim_disk.json").read_text())["by_trace"]
    placement = json.loads((DOCS / "sim_placement.json").read_text())["runs"]
    for trace in ("conversation", "synthetic"):
        before = {"small_disk_4M": disk[trace]["disk_4M"]["runs"]["raykv"],
                  "small": disk[trace]["no_disk"]["runs"]["raykv"],
                  "normal": placement[f"{trace}/default/own"]["result"]["runs"]["raykv"]}
        for cap, old in before.items():
            now = study[trace][cap]["runs"]["off"]
            assert {k: now[k] for k in SAME} == {k: old[k] for k in SAME}, (trace, cap)
            assert "load_guard" not in now


def test_auto_refuses_the_disk_where_it_is_slower_than_prefill():
    """The finding the section states: at the small capacity with the measured disk,
    ``auto`` serves no block from disk and its TTFT p50 and p99 are below always
    loading's; at the normal capacity it stays within 2 % of always loading's p50."""
    study = json.loads((DOCS / "sim_guard.json").read_text())["capacities"]
    for trace in ("conversation", "synthetic"):
        off, auto = (study[trace]["small_disk_4M"]["runs"][g] for g in ("off", "auto"))
        assert off["tiers_block"]["l3_disk"] > 0.2  # CONTROL: always loading reads disk
        assert auto["tiers_block"]["l3_disk"] == 0.0
        assert auto["ttft_s"]["p50"] < off["ttft_s"]["p50"]
        assert auto["ttft_s"]["p99"] < off["ttft_s"]["p99"]
        normal = study[trace]["normal"]["runs"]
        assert normal["auto"]["ttft_s"]["p50"] <= 1.02 * normal["off"]["ttft_s"]["p50"]


def test_the_disk_refused_keeps_its_blocks_out_of_memory():
    """The section's caveat: with the disk refused, the hit rate falls below no disk's
    (a recomputed block's put finds the key on disk and moves nothing). CONTROL: with
    the guard off the disk raises it far above."""
    study = json.loads((DOCS / "sim_guard.json").read_text())["capacities"]
    for trace in ("conversation", "synthetic"):
        runs = study[trace]
        none = runs["small"]["runs"]["off"]["block_hit_rate"]
        assert runs["small_disk_4M"]["runs"]["auto"]["block_hit_rate"] < none
        assert runs["small_disk_4M"]["runs"]["off"]["block_hit_rate"] > 2 * none


def test_the_crossover_lies_between_10_and_25_gbit():
    """Over link speed: ``auto`` is faster than cold prefill at every speed and keeps
    more hits; always loading has the best p50 at 25 Gbit only, and from 1 Gbit down
    its tail runs away."""
    points = {p["link_gbit"]: p["runs"] for p in
              json.loads((DOCS / "sim_guard.json").read_text())["links"]["points"]}
    assert sorted(points) == [0.01, 0.1, 1.0, 10.0, 25.0]
    for gbit, runs in points.items():
        auto, off, never = (runs[g] for g in ("auto", "off", "never"))
        assert auto["ttft_s"]["p50"] < never["ttft_s"]["p50"]
        assert auto["block_hit_rate"] > never["block_hit_rate"]
        assert (off["ttft_s"]["p50"] < auto["ttft_s"]["p50"]) is (gbit == 25.0)
        if gbit <= 1:
            assert off["ttft_s"]["p99"] > 100 * auto["ttft_s"]["p99"]
