"""vLLM's first-token latency after a whole-cluster restart: a prompt whose blocks the
disk tier kept, against a cold prefill.

Run: ``python -m raykv_lab.bench.disk_restart [--prompts 5] [--tokens 3000]
[--warm-page-cache] [--out FILE]`` (embedded clusters of its own; Ray must not be running
in this process; about 2 minutes on 2 cores).

Engines: vLLM's CPU build, in-process, eager, one OMP thread
(``VLLM_CPU_OMP_THREADS_BIND=nobind``), vLLM's prefix cache off, an 8-layer width-512
random Llama (8 KiB of KV per token, 128-token blocks: 1 MiB a block). A one-node
cluster with a disk tier (a ``SEGMENT_BYTES`` segment, Mooncake's lease shortened to
``LEASE_MS`` as the disk tier's tests do, so puts refused while memory fills clear
fast): engine S (raykv's connector) computes ``prompts`` fresh prompts of ``tokens``
random token ids, and its connector saves every full block (checked: its worker's
``saved`` counter); a client then puts filler pages (another deployment) until the
node's disk slot holds the prompts' bytes and ``MARGIN_BYTES`` more, so the prompts'
blocks, the oldest objects, were evicted from memory to full offload buckets. The
whole cluster is shut down (engine, node actor, master, Ray); unless
``--warm-page-cache``, every file of the disk directory is flushed and dropped from
the OS page cache (``posix_fadvise(DONTNEED)``), as after a reboot. A cluster started
again on the same ``disk_dir`` runs two fresh engines, each warmed up with a short
prompt of its own: D (raykv's connector) serves each prompt loading its blocks from
the disk tier (``disk``), C (no connector) computes it (``cold``); they take turns
going first. TTFT is vLLM's own (``first_token_latency``); 8 greedy tokens.

Writes JSON: the command, date, machine and load, the settings, per side the median
and every sample of TTFT and cached tokens, D's objects served per tier for each
prompt, S's TTFT (a cold prefill that also saves), the disk slot's bytes and the
node's objects served per tier after the run, and
``disk_over_cold`` (per prompt and median). Numbers only: nothing asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import ray
import torch
from raykv.clusters.local import local_settings
from raykv.controllers import StorageConfig
from raykv.controllers.node_records import TierStats, as_dict
from raykv.controllers.pool_layout import MiB, PoolLayout
from raykv_lab.bench.toolkit import machine_info

OUTPUT = 8
BLOCK = 128
ENGINE = dict(max_model_len=4096, kv_cache_memory_bytes=256 << 20, max_num_seqs=1)
SEGMENT_BYTES = 160 * MiB
LEASE_MS = 2500
DISK_BYTES = 2 << 30
MARGIN_BYTES = 24 * MiB  # three offload buckets beyond the prompts' bytes
FILLER = PoolLayout.vllm(page_size=16, size=16 * 32, layer_num=16, head_num=4,
                         head_dim=512, dtype="bfloat16", itemsize=2)
"""Filler pages: 1 MiB each, 32 in the pool, put under ever new keys."""
FILL_S = 300.0


def cluster_args(disk_dir: str) -> dict:
    return dict(settings=local_settings(global_segment_size=SEGMENT_BYTES, disk_dir=disk_dir,
                                        disk_bytes=DISK_BYTES),
                master_args=[f"-default_kv_lease_ttl={LEASE_MS}"], log_to_driver=False)


def tiers(cluster) -> TierStats:
    (actor,) = cluster.node_actors.values()
    return ray.get(actor.stats.remote()).tiers


def stop(*engines) -> None:
    """Shut the engines down and kill their actors."""
    for e in engines:
        try:
            ray.get(e.close.remote())
        finally:
            ray.kill(e)


def save_prompts(cluster, model: str, conf: dict, prompts: list[list[int]]) -> list[float]:
    """Engine S computes every prompt (its connector saves its full blocks); S's TTFT
    per prompt. ``RuntimeError`` if a block was not saved."""
    from raykv_lab.engines.vllm_actors import ready, start_engine

    (node,) = cluster.node_ids
    s = start_engine(node, model, conf, **ENGINE)
    ready(s)
    try:
        ttft = []
        for p in prompts:
            (before,) = ray.get(s.worker_stats.remote())
            ttft.append(ray.get(s.generate.remote(p, OUTPUT))["ttft_s"])
            (after,) = ray.get(s.worker_stats.remote())
            saved = after.counters.saved - before.counters.saved
            if saved != len(p) // BLOCK:
                raise RuntimeError(f"S saved {saved} of "
                                   f"{len(p) // BLOCK} blocks: {after}")
        return ttft
    finally:
        stop(s)


def push_to_disk(cluster, want_bytes: int) -> dict:
    """Filler pages put (a put refused while memory fills is tried again after a pause)
    until the node's disk slot holds ``want_bytes``; pages put and seconds taken."""
    from raykv.cache_actors.rank.client import CacheClient

    client = CacheClient(StorageConfig(model_name="bench-disk-filler"))
    try:
        pool = client.create_host_pool(FILLER)
        client.register_mem_pool_host(pool)
        pool.kv_buffer.view(torch.uint8).random_(generator=torch.Generator().manual_seed(0))
        pages = FILLER.size // FILLER.page_size
        slots = torch.arange(FILLER.size)
        started = time.monotonic()
        put = n = 0
        while tiers(cluster).used_bytes < want_bytes:
            if time.monotonic() - started > FILL_S:
                raise TimeoutError(f"{tiers(cluster).used_bytes} of {want_bytes} bytes "
                                   "on disk")
            ok = client.batch_set_v1([f"f{n}-{i}" for i in range(pages)], slots)
            put += sum(ok)
            n += 1
            if not all(ok):
                time.sleep(0.5)
        return {"filler_pages": put, "filler_page_bytes": FILLER.object_bytes,
                "seconds": time.monotonic() - started}
    finally:
        client.close()


def drop_page_cache(disk_dir: str) -> int:
    """Flush every file under ``disk_dir`` and drop it from the OS page cache; bytes."""
    total = 0
    for root, _, files in os.walk(disk_dir):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def serve_restarted(cluster, model: str, conf: dict, prompts: list[list[int]],
                    rnd: random.Random) -> list[dict]:
    """Fresh engines D (connector) and C (none) serve every prompt, taking turns going
    first (D first in even prompts); per prompt both results and D's objects served per
    tier."""
    from raykv_lab.engines.vllm_actors import ready, start_engine

    (node,) = cluster.node_ids
    d = start_engine(node, model, conf, **ENGINE)
    c = start_engine(node, model, None, **ENGINE)
    ready(d, c)
    try:
        for e in (d, c):  # warm-up, a prompt of its own each
            ray.get(e.generate.remote([rnd.randrange(3, 2000) for _ in range(256)], OUTPUT))
        rows = []
        for i, p in enumerate(prompts):
            order = (d, c) if i % 2 == 0 else (c, d)
            got = {}
            for e in order:
                before = tiers(cluster).served
                got[e] = ray.get(e.generate.remote(p, OUTPUT))
                if e is d:
                    after = tiers(cluster).served
                    served = {k: after[k] - before.get(k, 0) for k in after}
            rows.append({"disk": got[d], "cold": got[c], "disk_first": i % 2 == 0,
                         "served_objects": served})
        return rows
    finally:
        stop(d, c)


def side(rows: list[dict], key: str) -> dict:
    ttft = [1000 * r[key]["ttft_s"] for r in rows]
    return {"ttft_ms_median": statistics.median(ttft), "ttft_ms": ttft,
            "cached_tokens": [r[key]["cached"] for r in rows]}


def run(prompts: int, tokens: int, warm_page_cache: bool) -> dict:
    """The whole measurement (module docstring); the JSON's content."""
    from raykv.clusters.local import start_local
    from raykv_lab.engines.vllm_model import LlamaDims, make_llama

    load = list(os.getloadavg())
    started = time.perf_counter()
    rnd = random.Random(0)
    texts = [[rnd.randrange(3, 2000) for _ in range(tokens)] for _ in range(prompts)]
    dims = LlamaDims.of(512, 8)
    full = tokens // BLOCK
    if full * BLOCK == tokens:
        full -= 1  # vLLM computes a prompt's last token: its block is not loaded
    with tempfile.TemporaryDirectory(prefix="raykv-disk-restart-") as tmp:
        model = make_llama(os.path.join(tmp, "llama"), dims)
        disk_dir = os.path.join(tmp, "disk")
        conf = {"model_name": "bench-disk-restart"}
        with start_local(**cluster_args(disk_dir)) as cluster:
            saver_ttft = save_prompts(cluster, model, conf, texts)
            saved_bytes = prompts * full * BLOCK * dims.kv_bytes_per_token
            fill = push_to_disk(cluster, saved_bytes + MARGIN_BYTES)
            disk_before = tiers(cluster).used_bytes
        dropped = 0 if warm_page_cache else drop_page_cache(disk_dir)
        with start_local(**cluster_args(disk_dir)) as cluster:
            rows = serve_restarted(cluster, model, conf, texts, rnd)
            after = as_dict(replace(tiers(cluster), path=None))  # a tmp dir: left out
    ratios = [r["disk"]["ttft_s"] / r["cold"]["ttft_s"] for r in rows]
    return {
        "command": "python -m raykv_lab.bench.disk_restart " + shlex.join(sys.argv[1:]),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": time.perf_counter() - started,
        "machine": machine_info() | {"transport": "tcp (one Ray node on this machine)",
                                     "load_avg_start": load,
                                     "load_avg_end": list(os.getloadavg())},
        "settings": {"prompts": prompts, "tokens": tokens, "output_tokens": OUTPUT,
                     "block_tokens": BLOCK, "full_blocks": full,
                     "segment_bytes": SEGMENT_BYTES, "lease_ms": LEASE_MS,
                     "disk_bytes": DISK_BYTES, "engine": ENGINE,
                     "page_cache_dropped": not warm_page_cache,
                     "model": {"hidden": dims.hidden, "layers": dims.layers,
                               "kv_bytes_per_token": dims.kv_bytes_per_token}},
        "fill": fill | {"disk_bytes_at_shutdown": disk_before,
                        "page_cache_dropped_bytes": dropped},
        "saver_ttft_ms": [1000 * t for t in saver_ttft],
        "disk": side(rows, "disk"), "cold": side(rows, "cold"),
        "disk_first": [r["disk_first"] for r in rows],
        "served_objects": [r["served_objects"] for r in rows],
        "tiers_after": after,
        "disk_over_cold": {"per_prompt": ratios, "median": statistics.median(ratios)}}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=5, help="fresh prompts measured")
    p.add_argument("--tokens", type=int, default=3000, help="tokens per prompt")
    p.add_argument("--warm-page-cache", action="store_true",
                   help="keep the disk directory in the OS page cache across the restart")
    p.add_argument("--out", type=Path, default=Path("raykv-out/disk_restart.json"))
    a = p.parse_args(argv)
    if a.prompts < 1 or not BLOCK < a.tokens < ENGINE["max_model_len"] - OUTPUT:
        p.error(f"--prompts must be >= 1 and --tokens in {BLOCK + 1} .. "
                f"{ENGINE['max_model_len'] - OUTPUT - 1}")
    result = run(a.prompts, a.tokens, a.warm_page_cache)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"TTFT median: disk {result['disk']['ttft_ms_median']:.0f} ms (cached "
          f"{result['disk']['cached_tokens']}), cold {result['cold']['ttft_ms_median']:.0f}"
          f" ms; disk / cold {result['disk_over_cold']['median']:.2f}x")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
