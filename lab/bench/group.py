"""Group-exists benchmark: the rank-consistent group hit query against a raw
``batch_is_exist`` of the same objects, in one run.

For each TP size a deployment with KV (MHA, k+v) and Mamba (temporal + 2 conv) pools is
registered; 64 prompts of ``pages`` pages are stored for every rank, every page with
its Mamba state (tiny objects: the check does not read bytes). Measured:
- **latency, cold**: ``CacheClient.group_exists`` (rank -> local channel -> the home
  node actor -> store lookups -> intersection) right after the home node forgot
  every confirmation, so every object is looked up in the store, vs the raw
  ``batch_is_exist`` of the identical object list from the driver; p50/p99 in ms,
  *added* = group p50 - raw p50. The answer window is 0: no answer is shared.
- **latency, warm**: the same rank asking again about prompts the store confirmed
  less than ``confirm_ttl_s`` ago (Mooncake leases them), against the same raw lookup.
- **throughput**: group queries/s from ``concurrency`` caller threads, each a rank of
  the group with its own ``CacheClient``: distinct queries about stored prompts (hits,
  confirmations renewed as they expire), distinct queries about prompts never stored
  (misses: once the home node sees mostly misses, only page 0 of each rank's KV is
  checked; never confirmed), and every stored prompt asked
  by all ``tp`` ranks (as a TP group does); as the store's ceiling, raw
  ``batch_is_exist`` calls/s of the full object lists from as many driver threads.
- **answered**: how the home node answered the run's queries (shared, from
  confirmations, with store lookups) and its store calls.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import ray
import torch
from raykv import (
    CacheClient,
    MiB,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    StorageConfig,
    local_settings,
)
from raykv.controllers import NAMESPACE, node_actor_name
from raykv.controllers.deployments import Deployment, PoolQuery
from raykv.controllers.families import group_families
from raykv_lab.bench.toolkit import BenchRun, RawStore, right_table, start_cluster
from rich.console import Console

TRAIL = PoolHitPolicy.TRAILING_PAGES
MAMBA = dict(size=4, temporal_shape=(2, 4), conv_shapes=[(2, 3), (2, 2)],
             dtype=torch.float16)
KV = dict(page_size=16, size=64, layer_num=1, head_num=1, head_dim=8, dtype=torch.float16)


def _pct(samples: Sequence[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3


def _calls_per_second(call: Callable[[int, int], object], streams: int, concurrency: int,
                      seconds: float) -> float:
    """Calls/s made by ``concurrency`` threads for ``seconds``: thread ``j`` calls
    ``call(j, i)`` in a loop, ``i`` taken in order from stream ``j % streams`` (each
    stream counts 0, 1, 2, ... over all its threads)."""
    lock = threading.Lock()
    taken = [0] * streams
    end = time.perf_counter() + seconds

    def caller(j: int) -> int:
        n = 0
        while time.perf_counter() < end:
            with lock:
                i = taken[j % streams]
                taken[j % streams] += 1
            call(j, i)
            n += 1
        return n

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = sum(pool.map(caller, range(concurrency)))
    return done / (time.perf_counter() - start)


def _throughput(clients: list[CacheClient], prompts: list[list[str]], transfer, shared: bool,
                concurrency: int, seconds: float) -> float:
    """Group queries/s answered by ``concurrency`` threads; thread ``j`` is rank
    ``j % tp``. ``shared``: every rank asks about every prompt (prompts taken in order
    per rank); else every query is a prompt of its own."""
    tp = len(clients)
    return _calls_per_second(
        lambda j, i: clients[j % tp].group_exists(prompts[i % len(prompts)], transfer),
        tp if shared else 1, concurrency, seconds)


def _raw_throughput(raw: RawStore, deployment: Deployment, prompts: list[list[str]],
                    queries, concurrency: int, seconds: float) -> float:
    """``batch_is_exist`` calls/s of the raw client from ``concurrency`` threads, each
    call the object list of one distinct group query: the store's own ceiling."""
    lists = [group_families(deployment, queries).objects(keys) for keys in prompts]
    return _calls_per_second(lambda j, i: raw.store.batch_is_exist(lists[i % len(lists)]),
                             1, concurrency, seconds)


def _latency(client: CacheClient, raw: RawStore, deployment: Deployment, prompts, queries, transfer,
             calls: int, before=lambda: None) -> tuple[list[float], list[float]]:
    """``calls`` sequential group queries and raw lookups of the same objects, taking
    turns; ``before()`` runs untimed ahead of each pair. Which of the two goes first
    alternates: the first store call after a pause is slower on these machines (~0.4 ms
    measured), and neither side should always pay it."""
    group, rawt = [], []
    for n in range(calls):
        keys = prompts[n % len(prompts)]
        objects = group_families(deployment, queries).objects(keys)
        before()
        for side in ((0, 1) if n % 2 else (1, 0)):
            t = time.perf_counter()
            if side:
                hit = client.group_exists(keys, transfer)
                group.append(time.perf_counter() - t)
            else:
                raw.store.batch_is_exist(objects)
                rawt.append(time.perf_counter() - t)
        assert hit.kv_hit_pages == len(keys), hit
    return group, rawt


def _bench_tp(cluster, raw: RawStore, tp: int, pages: int, calls: int, concurrency: int,
              seconds: float) -> dict:
    model = f"bench-group-tp{tp}-{uuid.uuid4().hex[:6]}"
    clients = []
    for rank in range(tp):
        c = CacheClient(StorageConfig(tp_rank=rank, tp_size=tp, model_name=model))
        c.register_mem_host_pool_v2(c.create_host_pool("mha", **KV), PoolName.KV)
        c.register_mem_host_pool_v2(c.create_host_pool("mamba", **MAMBA), PoolName.MAMBA)
        dep = c.register_deployment()
        clients.append(c)
    dep_spec = ray.get(cluster.controller.deployments.remote())[dep]
    deployment = Deployment.from_dict(dep_spec)
    home = ray.get_actor(node_actor_name(dep_spec["home_node"]), namespace=NAMESPACE)
    queries = [PoolQuery(PoolName.MAMBA, TRAIL, 1)]
    stored = [[uuid.uuid4().hex for _ in range(pages)] for _ in range(64)]
    for keys in stored:  # every rank's objects of every page
        raw.put_tiny(group_families(deployment, queries).objects(keys))
    transfer = [PoolTransfer(PoolName.MAMBA, None, None, TRAIL)]
    before = ray.get(home.stats.remote()).group_queries
    cold, cold_raw = _latency(clients[0], raw, deployment, stored, queries, transfer, calls,
                              lambda: ray.get(home.forget_confirmations.remote()))
    warm, warm_raw = _latency(clients[0], raw, deployment, stored[:8], queries, transfer,
                              calls)
    misses = [[uuid.uuid4().hex for _ in range(pages)] for _ in range(256)]
    qps = {
        "qps_hits": _throughput(clients, stored, transfer, False, concurrency, seconds),
        "qps_misses": _throughput(clients, misses, transfer, False, concurrency, seconds),
        "qps_group_shared": _throughput(clients, stored, transfer, True, concurrency,
                                        seconds),
        "qps_raw": _raw_throughput(raw, deployment, stored, queries, concurrency, seconds),
    }
    after = ray.get(home.stats.remote()).group_queries
    for c in clients:
        c.close()
    answered = {k: getattr(after, k) - getattr(before, k)
                for k in ("recent", "inflight", "confirmed", "looked_up", "store_calls")}
    row = {"tp": tp, "pages": pages,
           "objects": len(group_families(deployment, queries).objects(stored[0])),
           "answered": answered, **qps}
    for name, group, rawt in (("cold", cold, cold_raw), ("warm", warm, warm_raw)):
        row |= {f"{name}_p50_ms": _pct(group, 0.5), f"{name}_p99_ms": _pct(group, 0.99),
                f"{name}_raw_p50_ms": _pct(rawt, 0.5), f"{name}_raw_p99_ms": _pct(rawt, 0.99),
                f"{name}_added_p50_ms": _pct(group, 0.5) - _pct(rawt, 0.5)}
    return row


RAW_BUFFER_BYTES = 4096  # the raw client's registered buffer: put_tiny's source
TARGET_ADDED_MS = 1.0  # group p50 minus raw p50
TARGET_QPS = 2000.0    # group queries/s from concurrent callers on 2 cores


def group_rows(cluster, tp_sizes: Sequence[int] = (2, 4), pages: int = 128, calls: int = 200,
               concurrency: int = 32, seconds: float = 3.0) -> list[dict]:
    """One row of figures per TP size on a running raykv ``cluster`` (whose group answer
    window should be 0, so no answer is shared between queries). Latencies in ms,
    throughput in queries/s."""
    raw = RawStore(cluster.metadata_server, cluster.master_address)
    try:
        raw.resize(RAW_BUFFER_BYTES)
        return [_bench_tp(cluster, raw, tp, pages, calls, concurrency, seconds)
                for tp in tp_sizes]
    finally:
        raw.close()


def judge_group(rows: list[dict]) -> dict[str, bool | None]:
    """The group-query targets on ``rows``, each case judged on its own (None: no rows)."""
    if not rows:
        return {}
    out = {}
    for case in ("cold", "warm"):
        out[f"group query adds < {TARGET_ADDED_MS} ms p50 ({case})"] = all(
            r[f"{case}_added_p50_ms"] < TARGET_ADDED_MS for r in rows)
    for key, case in (("qps_hits", "hits"), ("qps_misses", "misses"),
                      ("qps_group_shared", "asked by every TP rank")):
        out[f">= {TARGET_QPS:.0f} group queries/s ({case})"] = all(
            r[key] >= TARGET_QPS for r in rows)
    return out


def render_group(rows: list[dict], concurrency: int, console: Console) -> None:
    """Print the group-exists tables of ``rows`` with rich."""
    pages = rows[0]["pages"] if rows else 0
    table = right_table(f"group_exists vs raw batch_is_exist ({pages} pages, KV + Mamba): "
                        "p50 / p99 ms",
                        ("TP", "objects", "cold group", "cold raw", "cold added",
                         "warm group", "warm raw", "warm added"))
    for r in rows:
        cells = []
        for c in ("cold", "warm"):
            cells += [f"{r[f'{c}_p50_ms']:.2f} / {r[f'{c}_p99_ms']:.2f}",
                      f"{r[f'{c}_raw_p50_ms']:.2f} / {r[f'{c}_raw_p99_ms']:.2f}",
                      f"{r[f'{c}_added_p50_ms']:.2f}"]
        table.add_row(str(r["tp"]), str(r["objects"]), *cells)
    console.print(table)
    table = right_table(f"group queries/s, {concurrency} callers",
                        ("TP", "hits", "misses", "TP group", "raw lookups/s", "shared",
                         "confirmed", "looked up", "store calls"))
    for r in rows:
        a = r["answered"]
        table.add_row(str(r["tp"]), f"{r['qps_hits']:.0f}", f"{r['qps_misses']:.0f}",
                      f"{r['qps_group_shared']:.0f}", f"{r['qps_raw']:.0f}",
                      str(a["recent"] + a["inflight"]), str(a["confirmed"]),
                      str(a["looked_up"]), str(a["store_calls"]))
    console.print(table)


def render_targets(targets: dict[str, bool | None], console: Console) -> None:
    """Print one verdict line per target (``None``: this run had no such case)."""
    for name, met in targets.items():
        verdict = "not judged" if met is None else "met" if met else "NOT met"
        console.print(f"target {name}: {verdict}")


def run_group_bench(tp_sizes: Sequence[int] = (2, 4), pages: int = 128, calls: int = 200,
                    concurrency: int = 32, seconds: float = 3.0, out_dir: str | None = None,
                    console: Console | None = None) -> dict:
    """Run the benchmark (own single-node cluster); print a table, write
    ``bench_group.json`` into ``out_dir`` (default ``raykv-out/``), return the figures.
    Latencies in ms, throughput in queries/s."""
    run = BenchRun.begin(out_dir, console)
    cluster = start_cluster(run.console, 1, local_settings(global_segment_size=512 * MiB,
                                                             group_window_s=0.0))
    with cluster:
        rows = group_rows(cluster, tp_sizes, pages, calls, concurrency, seconds)
    render_group(rows, concurrency, run.console)
    targets = judge_group(rows)
    render_targets(targets, run.console)
    result = {"rows": rows, "targets": targets,
              "config": {"pages": pages, "calls": calls, "concurrency": concurrency,
                         "seconds": seconds, "cpus": os.cpu_count()}}
    return run.save(result, "bench_group")
