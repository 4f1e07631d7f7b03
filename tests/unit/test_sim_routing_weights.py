"""The router's weights study (``clusters.sim.routing_weights``, pure): arrivals sped
up keep the requests, every variant and power of two are replayed per point, and the
weights reach the router (control: the same weights give the same figures)."""

from pathlib import Path

import pytest
from raykv.clusters.sim import routing_weights
from raykv.clusters.sim.compare import Setup
from raykv.clusters.sim.costs import Costs
from raykv.clusters.sim.trace import read_trace
from raykv.integrations.serve.ranking import Weights

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
