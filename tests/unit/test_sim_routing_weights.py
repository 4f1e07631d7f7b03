"""The router's weights study (``lab.sim.routing_weights``, pure): arrivals sped
up keep the requests, every variant and power of two are replayed per point, and the
weights reach the router (control: the same weights give the same figures); the docs'
tables are the recorded figures and the router's default is the set they chose."""

import dataclasses
import json
from pathlib import Path

import pytest
from raykv.integrations.serve.ranking import Weights
from raykv.integrations.serve.route_keys import RouteOptions
from raykv_lab.sim import routing_weights
from raykv_lab.sim.compare import Setup
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.trace import read_trace

TRACE = Path(__file__).parent.parent / "data" / "traces" / "conversation_trace.jsonl"


def test_faster_divides_arrivals_and_keeps_the_requests():
    requests = read_trace(TRACE, 50)
    fast = routing_weights.faster(requests, 4)
    assert [r.at * 4 for r in fast] == pytest.approx([r.at for r in requests])
    assert [r.blocks for r in fast] == [r.blocks for r in requests]
    with pytest.raises(ValueError, match="speed"):
        routing_weights.faster(requests, 0)


def test_the_weights_reach_the_router():
    requests = routing_weights.faster(read_trace(TRACE, 300), 8)
    setup = Setup(nodes=4, engines_per_node=2, gpu_tokens=16_000, l2_tokens=64_000,
                  l3_tokens=128_000)
    variants = {"default": Weights(), "same": Weights(), "no_load": Weights(load=0.0,
                                                                            max_queue_gap=99)}
    runs = routing_weights.point(requests, setup, Costs(), variants)
    assert set(runs) == {"default", "same", "no_load", "pow2"}
    assert runs["same"] == runs["default"]          # control: the same weights, same run
    assert runs["no_load"] != runs["default"]       # queues ignored: other choices


def test_study_covers_every_trace_and_shape():
    requests = read_trace(TRACE, 40)
    out = routing_weights.study({"a": requests, "b": requests}, Costs(),
                                shapes=((2, 1, 1.0, 0), (2, 2, 2.0, 1)),
                                variants={"default": Weights()})
    assert [(p["trace"], p["engines_per_node"], p["seed"]) for p in out["points"]] == \
        [("a", 1, 0), ("a", 2, 1), ("b", 1, 0), ("b", 2, 1)]
    assert all(set(p["runs"]) == {"default", "pow2"} for p in out["points"])


DOCS = Path(__file__).parent.parent.parent / "docs"
COLUMNS = [(16, 8, 1.0, 0), (16, 2, 1.0, 0), (16, 2, 4.0, 0), (16, 8, 8.0, 0), (16, 8, 8.0, 1),
           (16, 8, 8.0, 2)]


def _tables() -> dict[str, dict[str, list[str]]]:
    """benchmarks.md's two tables of the router's weights: trace -> row name -> cells."""
    text = (DOCS / "benchmarks.md").read_text()
    section = text[text.index("### The router's weights"):]
    out: dict[str, dict[str, list[str]]] = {}
    for trace in ("conversation", "synthetic"):
        block = section[section.index(f"| {trace} trace: TTFT"):].split("\n\n")[0]
        rows = [line.strip("|").split("|") for line in block.splitlines()[2:]]
        out[trace] = {r[0].strip(): [c.strip() for c in r[1:]] for r in rows}
    return out


def _name(row: str) -> str:
    row = row.replace("*", "")
    return "pow2" if row == "power of two" else row.split("`")[1]


def test_the_docs_tables_are_the_recorded_figures():
    recorded = json.loads((DOCS / "sim_routing.json").read_text())
    points = {(p["trace"], p["nodes"], p["engines_per_node"], p["speed"], p["seed"]): p["runs"]
              for p in recorded["points"]}
    for trace, rows in _tables().items():
        for row, cells in rows.items():
            for (nodes, per_node, speed, seed), cell in zip(COLUMNS, cells, strict=True):
                ttft = points[(trace, nodes, per_node, speed, seed)][_name(row)]["ttft_s"]
                for q, shown in zip(("p50", "p99"), cell.split(" / "), strict=True):
                    decimals = len(shown.partition(".")[2])
                    assert float(shown) == pytest.approx(ttft[q], abs=0.51 * 10 ** -decimals), \
                        (trace, row, nodes, per_node, speed, seed, q)


def test_the_routers_default_is_the_chosen_weights():
    recorded = json.loads((DOCS / "sim_routing.json").read_text())
    chosen = [n for n in _tables()["conversation"] if "(the default)" in n]
    assert len(chosen) == 1
    name = _name(chosen[0])
    assert recorded["variants"][name] == dataclasses.asdict(Weights())
    route = {f.name: f.default for f in dataclasses.fields(RouteOptions)}
    assert route["weight_engine"] == Weights().engine
    # control: the former default is another set of weights
    assert recorded["variants"]["engine_1.2"] != dataclasses.asdict(Weights())
