"""benchmarks.md's placement table is the recorded ``raykv sim`` runs
(docs/sim_placement.json), and the product's default placement is the one it chose."""

import json
from pathlib import Path

import pytest
from raykv.controllers.node_settings import NodeSettings

DOCS = Path(__file__).parent.parent.parent / "docs"
CAPACITY = {"1M + 2M": "default", "64K + 128K": "small"}


def _rows() -> list[list[str]]:
    text = (DOCS / "benchmarks.md").read_text()
    section = text[text.index("### Placement"):text.index("### The router's weights")]
    table = section[section.index("| trace, capacity |"):].split("\n\n")[0]
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def _close(shown: str, value: float) -> bool:
    decimals = len(shown.replace(",", "").partition(".")[2])
    return float(shown.replace(",", "")) == pytest.approx(value, abs=0.51 * 10 ** -decimals)


def test_the_placement_table_is_the_recorded_runs():
    runs = json.loads((DOCS / "sim_placement.json").read_text())["runs"]
    rows = _rows()
    assert len(rows) == len(runs) == 8
    for trace_cap, placement, hit, own, other, ttft, net in rows:
        trace, cap = trace_cap.split(", ")
        entry = runs[f"{trace}/{CAPACITY[cap]}/{placement.strip('`')}"]
        r = entry["result"]["runs"]["raykv"]
        assert entry["result"]["setup"]["placement"] == placement.strip("`")
        assert _close(hit, 100 * r["block_hit_rate"])
        assert _close(own, 100 * r["tiers_block"]["l3_own"])
        assert _close(other, 100 * r["tiers_block"].get("l3_remote", 0.0))
        p50, p99 = ttft.split(" / ")
        assert _close(p50, r["ttft_s"]["p50"]) and _close(p99, r["ttft_s"]["p99"])
        assert _close(net, r["network_bytes"] / 1e9)


def test_own_is_the_default_and_moves_fewer_bytes():
    runs = json.loads((DOCS / "sim_placement.json").read_text())["runs"]
    assert NodeSettings().placement == "own"
    for key in {k.rsplit("/", 1)[0] for k in runs}:
        own, other = (runs[f"{key}/{p}"]["result"]["runs"]["raykv"] for p in ("own", "any"))
        assert own["network_bytes"] < other["network_bytes"]  # control: any moves more
