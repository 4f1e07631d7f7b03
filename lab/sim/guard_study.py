"""Load or recompute on replayed traces: raykv's load guard (``lab.sim.guard``) off,
``auto`` and at a fixed threshold, at two capacities, and over link speeds (pure; run as
``python -m raykv_lab.sim.guard_study``).

Each run replays a trace on ``raykv``'s layout of a ``Setup`` (its tiers, routing and
placement) with one guard setting:

- ``capacities``: the small capacity with a disk tier (16K tokens of GPU cache per
  engine, L2 64K + L3 128K tokens and a 4M-token disk per node: the disk serves a
  quarter to a half of the blocks, at 0.39 GB/s), the same without the disk (the guard
  off: the reference a guard that refuses every disk hit approaches), and the normal
  capacity (256K, 1M + 2M, no disk), each with the guard ``off``, ``auto`` and ``256``;
- ``links``: one trace at the normal capacity with every node's link at each of
  ``LINK_GBIT``, with the guard ``off`` (always load), ``auto`` and ``never`` (a
  threshold no hit reaches: every hit of L2 and L3 computed, the GPU prefix cache kept;
  cold prefill).

The figures are the cost model's (``costs``), not a cluster's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence

from raykv.controllers.load_guard import MAX_THRESHOLD_TOKENS
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.compare import Setup
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.trace import Request, read_trace

GUARDS = ("off", "auto", "256")
"""The settings compared at each capacity: the guard off (raykv before it), the
product's default, a fixed threshold of 256 tokens (SGLang HiCache's kind)."""
NEVER = str(MAX_THRESHOLD_TOKENS)
"""A threshold no hit reaches: every hit of L2 and L3 is computed (``never``)."""
CAPACITIES = {
    "small_disk_4M": Setup(gpu_tokens=16_000, l2_tokens=64_000, l3_tokens=128_000,
                           disk_tokens=4_000_000),
    "small": Setup(gpu_tokens=16_000, l2_tokens=64_000, l3_tokens=128_000),
    "normal": Setup(),
}
"""The capacities (``Setup``'s fields; the guard set per run). ``small`` runs the
guard off only: the reference without the disk."""
LINK_GBIT = (0.01, 0.1, 1.0, 10.0, 25.0)
"""The link speeds of the sweep, Gbit/s each way (25: the cost model's default; a block
crosses a link as fast as the GPU computes it near 11)."""
LINK_GUARDS = {"off": "off", "auto": "auto", "never": NEVER}


def figures(sim: ClusterSim) -> dict:
    """One run's figures: hit rates, the tiers' shares of blocks, TTFT p50/p90/p99 (s),
    network bytes, and the guard's counters (absent when off)."""
    t = sim.run().as_dict()
    out = {k: t[k] for k in ("block_hit_rate", "token_hit_rate", "tiers_block", "ttft_s",
                             "network_bytes")}
    guard = sim.stats().get("load_guard")
    if guard is not None:
        out["load_guard"] = guard
    return out


def run(requests: Sequence[Request], setup: Setup, costs: Costs, guard: str) -> dict:
    """``figures`` of ``setup``'s raykv run with the guard at ``guard``."""
    layout = dataclasses.replace(setup, load_guard=guard).layouts()["raykv"]
    return figures(ClusterSim(layout, costs, requests))


def study(traces: Mapping[str, Sequence[Request]], costs: Costs, sweep_trace: str,
          log=print) -> dict:
    """Every trace at every capacity with every guard, and ``sweep_trace`` at the normal
    capacity over ``LINK_GBIT``: ``{"capacities": {trace: {capacity: {"setup", "runs":
    {guard: figures}}}}, "links": {"trace", "points": [{"link_gbit", "runs"}]}}``."""
    out: dict = {"costs": dataclasses.asdict(costs), "capacities": {},
                 "links": {"trace": sweep_trace, "capacity": "normal", "points": []}}
    for name, requests in traces.items():
        per = out["capacities"][name] = {}
        for cap, setup in CAPACITIES.items():
            guards = ("off",) if cap == "small" else GUARDS
            per[cap] = {"setup": dataclasses.asdict(setup), "runs": {}}
            for g in guards:
                t = time.perf_counter()
                per[cap]["runs"][g] = run(requests, setup, costs, g)
                log(f"{name} {cap} guard {g}: {_line(per[cap]['runs'][g])} "
                    f"({time.perf_counter() - t:.0f} s)")
    for gbit in LINK_GBIT:
        c = dataclasses.replace(costs, link_gbit=gbit)
        point = {"link_gbit": gbit, "runs": {}}
        for label, g in LINK_GUARDS.items():
            if gbit == costs.link_gbit and label in GUARDS:
                point["runs"][label] = out["capacities"][sweep_trace]["normal"]["runs"][label]
            else:
                point["runs"][label] = run(traces[sweep_trace], CAPACITIES["normal"], c, g)
            log(f"{sweep_trace} link {gbit:g} Gbit guard {label}: "
                f"{_line(point['runs'][label])}")
        out["links"]["points"].append(point)
    return out


def _line(f: dict) -> str:
    ttft = f["ttft_s"]
    return (f"hit {100 * f['block_hit_rate']:.1f}  TTFT p50/p90/p99 {ttft['p50']:.3f} / "
            f"{ttft['p90']:.3f} / {ttft['p99']:.3f}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Mooncake JSONL traces (named by file stem)")
    p.add_argument("--sweep-trace", default="conversation",
                   help="the trace of the link sweep (a file stem's first word)")
    p.add_argument("--limit", type=int, default=None, help="the first N requests of each")
    p.add_argument("--out", default=None, help="write the study as JSON to this file")
    args = p.parse_args(argv)
    traces = {path.rsplit("/", 1)[-1].split("_")[0]: read_trace(path, args.limit)
              for path in args.traces}
    if args.sweep_trace not in traces:
        p.error(f"--sweep-trace {args.sweep_trace!r}: not one of {list(traces)}")
    started, t = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), time.perf_counter()
    load = os.getloadavg()
    result = {"command": "python -m raykv_lab.sim.guard_study "
                         "tests/data/traces/conversation_trace.jsonl "
                         "tests/data/traces/synthetic_trace.jsonl --out docs/sim_guard.json",
              "date": started, "load_average": {"start": [round(x, 2) for x in load]},
              **study(traces, Costs(), args.sweep_trace)}
    result["load_average"]["end"] = [round(x, 2) for x in os.getloadavg()]
    result["simulator_s"] = round(time.perf_counter() - t, 1)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
