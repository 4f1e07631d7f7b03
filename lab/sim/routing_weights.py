"""The router's weights on replayed traces: which ``ranking.Weights`` give the lowest
TTFT, at the load a trace has and at heavier ones (pure; run as
``python -m raykv_lab.sim.routing_weights``).

Each point replays a trace on ``raykv``'s layout of a ``Setup`` (raykv's tiers and
routing) with one set of weights, the trace's arrival times divided by a ``speed``
(2: twice the requests per second, the same requests); power of two routing on the same
tiers is the reference. The figures are the cost model's (``costs``), not a cluster's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Mapping, Sequence

from raykv.integrations.serve.ranking import Weights
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.compare import Setup
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.trace import Request, read_trace

VARIANTS: dict[str, Weights] = {
    "engine_1.2": Weights(engine=1.2),
    "engine_1.2_load_0.3": Weights(engine=1.2, load=0.3),
    "engine_1.2_queue_gap_1": Weights(engine=1.2, max_queue_gap=1),
    "engine_1.2_queue_gap_0": Weights(engine=1.2, max_queue_gap=0),
    "engine_1.1": Weights(engine=1.1),
    "engine_1.05": Weights(engine=1.05),
    "engine_0.9": Weights(engine=0.9),
    "engine_0.9_load_0.3": Weights(engine=0.9, load=0.3),
}
"""The weights compared, each named by what differs from ``Weights()``' other defaults:
the engine tier's weight from above the L2's (1.2, the router's first default) to below
it, and with it a heavier queue (``load``) or a smaller ``max_queue_gap``. The router's
default (``Weights()``) is the one these figures chose."""
SHAPES = ((16, 8, 1.0, 0), (16, 2, 1.0, 0), (16, 2, 4.0, 0), (16, 8, 8.0, 0), (16, 8, 8.0, 1),
          (16, 8, 8.0, 2))
"""(nodes, engines per node, speed, seed) of each point: the trace's own load on 128 and
on 32 engines, four times it on 32, eight times it on 128 (three seeds: an overloaded
cluster's tail depends on the random choices)."""


def faster(requests: Sequence[Request], speed: float) -> list[Request]:
    """``requests`` arriving ``speed`` times as fast (arrival times divided by it)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    return [dataclasses.replace(r, at=r.at / speed) for r in requests]


def figures(tally: dict) -> dict:
    """One run's figures: block hit rate, TTFT p50/p90/p99 (s), idle nodes and the
    busiest node's computed tokens over the mean."""
    return {"block_hit_rate": tally["block_hit_rate"], "ttft_s": tally["ttft_s"],
            "idle_nodes": tally["requests_per_node"]["idle_nodes"],
            "computed_max_over_mean": tally["computed_tokens_max_over_mean"]}


def point(requests: Sequence[Request], setup: Setup, costs: Costs,
          variants: Mapping[str, Weights]) -> dict:
    """Each of ``variants`` and power of two on ``setup``'s raykv tiers: name ->
    ``figures``."""
    layouts = setup.layouts()
    out = {name: figures(ClusterSim(layouts["raykv"], costs, requests, weights=w).run().as_dict())
           for name, w in variants.items()}
    out["pow2"] = figures(ClusterSim(layouts["raykv_pow2"], costs, requests).run().as_dict())
    return out


def study(traces: Mapping[str, Sequence[Request]], costs: Costs,
          shapes: Sequence[tuple[int, int, float, int]] = SHAPES,
          variants: Mapping[str, Weights] = VARIANTS) -> dict:
    """Every trace at every shape with every variant: ``{"variants": {name: weights},
    "points": [{"trace", "nodes", "engines_per_node", "speed", "seed", "runs"}]}``."""
    out: dict = {"variants": {n: dataclasses.asdict(w) for n, w in variants.items()},
                 "costs": dataclasses.asdict(costs), "points": []}
    for name, requests in traces.items():
        for nodes, per_node, speed, seed in shapes:
            setup = Setup(nodes=nodes, engines_per_node=per_node, seed=seed)
            out["points"].append({"trace": name, "nodes": nodes, "engines_per_node": per_node,
                                  "speed": speed, "seed": seed,
                                  "runs": point(faster(requests, speed), setup, costs,
                                                variants)})
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Mooncake JSONL traces (named by file stem)")
    p.add_argument("--limit", type=int, default=None, help="the first N requests of each")
    p.add_argument("--out", default=None, help="write the study as JSON to this file")
    args = p.parse_args(argv)
    traces = {path.rsplit("/", 1)[-1].split("_")[0]: read_trace(path, args.limit)
              for path in args.traces}
    t = time.perf_counter()
    result = study(traces, Costs())
    result["simulator_s"] = round(time.perf_counter() - t, 1)
    for pt in result["points"]:
        print(f"{pt['trace']} {pt['nodes']}x{pt['engines_per_node']} speed {pt['speed']:g} "
              f"seed {pt['seed']}", flush=True)
        for name, f in pt["runs"].items():
            ttft = f["ttft_s"]
            print(f"  {name:22s} hit {100 * f['block_hit_rate']:5.1f}  TTFT p50/p90/p99 "
                  f"{ttft['p50']:.3f} / {ttft['p90']:.3f} / {ttft['p99']:.3f}  idle nodes "
                  f"{f['idle_nodes']}  busiest {f['computed_max_over_mean']:.2f}x")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
