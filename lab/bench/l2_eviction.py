"""vLLM engines churning over more prompts than the nodes' L2 holds: every loaded
block checked against what was saved under its key, where each block came from (L2,
L3 through L2, recomputed), and the nodes' evictions.

Run: ``python -m raykv_lab.bench.l2_eviction [--prompts 12] [--l2-blocks 16]
[--steps 20] [--out DIR]`` (a two-node embedded cluster of its own; Ray must not be
running in this process). Engines (vLLM CPU build, in-process, eager, one OMP thread,
``VLLM_CPU_OMP_THREADS_BIND=nobind``, the demo's tiny random Llama, 128-token blocks,
vLLM's prefix cache off, one deployment): X and Y on node 0 and Z on node 1, each with
raykv's connector and ``l2_blocks`` pages of L2 (one L2 pool per node, shared by the
node's engines), each a ``DigestEngine`` (``block_digests``: SHA-256 of every block it
saves and loads); a reference R (no connector, prefix cache on) on node 1.

Workload: ``prompts`` random 1000-token prompts (7 full blocks each, so ``7 *
prompts`` blocks against ``l2_blocks`` pages per node); per step every engine serves
one prompt drawn at random, all at once; 8 greedy tokens. Checked: every loaded block's
digest is one some engine saved under that page hash (``check_loads``); tokens equal
R's restoring the 7 blocks from its own prefix cache where an engine loaded all 7, R's
cold run where it loaded none (a partial load splits the prefill elsewhere: not
judged). Control: X then loads random values (``digest_engine.corrupt_loads``) for two
prompts, and the check must find every one of those loads wrong. Counted: blocks
loaded and recomputed per engine (worker counters, vLLM's ``num_cached_tokens``), and
per node its L2 pool's ``hits``, ``misses``, ``evicted``, ``filled`` from L3 and its
store gets. Writes ``l2_eviction.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv_lab.bench.block_digests import check_loads

BLOCK = 128
PROMPT = 1000  # tokens: 7 full blocks (the last token is always computed)
PROMPT_BLOCKS = PROMPT // BLOCK
OUTPUT = 8
L2_COUNTS = ("hits", "misses", "evicted", "written", "flushed", "full", "dirty")


def prompt(seed: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 2000) for _ in range(PROMPT)]


def schedule(engines: int, prompts: int, steps: int, seed: int = 0) -> list[list[int]]:
    """Per step, the prompt index each of ``engines`` engines serves (drawn at random
    with a fixed ``seed``)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(prompts) for _ in range(engines)] for _ in range(steps)]


def judge_tokens(out: dict, cold: list[int], restored: list[int]) -> str:
    """How one request's tokens compare (``out["loaded"]``: the blocks its engine's
    worker loaded for it, failed loads not counted): ``full`` / ``none`` (all 7 blocks
    loaded / none, the whole prompt computed) followed by ``_same`` or ``_differ``
    against the reference (R's restore / R's cold run); ``partial`` (not judged)."""
    loaded = out["loaded"]
    if loaded == PROMPT_BLOCKS:
        return "full_same" if out["tokens"] == restored else "full_differ"
    if loaded == 0:
        return "none_same" if out["tokens"] == cold else "none_differ"
    return "partial"


def tally(names: Sequence[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def l2_delta(before: dict, after: dict) -> dict:
    """A node's L2 counters (summed over its pools) and store gets, ``after`` minus
    ``before`` (each a ``node_l2`` result)."""
    return {k: after[k] - before[k] for k in after}


def node_l2(actor) -> dict:
    """A node actor's L2 counters summed over its L2 pools, its fills from L3 and its
    store gets (by name, as the result's rows hold them)."""
    import ray

    stats = ray.get(actor.stats.remote())
    out = {"store_gets": stats.counters.get("get_objects", 0), "filled": stats.l2.filled,
           "fill_failed": stats.l2.fill_failed, "l3_put": stats.l2.l3_put,
           "pages": 0, **dict.fromkeys(L2_COUNTS, 0)}
    for pool in stats.l2.pools.values():
        out["pages"] += pool.pages
        for k in L2_COUNTS:
            out[k] += getattr(pool, k)
    return out


def worker_counts(engines: Sequence) -> list[ConnectorStats]:
    """Each engine's worker connector counters (TP rank 0)."""
    import ray

    return [w[0].counters for w in ray.get([e.worker_stats.remote() for e in engines])]


def churn(engines: Sequence, prompts: Sequence[list[int]], plan: list[list[int]]
          ) -> list[dict]:
    """Run ``plan`` (``schedule``): per step every engine serves its prompt, all at
    once. Per request: step, engine index, prompt index, ``cached`` (vLLM's
    ``num_cached_tokens``: what the lookup found, failed loads included), ``loaded``
    and ``load_failed`` (blocks, from its engine's worker counters over the step: one
    request per engine per step), ``tokens``."""
    import ray

    rows = []
    for step, picks in enumerate(plan):
        w0 = worker_counts(engines)
        outs = ray.get([e.generate.remote(prompts[i], OUTPUT)
                        for e, i in zip(engines, picks, strict=True)])
        w1 = worker_counts(engines)
        rows += [{"step": step, "engine": k, "prompt": i, "cached": o["cached"],
                  "loaded": w1[k].loaded - w0[k].loaded,
                  "load_failed": w1[k].load_failed - w0[k].load_failed,
                  "tokens": o["tokens"]}
                 for k, (i, o) in enumerate(zip(picks, outs, strict=True))]
    return rows


def split(rows: Sequence[dict]) -> dict:
    """Where requests' blocks came from: looked up (found by the lookup), loaded,
    failed (found, then not loaded: recomputed), recomputed in all; requests by what
    their engine loaded (``full``, ``partial``, ``none``)."""
    return {"requests": len(rows),
            "blocks_looked_up": sum(r["cached"] // BLOCK for r in rows),
            "blocks_loaded": sum(r["loaded"] for r in rows),
            "blocks_load_failed": sum(r["load_failed"] for r in rows),
            "blocks_recomputed": sum(PROMPT_BLOCKS - r["loaded"] for r in rows),
            "requests_by_load": tally("full" if r["loaded"] == PROMPT_BLOCKS else
                                      "none" if r["loaded"] == 0 else "partial"
                                      for r in rows)}


def digest_check(engines: Sequence) -> dict:
    """``check_loads`` over what ``engines`` recorded."""
    import ray

    recs = ray.get([e.recorded.remote() for e in engines])
    return check_loads([r["saved"] for r in recs], [r["loaded"] for r in recs])


def corrupt_control(engines: Sequence, victim, prompts: Sequence[list[int]]) -> dict:
    """Control: ``victim`` records anew and serves ``prompts`` (stored already) with
    ``corrupt_loads`` on; the check of its loads against every engine's saves
    (recorded before) must find each of them wrong."""
    import ray

    saved = ray.get([e.recorded.remote() for e in engines])
    ray.get(victim.record.remote(True))
    ray.get(victim.corrupt_loads.remote(True))
    try:
        outs = [ray.get(victim.generate.remote(p, OUTPUT)) for p in prompts]
    finally:
        ray.get(victim.corrupt_loads.remote(False))
    loaded = ray.get(victim.recorded.remote())["loaded"]
    res = check_loads([r["saved"] for r in saved], [loaded])
    res["cached"] = [o["cached"] for o in outs]
    return res


def run(prompts: int, l2_blocks: int, steps: int, out: Path) -> dict:
    import ray
    from raykv.clusters.local import local_settings, start_local
    from raykv_lab.bench.digest_engine import DigestEngine
    from raykv_lab.engines.vllm_actors import ready, start_engine
    from raykv_lab.engines.vllm_model import make_llama

    ps = [prompt(100 + i) for i in range(prompts)]
    with (tempfile.TemporaryDirectory() as tmp,
          start_local(settings=local_settings(global_segment_size=512 << 20),
                      num_nodes=2) as cluster):
        model = make_llama(os.path.join(tmp, "tiny-llama"))
        n0, n1 = cluster.node_ids
        conf = {"model_name": "bench-evict", "l2_blocks": l2_blocks}
        engines = [start_engine(n, model, conf, actor_class=DigestEngine)
                   for n in (n0, n0, n1)]
        ref = start_engine(n1, model, None, enable_prefix_caching=True)
        ready(*engines, ref)
        cold, restored = [], []
        for p in ps:
            cold.append(ray.get(ref.generate.remote(p, OUTPUT))["tokens"])
            again = ray.get(ref.generate.remote(p, OUTPUT))
            if again["cached"] != PROMPT_BLOCKS * BLOCK:
                raise RuntimeError(f"the reference restored {again['cached']} tokens")
            restored.append(again["tokens"])
        actors = [cluster.node_actors[n] for n in (n0, n1)]
        ray.get([e.record.remote(True) for e in engines])
        before = [node_l2(a) for a in actors]
        w0 = worker_counts(engines)
        t0 = time.monotonic()
        rows = churn(engines, ps, schedule(len(engines), prompts, steps))
        seconds = time.monotonic() - t0
        w1 = worker_counts(engines)
        deadline = time.monotonic() + 30
        while any(node_l2(a)["dirty"] for a in actors) and time.monotonic() < deadline:
            time.sleep(0.1)  # write-behind done: the counters are settled
        after = [node_l2(a) for a in actors]
        check = digest_check(engines)
        control = corrupt_control(engines, engines[0], ps[:2])
        for e in engines:
            ray.get(e.record.remote(False))
        judged = [judge_tokens(r, cold[r["prompt"]], restored[r["prompt"]]) for r in rows]
        workers = [{k: getattr(w1[i], k) - getattr(w0[i], k)
                    for k in ("loaded", "l2_loaded", "load_failed", "saved", "l2_saved",
                              "save_dropped", "save_failed")}
                   for i in range(len(engines))]
        result = {
            "prompts": prompts, "prompt_tokens": PROMPT, "blocks_per_prompt": PROMPT_BLOCKS,
            "working_set_blocks": PROMPT_BLOCKS * prompts, "l2_blocks_per_node": l2_blocks,
            "engines": {"node0": 2, "node1": 1}, "steps": steps,
            "seconds": seconds, "load_average": os.getloadavg(), **split(rows),
            "tokens": tally(judged), "digest_check": check, "control_corrupt": control,
            "workers": workers,
            "nodes": [l2_delta(b, a) | {"pages": a["pages"]}
                      for b, a in zip(before, after, strict=True)],
        }
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_eviction.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=12, help="prompts of 7 blocks each")
    ap.add_argument("--l2-blocks", type=int, default=16, help="L2 pages per node")
    ap.add_argument("--steps", type=int, default=20, help="steps of one request per engine")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    if a.l2_blocks >= PROMPT_BLOCKS * a.prompts:
        raise SystemExit(f"--l2-blocks {a.l2_blocks} holds the whole working set "
                         f"({PROMPT_BLOCKS * a.prompts} blocks): no pressure")
    print(json.dumps(run(a.prompts, a.l2_blocks, a.steps, a.out), indent=1))


if __name__ == "__main__":
    main()
