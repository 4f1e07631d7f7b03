"""A vLLM engine (CPU build, in-process, raykv's connector) while its node actor is
stopped (SIGSTOP) for a window: its throughput then against a stock vLLM engine's
(no connector) on the same node, and how soon after SIGCONT it hits raykv again.

Run: ``python -m raykv_lab.bench.outage [--window 60] [--out DIR]`` (a one-node
embedded cluster of its own; Ray must not be running in this process). One request at
a time, each a fresh prompt of ``PROMPT`` random token ids (no prefix reuse: both
engines do the same work) and ``OUTPUT`` greedy tokens. Measured, each over
``window`` seconds: requests/s of the stock engine; of the raykv engine with its node
actor running (its saves reach raykv); of the raykv engine from SIGSTOP on (its
node actor stopped for the whole window); then, after SIGCONT, the seconds until a
prompt stored before the stop is served from raykv again (``cached`` > 0). Writes
``outage.json`` to ``--out``. Numbers only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import tempfile
import time
from pathlib import Path

import ray

PROMPT = 256  # tokens per prompt: two vLLM blocks of 128
OUTPUT = 8  # greedy tokens per request
RECOVER_S = 60.0  # how long to wait for the first hit after SIGCONT


def prompt(rnd: random.Random) -> list[int]:
    return [rnd.randrange(3, 2000) for _ in range(PROMPT)]


def rate(engine, window_s: float, rnd: random.Random) -> dict:
    """Requests completed in ``window_s`` seconds, one at a time, and the longest one."""
    done, longest, end = 0, 0.0, time.monotonic() + window_s
    start = time.monotonic()
    while time.monotonic() < end:
        t = time.monotonic()
        ray.get(engine.generate.remote(prompt(rnd), OUTPUT))
        longest = max(longest, time.monotonic() - t)
        done += 1
    seconds = time.monotonic() - start
    return {"requests": done, "seconds": seconds, "per_s": done / seconds,
            "longest_s": longest}


def run(window_s: float, out: Path) -> dict:
    from raykv import local_settings, start_local
    from raykv_lab.engines.vllm_actors import ready, start_engine
    from raykv_lab.engines.vllm_model import make_llama

    rnd = random.Random(0)
    with (tempfile.TemporaryDirectory() as tmp,
          start_local(settings=local_settings(global_segment_size=256 << 20),
                      num_nodes=1) as cluster):
        model = make_llama(os.path.join(tmp, "tiny-llama"))
        (node,) = cluster.node_ids
        stock = start_engine(node, model, None)
        cached = start_engine(node, model, {"namespace": cluster.namespace})
        ready(stock, cached)
        for engine in (stock, cached):  # warm-up
            ray.get(engine.generate.remote(prompt(rnd), OUTPUT))
        stored = prompt(rnd)
        ray.get(cached.generate.remote(stored, OUTPUT))  # its blocks saved to raykv
        result: dict = {"window_s": window_s, "prompt_tokens": PROMPT,
                        "output_tokens": OUTPUT}
        result["stock"] = rate(stock, window_s, rnd)
        result["raykv_running"] = rate(cached, window_s, rnd)
        pid = ray.get(cluster.node_actors[node].health.remote())["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            result["raykv_stopped"] = rate(cached, window_s, rnd)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        while time.monotonic() - resumed < RECOVER_S:
            if ray.get(cached.generate.remote(stored, OUTPUT))["cached"] > 0:
                result["hit_again_s"] = time.monotonic() - resumed
                break
            time.sleep(0.1)
        else:
            result["hit_again_s"] = None
        result["stopped_vs_stock"] = result["raykv_stopped"]["per_s"] / result["stock"]["per_s"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "outage.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=60.0, help="seconds per phase")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for outage.json")
    args = parser.parse_args()
    print(json.dumps(run(args.window, args.out), indent=2))


if __name__ == "__main__":
    main()
