"""Same-node reuse for vLLM: the first-token latency of a prompt whose prefix another
engine on the node computed, restored from the node's L2, from L3 (Mooncake), and by
the engine that computed it from vLLM's own prefix cache.

Run: ``python -m raykv_lab.bench.l2_reuse [--prompts 3] [--tokens 4096] [--link
RATE] [--out DIR]`` (a one-node embedded cluster of its own; Ray must not be running in
this process). With ``--link`` (root only): two emulated hosts instead
(``start_hosts(2)``), E, F and G on host A, which holds the whole segment, and a
fourth engine H on host B (as G) that serves each prompt from L3 across B's link shaped
to ``RATE`` (``unshaped``: no shaping) (``l3_cross``). Engines (vLLM CPU build,
in-process, eager, one OMP thread, an 8-layer width-512 random Llama, 128-token
blocks), all on the one node (host A) and in one deployment:
E (raykv with L2, vLLM's prefix cache on) computes each prompt, then serves it again
from its own prefix cache (``own_prefix_cache``); F (raykv with L2, prefix cache off)
serves it from L2 (``l2``); G (raykv without L2, prefix cache off) serves it from L3
(``l3``: the node actor reads it from Mooncake into G's staging pool; one node, so its
own segment). Per prompt a fresh one of ``tokens`` random token ids, 8 greedy tokens;
TTFT is vLLM's own (``first_token_latency``). After E's cold run, E's and F's restores
take turns going first (F first in odd prompts: ``l2_first``), so neither gains from
running right after the cold prefill; ``l2_over_own`` gives F / E per prompt, its
median, and its median per order. Also counts F's Mooncake gets (node counter). Writes
``l2_reuse.json`` to ``--out``. Numbers only: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
from pathlib import Path

import ray
from raykv.controllers.node_records import as_dict
from raykv_lab.bench.host_locality import UNSHAPED
from raykv_lab.host_plan import parse_rate

OUTPUT = 8
ENGINE = dict(max_model_len=8192, kv_cache_memory_bytes=256 << 20, max_num_seqs=1)


def run(prompts: int, tokens: int, out: Path, link: str | None = None) -> dict:
    from raykv.clusters.local import local_settings, start_local
    from raykv_lab.engines.vllm_actors import ready, start_engine
    from raykv_lab.engines.vllm_model import LlamaDims, make_llama
    from raykv_lab.hosts import start_hosts

    rnd = random.Random(0)
    blocks = tokens // 128 + 1
    settings = local_settings(global_segment_size=1 << 30)
    start = (start_local(1, settings) if link is None else
             start_hosts(2, settings, link=None if link == UNSHAPED else link,
                         segment_sizes=[1 << 30, 0]))
    with tempfile.TemporaryDirectory() as tmp, start as cluster:
        dims = LlamaDims.of(512, 8)
        model = make_llama(os.path.join(tmp, "llama"), dims)
        node, *other = (sorted(cluster.node_ids, key=cluster.ray_nodes.host_of) if link
                        else cluster.node_ids)
        l2 = {"model_name": "bench-l2", "l2_blocks": prompts * blocks}
        e = start_engine(node, model, l2, enable_prefix_caching=True, **ENGINE)
        f = start_engine(node, model, l2, **ENGINE)
        g = start_engine(node, model, {"model_name": "bench-l2"}, **ENGINE)
        cross = ({"l3_cross": start_engine(other[0], model, {"model_name": "bench-l2"},
                                           **ENGINE)} if other else {})  # H, on host B
        ready(e, f, g, *cross.values())
        for engine in (e, f, g, *cross.values()):  # warm-up, a prompt of its own each
            ray.get(engine.generate.remote([rnd.randrange(3, 2000) for _ in range(256)],
                                           OUTPUT))
        actor = cluster.node_actors[node]
        rows = []
        for _ in range(prompts):
            p = [rnd.randrange(3, 2000) for _ in range(tokens)]
            l2_first = len(rows) % 2 == 1
            cold = ray.get(e.generate.remote(p, OUTPUT))
            own = None if l2_first else ray.get(e.generate.remote(p, OUTPUT))
            gets = ray.get(actor.stats.remote()).counters.get("get_objects", 0)
            from_l2 = ray.get(f.generate.remote(p, OUTPUT))
            f_gets = ray.get(actor.stats.remote()).counters.get("get_objects", 0) - gets
            if l2_first:
                own = ray.get(e.generate.remote(p, OUTPUT))
            from_l3 = ray.get(g.generate.remote(p, OUTPUT))
            rows.append({"cold": cold, "own_prefix_cache": own, "l2": from_l2,
                         "l3": from_l3, "l2_mooncake_gets": f_gets, "l2_first": l2_first}
                        | {k: ray.get(x.generate.remote(p, OUTPUT)) for k, x in cross.items()})
        result: dict = {"prompts": prompts, "tokens": tokens, "output_tokens": OUTPUT,
                        "link": link,
                        "model": {"hidden": dims.hidden, "layers": dims.layers,
                                  "kv_bytes_per_token": dims.kv_bytes_per_token},
                        "l2_stats": as_dict(ray.get(actor.stats.remote()).l2)}
        for k in ("cold", "own_prefix_cache", "l2", "l3", *cross):
            result[k] = {"ttft_ms_median": 1000 * statistics.median(
                r[k]["ttft_s"] for r in rows),
                "ttft_ms": [1000 * r[k]["ttft_s"] for r in rows],
                "cached_tokens": [r[k]["cached"] for r in rows]}
        result["l2_mooncake_gets"] = [r["l2_mooncake_gets"] for r in rows]
        result["l2_first"] = [r["l2_first"] for r in rows]
        ratios = [r["l2"]["ttft_s"] / r["own_prefix_cache"]["ttft_s"] for r in rows]
        result["l2_over_own"] = {"per_prompt": ratios, "median": statistics.median(ratios)}
        for first, name in ((False, "own_first"), (True, "l2_first")):
            of = [x for x, r in zip(ratios, rows, strict=True) if r["l2_first"] == first]
            result["l2_over_own"][name] = statistics.median(of) if of else None
        result["same_tokens_l2_vs_own"] = [r["l2"]["tokens"] == r["own_prefix_cache"]["tokens"]
                                           for r in rows]
        for k in ("l3", *cross):
            result[f"same_tokens_{k}_vs_own"] = [
                r[k]["tokens"] == r["own_prefix_cache"]["tokens"] for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    (out / "l2_reuse.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=3, help="fresh prompts measured")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per prompt")
    parser.add_argument("--link", default=None,
                        help="two emulated hosts, host B's link at this rate (1gbit; "
                             "unshaped), a fourth engine reading L3 there (root only)")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for the json")
    args = parser.parse_args()
    if args.link not in (None, UNSHAPED):
        parse_rate(args.link)
    result = run(args.prompts, args.tokens, args.out, args.link)
    print(json.dumps({k: v for k, v in result.items() if k != "l2_stats"}, indent=2))


if __name__ == "__main__":
    main()
