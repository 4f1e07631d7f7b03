"""Decode inter-token latency (ITL) of vLLM while raykv saves: stock vLLM, raykv with
saves on the step, raykv with ``async_transfers``.

Run: ``python -m raykv_lab.bench.vllm_itl [--requests 16] [--prompt 256]
[--output 512] [--rounds 1] [--out DIR]`` (a one-node embedded cluster of its own; Ray
must not be running in this process). Engines (vLLM CPU build, in-process, eager, one
OMP thread, ``VLLM_CPU_OMP_THREADS_BIND=nobind``, the demo's 6-layer width-384 random
Llama, ``block_size`` 32 so that decoding fills a block every 32 tokens of each
request, vLLM's prefix cache on), one mode at a time on the one node:

- ``stock``: no connector;
- ``sync``: raykv without L2, every save a store put on the step (``wait_for_save``);
- ``l2``: raykv with L2 (saves copied into L2 pages on the step, the node puts them to
  L3 behind), per request;
- ``async``: raykv with L2 and ``async_transfers`` (one batched copy per step).

Workload per mode: ``requests`` distinct random prompts of ``prompt`` tokens, submitted
together, ``output`` greedy tokens each (``ignore_eos``); the engine is driven step by
step (``LLMEngine.step``) and each token's arrival time is taken when a step returns
it. ITL: the gaps between a request's consecutive tokens, over every request (p50,
p90, p99, mean); also the steps' wall time, the worker connector's counters, the
time ``wait_for_save`` took per step (wall and its thread's CPU, from the connector's
counters), the blocks that reached L3 (a group query over every full block of every request, 2 s
after the run at most), the node actor's CPU seconds, and (L2 modes) what a
synchronous load of 8 blocks from L2 costs (``l2_load_8_blocks_ms``: a hit all in L2
is loaded on the step; loading it asynchronously would cost the request at least one
more step). Modes alternate over
``rounds``. Writes ``vllm_itl.json`` to ``--out``. Numbers only: nothing asserts a
speed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import ray
from raykv.integrations.vllm.connector_stats import ConnectorStats
from raykv_lab.engines.vllm_actors import VLLMEngine

BLOCK = 32
MODES = ("stock", "sync", "l2", "async")


@ray.remote(num_cpus=0)
class ITLEngine(VLLMEngine):
    """``VLLMEngine`` plus ``itl``: a batch of requests driven step by step."""

    def itl(self, prompts: list[list[int]], output: int) -> dict:
        """Every prompt submitted at once, ``output`` greedy tokens each; per request
        its tokens' arrival times (seconds), the steps' wall times (``steps``) and
        when each ended (``step_ends``; arrivals and ends on ``time.perf_counter``,
        the machine's monotonic clock)."""
        from vllm import SamplingParams

        engine = self.llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        arrivals: dict[str, list[float]] = {}
        tokens: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
            arrivals[f"r{i}"] = []
        steps, ends = [], []
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            t1 = time.perf_counter()
            steps.append(t1 - t0)
            ends.append(t1)
            for o in outs:
                seen = arrivals[o.request_id]
                n = len(o.outputs[0].token_ids)
                seen.extend([t1] * (n - len(seen)))
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        return {"arrivals": arrivals, "steps": steps, "step_ends": ends, "tokens": tokens}

    def l3_blocks(self, prompts: list[list[int]], tokens: dict[str, list[int]]) -> list[int]:
        """``[blocks in L3, full blocks]`` over every request's computed tokens (its
        prompt and all its output tokens but the last, whose KV is never computed),
        asked by this engine's scheduler connector with its own keys, one group query
        per request."""
        from raykv.integrations.vllm.page_hash import PageHashChain, no_extra_keys
        from raykv.integrations.vllm.request_blocks import hash_hex

        side = self.llm.llm_engine.engine_core.engine_core.scheduler.connector
        client = side.connector_scheduler._cache()
        found = full = 0
        for i, p in enumerate(prompts):
            ids = p + tokens[f"r{i}"][:-1]
            chain = PageHashChain(BLOCK)
            hashes = [hash_hex(h) for h in chain.extend(ids, len(ids), no_extra_keys)]
            full += len(hashes)
            found += client.group_exists(hashes).kv_hit_pages
        return [found, full]

    def l2_load_ms(self, prompt: list[int], blocks: int, repeats: int = 5) -> float:
        """Median milliseconds of one synchronous load of ``prompt``'s first ``blocks``
        blocks from the node's L2 into vLLM's blocks ``0 .. blocks - 1`` (what a hit all
        in L2 costs the step: the node's acquire, the copy, the release); call with no
        request running (it overwrites those blocks)."""
        from raykv.integrations.vllm.page_hash import PageHashChain, no_extra_keys
        from raykv.integrations.vllm.request_blocks import hash_hex

        hashes = [hash_hex(h) for h in PageHashChain(BLOCK).extend(prompt, len(prompt),
                                                                   no_extra_keys)][:blocks]

        def load(worker) -> list[float]:
            from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

            l2 = get_kv_transfer_group().connector_worker._steps.l2
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                n, _ = l2.load(list(range(len(hashes))), hashes)
                times.append((time.perf_counter() - t0) * 1000 if n == len(hashes) else -1.0)
            return times

        (times,) = self.llm.collective_rpc(load)
        return statistics.median(times)

    def worker_counters(self) -> ConnectorStats | None:
        """The worker connector's counters (None without a connector)."""
        from vllm.distributed.kv_transfer.kv_transfer_state import (
            get_kv_transfer_group,
            has_kv_transfer_group,
        )

        return get_kv_transfer_group().stats if has_kv_transfer_group() else None


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _node_cpu_s(actor) -> float:
    """The node actor's process CPU seconds (user + system, from /proc)."""
    pid = ray.get(actor.health.remote())["pid"]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(res: dict) -> dict:
    gaps = [b - a for ts in res["arrivals"].values() for a, b in itertools.pairwise(ts)]
    ms = [g * 1000 for g in gaps]
    return {"itl_p50_ms": _pct(ms, 0.5), "itl_p90_ms": _pct(ms, 0.9),
            "itl_p99_ms": _pct(ms, 0.99), "itl_mean_ms": statistics.fmean(ms),
            "steps": len(res["steps"]), "step_p50_ms": _pct(res["steps"], 0.5) * 1000,
            "wall_s": sum(res["steps"])}


def connector_config(mode: str, l2_blocks: int) -> dict | None:
    """raykv's ``kv_connector_extra_config`` of ``mode`` (None: stock vLLM)."""
    if mode == "stock":
        return None
    conf: dict = {"model_name": f"bench-itl-{mode}"}
    if mode in ("l2", "async"):
        conf["l2_blocks"] = l2_blocks
    if mode == "async":
        conf["async_transfers"] = True
    return conf


def run(requests: int, prompt: int, output: int, rounds: int, modes: list[str],
        out: Path) -> dict:
    from raykv.clusters.local import local_settings, start_local
    from raykv_lab.engines.vllm_actors import ready, start_engine
    from raykv_lab.engines.vllm_model import LlamaDims, make_llama

    blocks = requests * ((prompt + output) // BLOCK + 1)
    engine_kw = dict(block_size=BLOCK, enable_prefix_caching=True, max_num_seqs=requests,
                     max_model_len=prompt + output + BLOCK,
                     kv_cache_memory_bytes=max(64 << 20, 2 * blocks * 147456))
    rows: list[dict] = []
    with (tempfile.TemporaryDirectory() as tmp,
          start_local(settings=local_settings(global_segment_size=1 << 30),
                      num_nodes=1) as cluster):
        model = make_llama(os.path.join(tmp, "llama"), LlamaDims.of(384, 6))
        (node,) = cluster.node_ids
        actor = cluster.node_actors[node]
        seed = 0
        for r in range(rounds):
            for mode in modes:
                eng = start_engine(node, model, connector_config(mode, 2 * blocks),
                                   actor_class=ITLEngine, **engine_kw)
                ready(eng)
                try:
                    rnd = random.Random(seed)
                    seed += 1
                    ray.get(eng.itl.remote([[rnd.randrange(3, 2000) for _ in range(prompt)]],
                                           8))  # warm-up
                    prompts = [[rnd.randrange(3, 2000) for _ in range(prompt)]
                               for _ in range(requests)]
                    cpu0 = _node_cpu_s(actor)
                    res = ray.get(eng.itl.remote(prompts, output))
                    cpu1 = _node_cpu_s(actor)
                    counters = ray.get(eng.worker_counters.remote())
                    row = {"mode": mode, "round": r, **_summary(res),
                           "node_cpu_s": cpu1 - cpu0,
                           "connector": asdict(counters) if counters else {}}
                    if counters:  # wait_for_save's cost per step (warm-up included)
                        row["save_ms_per_step"] = counters.save_us / 1000 / len(res["steps"])
                        row["save_cpu_ms_per_step"] = (counters.save_cpu_us / 1000
                                                       / len(res["steps"]))
                    if mode != "stock":
                        deadline = time.monotonic() + 2.0
                        while True:  # every full block in L3 within 2 s of the run
                            found, full = ray.get(eng.l3_blocks.remote(prompts, res["tokens"]))
                            if found == full or time.monotonic() > deadline:
                                break
                            time.sleep(0.1)
                        row["l3_blocks"], row["full_blocks"] = found, full
                    if mode in ("l2", "async"):
                        row["l2_load_8_blocks_ms"] = ray.get(eng.l2_load_ms.remote(
                            prompts[0], 8))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                finally:
                    ray.get(eng.close.remote())
                    ray.kill(eng)
    stock = [x for x in rows if x["mode"] == "stock"]
    ratios = {}
    if stock:
        for mode in modes:
            mine = [x for x in rows if x["mode"] == mode]
            ratios[mode] = {
                q: statistics.median(x[f"itl_{q}_ms"] for x in mine)
                / statistics.median(x[f"itl_{q}_ms"] for x in stock)
                for q in ("p50", "p99")}
    result = {"requests": requests, "prompt": prompt, "output": output, "block_size": BLOCK,
              "rows": rows, "ratio_vs_stock": ratios}
    out.mkdir(parents=True, exist_ok=True)
    (out / "vllm_itl.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", type=Path, default=Path("."))
    a = ap.parse_args(argv)
    modes = [m for m in a.modes.split(",") if m]
    bad = set(modes) - set(MODES)
    if bad:
        raise SystemExit(f"unknown modes {sorted(bad)}; modes: {MODES}")
    res = run(a.requests, a.prompt, a.output, a.rounds, modes, a.out)
    print(json.dumps(res["ratio_vs_stock"], indent=1))


if __name__ == "__main__":
    main()
