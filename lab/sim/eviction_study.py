"""raykv's L2 eviction policies and the split of a node's host memory between L2 and L3,
replayed through the simulator (pure: no Ray, no Mooncake, no torch).

Run: ``python -m raykv_lab.sim.eviction_study TRACE [TRACE ...] [--limit N]
[--out FILE]``. Per trace, every run a ``raykv`` run (``compare``: L2 and L3 per node,
placement ``own``, raykv's routing) on 16 nodes x 8 engines:

- *policies*: each of ``L2_EVICTIONS`` at each of ``POLICY_POINTS`` (GPU cache per engine,
  L2 and L3 per node, tokens);
- *split*: each of ``SPLIT_POINTS`` (GPU cache per engine, host memory per node) with
  ``SHARES`` of the host memory in L2 (the rest L3; 0: no L2 at all), each policy;
- *seeds*: the product's split (half of the host memory in L2: ``l2_bytes`` and
  ``global_segment_size`` are 1 GiB each by default) at each of ``SPLIT_POINTS``,
  ``lru`` and ``s3fifo``, with each of ``SEEDS`` (routing and placement choices).

Each point also gives the untimed references over the same host memory (``bounds``:
one global LRU, Belady), once per memory size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from raykv.controllers.node_settings import L2_EVICTIONS
from raykv_lab.sim import bounds
from raykv_lab.sim.cluster import ClusterSim
from raykv_lab.sim.compare import Setup
from raykv_lab.sim.costs import Costs
from raykv_lab.sim.trace import BLOCK_TOKENS, Request, read_trace

POLICY_POINTS = ((16_000, 64_000, 128_000), (16_000, 256_000, 128_000),
                 (256_000, 256_000, 2_000_000), (256_000, 1_000_000, 2_000_000))
"""``(gpu_tokens, l2_tokens, l3_tokens)`` of the policy comparison: the small capacity
and the default one of ``raykv sim``, each with a smaller and a larger L2."""
SPLIT_POINTS = ((16_000, 192_000), (256_000, 3_000_000))
"""``(gpu_tokens, host_tokens)`` of the split: the small and the default capacity."""
SHARES = (0.0, 1 / 6, 1 / 3, 1 / 2, 2 / 3)
"""The parts of a node's host memory in L2 (``raykv sim``'s default: a third)."""
SEEDS = (1, 2)
"""The seeds of the *seeds* runs (the others run with seed 0)."""


def run(requests: Sequence[Request], setup: Setup, costs: Costs, l2: bool = True) -> dict:
    """One ``raykv`` run of ``setup`` (without ``l2``: no L2 at all): hit rates (blocks,
    tokens, per tier), TTFT, network bytes, the most and fewest requests a node served,
    L2's counters, the simulator's seconds."""
    t = time.perf_counter()
    layout = setup.layouts()["raykv"]
    layout = layout if l2 else dataclasses.replace(layout, l2_blocks=0)
    sim = ClusterSim(layout, costs, requests)
    f = sim.run().as_dict()
    l2 = sim.stats().get("l2", {})
    return {"block_hit_rate": f["block_hit_rate"], "token_hit_rate": f["token_hit_rate"],
            "tiers_block": f["tiers_block"], "ttft_s": f["ttft_s"],
            "network_bytes": f["network_bytes"],
            "requests_per_node": {k: f["requests_per_node"][k] for k in ("max", "min")},
            "l2": {k: l2[k] for k in ("hits", "evicted", "full")} if l2 else {},
            "simulator_s": round(time.perf_counter() - t, 2)}


def references(requests: Sequence[Request], nodes: int, host_tokens: int) -> dict:
    """One global LRU and Belady over ``nodes`` x ``host_tokens`` of host memory."""
    cap = nodes * (host_tokens // BLOCK_TOKENS)
    return {"host_blocks": cap,
            "global_lru_host": bounds.global_lru(requests, cap).block_rate,
            "belady_host": bounds.belady(requests, cap).block_rate}


def study(requests: Sequence[Request], costs: Costs, base: Setup | None = None) -> dict:
    """The policies and the split (see the module docstring) of ``requests`` on
    ``base``'s nodes (None: ``Setup``'s defaults, 16 x 8)."""
    base = base or Setup()
    out: dict = {"requests": len(requests), "nodes": base.nodes,
                 "engines_per_node": base.engines_per_node, "policies": [], "split": [],
                 "seeds": []}
    refs: dict[int, dict] = {}

    def ref(host: int) -> dict:
        if host not in refs:
            refs[host] = references(requests, base.nodes, host)
        return refs[host]

    for gpu, l2, l3 in POLICY_POINTS:
        point = {"gpu_tokens": gpu, "l2_tokens": l2, "l3_tokens": l3,
                 "bounds": ref(l2 + l3), "runs": {}}
        for name in L2_EVICTIONS:
            setup = dataclasses.replace(base, gpu_tokens=gpu, l2_tokens=l2, l3_tokens=l3,
                                        l2_eviction=name)
            point["runs"][name] = run(requests, setup, costs)
        out["policies"].append(point)
    for gpu, host in SPLIT_POINTS:
        point = {"gpu_tokens": gpu, "host_tokens": host, "bounds": ref(host), "runs": {}}
        for share in SHARES:
            l2 = round(host * share / BLOCK_TOKENS) * BLOCK_TOKENS
            runs = point["runs"][f"{share:.3f}"] = {"l2_tokens": l2}
            for name in L2_EVICTIONS if l2 else ("lru",):
                setup = dataclasses.replace(base, gpu_tokens=gpu, l3_tokens=host - l2,
                                            l2_tokens=max(l2, BLOCK_TOKENS), l2_eviction=name)
                runs[name] = run(requests, setup, costs, l2 > 0)
        out["split"].append(point)
    for gpu, host in SPLIT_POINTS:
        point = {"gpu_tokens": gpu, "host_tokens": host, "l2_tokens": host // 2, "runs": {}}
        for seed in SEEDS:
            for name in ("lru", "s3fifo"):
                setup = dataclasses.replace(base, gpu_tokens=gpu, l2_tokens=host // 2,
                                            l3_tokens=host - host // 2, l2_eviction=name,
                                            seed=seed)
                point["runs"][f"{name}/{seed}"] = run(requests, setup, costs)
        out["seeds"].append(point)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("traces", nargs="+", help="Mooncake JSONL traces")
    p.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    p.add_argument("--out", type=Path, default=Path("raykv-out/sim_eviction.json"))
    a = p.parse_args(argv)
    started = time.perf_counter()
    result: dict = {"command": "python -m raykv_lab.sim.eviction_study " + shlex.join(
        sys.argv[1:] if argv is None else argv), "costs": dataclasses.asdict(Costs()),
        "traces": {}}
    for trace in a.traces:
        result["traces"][Path(trace).name] = study(read_trace(trace, a.limit), Costs())
    result["seconds"] = round(time.perf_counter() - started, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, r in result["traces"].items():
        for pt in r["policies"]:
            print(f"{name} gpu {pt['gpu_tokens']} l2 {pt['l2_tokens']} l3 {pt['l3_tokens']}: "
                  + ", ".join(f"{n} {x['block_hit_rate']:.4f}" for n, x in pt["runs"].items())
                  + f"; belady_host {pt['bounds']['belady_host']:.4f}")
        for pt in r["split"]:
            for s, x in pt["runs"].items():
                print(f"{name} gpu {pt['gpu_tokens']} host {pt['host_tokens']} L2 {s}: "
                      + ", ".join(f"{n} {r['block_hit_rate']:.4f} ({r['ttft_s']['p50']:.2f} s)"
                                  for n, r in x.items() if n != "l2_tokens"))
        for pt in r["seeds"]:
            print(f"{name} gpu {pt['gpu_tokens']} host {pt['host_tokens']} L2 half: " + ", ".join(
                f"{n} {x['block_hit_rate']:.4f}" for n, x in pt["runs"].items()))
    print(f"wrote {a.out} ({result['seconds']} s)")


if __name__ == "__main__":
    main()
