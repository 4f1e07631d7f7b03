"""vLLM engines with raykv's L2 while a node actor fails: killed mid-run (the engines
keep serving, the node's L2 comes back empty, no loaded block is wrong) and stopped
with SIGSTOP (what it costs each engine step, against the budget of one step).

Run: ``python -m raykv_lab.bench.l2_faults [--steps 8] [--stop-s 3] [--timeout-s
1] [--out DIR]`` (a two-node embedded cluster of its own; Ray must not be running in
this process). Engines: vLLM CPU build, in-process, eager, one OMP thread,
``VLLM_CPU_OMP_THREADS_BIND=nobind``, the demo's tiny random Llama, vLLM's prefix cache
off, raykv's connector with ``l2_blocks`` and ``timeout_s`` (the budget of one step:
each call's deadline), one deployment.

- ``kill``: X and Y on node 0, Z on node 1 (``DigestEngine``s) and a reference R (no
  connector, prefix cache on) churn as in ``l2_eviction`` over 6 prompts of 7 blocks
  (L2 of 64 pages per node: no pressure). After ``steps`` steps node 0's actor is
  killed (Ray restarts it) while a step's requests are in flight; ``steps`` more
  steps follow. Measured: requests that failed (an exception: none expected), blocks
  loaded and recomputed per phase, node 0's L2 when its actor answers again (ready
  pages: 0 expected), the digest check over the whole run, the tokens as
  ``l2_eviction`` judges them.
- ``stop``: one engine on node 0 (``block_size`` 32, 8 requests of 256 tokens, 600
  greedy tokens each, driven step by step), node 0's actor stopped with SIGSTOP for
  ``stop_s`` seconds mid-decode (0.5 s after the prompts' 64 blocks reached L2: the
  prefill is done; every 32nd step then saves 8 blocks), then continued. Per phase
  (before, stopped, after): steps, median and longest step, the longest step less the
  median step before it, in budgets (``timeout_s``).

Writes ``l2_faults.json`` to ``--out``. Numbers only: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from raykv_lab.bench.block_digests import check_loads
from raykv_lab.bench.l2_eviction import (
    OUTPUT,
    churn,
    judge_tokens,
    node_l2,
    prompt,
    schedule,
    split,
    tally,
    worker_counts,
)

STOP_BLOCK = 32  # the stop phase's block size: a save every 32 tokens of each request
RESTART_S = 60.0  # deadline of the node actor's restart
PREFILL_S = 300.0  # deadline of the stop phase's prefill


def phases(ends: Sequence[float], starts: Sequence[float], stop: float, cont: float
           ) -> dict[str, list[float]]:
    """Step durations (seconds) by phase: ``before`` (ended before ``stop``),
    ``stopped`` (overlapping ``[stop, cont]``), ``after`` (started after ``cont``); a
    step is ``[starts[i], ends[i]]``, all on one monotonic clock."""
    out: dict[str, list[float]] = {"before": [], "stopped": [], "after": []}
    for s, e in zip(starts, ends, strict=True):
        key = "before" if e < stop else "after" if s > cont else "stopped"
        out[key].append(e - s)
    return out


def step_cost(by_phase: dict[str, list[float]], budget_s: float) -> dict:
    """Per phase its steps, median and longest step (ms); and the longest stopped step
    less the median step before, in ms and in budgets of ``budget_s``."""
    out: dict = {}
    for k, xs in by_phase.items():
        out[k] = ({"steps": len(xs), "median_ms": 1000 * statistics.median(xs),
                   "longest_ms": 1000 * max(xs)} if xs else {"steps": 0})
    if by_phase["before"] and by_phase["stopped"]:
        extra = max(by_phase["stopped"]) - statistics.median(by_phase["before"])
        out["longest_stopped_extra_ms"] = 1000 * extra
        out["longest_stopped_extra_budgets"] = extra / budget_s
    return out


def _restarted(actor, pid: int) -> float:
    """Seconds until ``actor`` answers from another process than ``pid``."""
    import ray

    t0 = time.monotonic()
    while time.monotonic() - t0 < RESTART_S:
        with contextlib.suppress(Exception):
            if ray.get(actor.health.remote(), timeout=5)["pid"] != pid:
                return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"the node actor did not restart in {RESTART_S} s")


def kill_phase(cluster, model: str, steps: int, timeout_s: float) -> dict:
    import ray
    from raykv_lab.bench.digest_engine import DigestEngine
    from raykv_lab.engines.vllm_actors import ready, start_engine

    n0, n1 = cluster.node_ids
    conf = {"model_name": "bench-faults", "l2_blocks": 64, "timeout_s": timeout_s}
    engines = [start_engine(n, model, conf, actor_class=DigestEngine) for n in (n0, n0, n1)]
    ref = start_engine(n1, model, None, enable_prefix_caching=True)
    ready(*engines, ref)
    ps = [prompt(300 + i) for i in range(6)]
    cold, restored = [], []
    for p in ps:
        cold.append(ray.get(ref.generate.remote(p, OUTPUT))["tokens"])
        restored.append(ray.get(ref.generate.remote(p, OUTPUT))["tokens"])
    ray.get([e.record.remote(True) for e in engines])
    plan = schedule(len(engines), len(ps), 2 * steps + 1, seed=1)
    rows = churn(engines, ps, plan[:steps])
    actor = cluster.node_actors[n0]
    pid = ray.get(actor.health.remote())["pid"]
    picks = plan[steps]
    w0 = worker_counts(engines)
    flight = [e.generate.remote(ps[i], OUTPUT) for e, i in zip(engines, picks, strict=True)]
    time.sleep(0.1)  # the step's requests under way
    ray.kill(actor, no_restart=False)
    failed = 0
    outs = []
    for i, ref_ in zip(picks, flight, strict=True):
        try:
            outs.append((i, ray.get(ref_)))
        except Exception:  # counted: the engines must keep serving
            outs.append((i, None))
            failed += 1
    w1 = worker_counts(engines)
    rows += [{"step": steps, "engine": k, "prompt": i, "cached": o["cached"],
              "loaded": w1[k].loaded - w0[k].loaded,
              "load_failed": w1[k].load_failed - w0[k].load_failed,
              "tokens": o["tokens"]}
             for k, (i, o) in enumerate(outs) if o is not None]
    restart_s = _restarted(actor, pid)
    emptied = node_l2(actor)
    after = churn(engines, ps, plan[steps + 1:])
    for r in after:
        r["step"] += steps + 1
    rows += after
    recs = ray.get([e.recorded.remote() for e in engines])
    for e in engines:
        ray.get(e.record.remote(False))
    check = check_loads([r["saved"] for r in recs], [r["loaded"] for r in recs])
    judged = [judge_tokens(r, cold[r["prompt"]], restored[r["prompt"]]) for r in rows]

    result = {"requests_failed": failed, "restart_s": restart_s,
              "node0_l2_after_restart": emptied,
              "before_kill": split([r for r in rows if r["step"] < steps]),
              "kill_step": split([r for r in rows if r["step"] == steps]),
              "after_kill_first_step": split([r for r in rows if r["step"] == steps + 1]),
              "after_kill": split([r for r in rows if r["step"] > steps]),
              "digest_check": check, "tokens": tally(judged)}
    for e in (*engines, ref):
        ray.kill(e)
    return result


def stop_phase(cluster, model: str, stop_s: float, timeout_s: float) -> dict:
    import ray
    from raykv_lab.bench.vllm_itl import ITLEngine
    from raykv_lab.engines.vllm_actors import ready, start_engine

    n0 = cluster.node_ids[0]
    conf = {"model_name": "bench-faults-stop", "l2_blocks": 256, "timeout_s": timeout_s}
    eng = start_engine(n0, model, conf, actor_class=ITLEngine, block_size=STOP_BLOCK,
                       max_num_seqs=8, max_model_len=1024)
    ready(eng)
    rnd = random.Random(7)
    ray.get(eng.itl.remote([[rnd.randrange(3, 2000) for _ in range(256)]], 8))  # warm-up
    prompts = [[rnd.randrange(3, 2000) for _ in range(256)] for _ in range(8)]
    actor = cluster.node_actors[n0]
    pid = ray.get(actor.health.remote())["pid"]
    written = node_l2(actor)["written"]
    pending = eng.itl.remote(prompts, 600)
    deadline = time.monotonic() + PREFILL_S
    while node_l2(actor)["written"] < written + 8 * 256 // STOP_BLOCK:  # prefill saved
        if time.monotonic() > deadline:
            raise RuntimeError("the prompts' blocks did not reach L2")
        time.sleep(0.05)
    time.sleep(0.5)  # decoding under way
    stop = time.perf_counter()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(stop_s)
    finally:
        os.kill(pid, signal.SIGCONT)
        cont = time.perf_counter()
    res = ray.get(pending)
    counters = ray.get(eng.worker_counters.remote())
    by_phase = phases(res["step_ends"], [e - d for e, d in zip(res["step_ends"],
                                                                 res["steps"], strict=True)],
                      stop, cont)
    ray.kill(eng)
    return {"stop_s": cont - stop, "budget_s": timeout_s,
            "connector": asdict(counters) if counters else {},
            **step_cost(by_phase, timeout_s)}


def run(steps: int, stop_s: float, timeout_s: float, out: Path) -> dict:
    from raykv.clusters.local import local_settings, start_local
    from raykv_lab.engines.vllm_model import make_llama

    with (tempfile.TemporaryDirectory() as tmp,
          start_local(settings=local_settings(global_segment_size=512 << 20),
                      num_nodes=2) as cluster):
        model = make_llama(os.path.join(tmp, "tiny-llama"))
        result = {"timeout_s": timeout_s, "load_average_start": os.getloadavg(),
                  "kill": kill_phase(cluster, model, steps, timeout_s),
                  "stop": stop_phase(cluster, model, stop_s, timeout_s),
                  "load_average_end": os.getloadavg()}
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_faults.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="churn steps before and after "
                    "the kill")
    ap.add_argument("--stop-s", type=float, default=3.0, help="seconds of SIGSTOP")
    ap.add_argument("--timeout-s", type=float, default=1.0, help="the connector's "
                    "timeout_s: the budget of one step")
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    print(json.dumps(run(a.steps, a.stop_s, a.timeout_s, a.out), indent=1))


if __name__ == "__main__":
    main()
