"""Group-exists benchmark: the rank-consistent group hit query against a raw
``batch_is_exist`` of the same objects, in one run.

For each TP size a deployment with KV (MHA, k+v) and Mamba (temporal + 2 conv) pools is
registered; prompts of ``pages`` pages are stored for every rank (tiny objects: the
check does not read bytes). Measured:
- **latency**: ``CacheClient.group_exists`` (rank -> local channel -> the home node
  actor names every rank's objects -> one ``batch_is_exist`` -> intersection) vs the raw
  ``batch_is_exist`` of the identical object list from the driver, p50/p99 in ms;
  *added* = group p50 - raw p50. The answer window is 0, so every query reaches the
  store (the worst case).
- **throughput**: group queries/s from ``concurrency`` caller threads, each a rank of
  the group with its own ``CacheClient`` use: (a) every query distinct, (b) every query
  asked by all ``tp`` ranks, as a TP group does (one check serves the ranks that ask
  while it runs); and, as the store's ceiling, raw ``batch_is_exist`` calls/s of the
  same object lists from as many driver threads.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ray
import torch
from rich.console import Console
from rich.table import Table

from cache_actors import CacheClient
from clusters.local import start_local
from controllers import PoolHitPolicy, PoolName, PoolTransfer, StorageConfig
from controllers.deployments import Deployment, PoolQuery, group_objects

MIB = 1 << 20
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


def _raw_throughput(raw, deployment, prompts: list[list[str]], queries, concurrency: int,
                    seconds: float) -> float:
    """``batch_is_exist`` calls/s of the raw client from ``concurrency`` threads, each
    call the object list of one distinct group query: the store's own ceiling."""
    lists = [group_objects(deployment, keys, queries).objects for keys in prompts]
    return _calls_per_second(lambda j, i: raw.store.batch_is_exist(lists[i % len(lists)]),
                             1, concurrency, seconds)


def _bench_tp(cluster, raw, tp: int, pages: int, calls: int, concurrency: int,
              seconds: float) -> dict:
    model = f"bench-group-tp{tp}-{uuid.uuid4().hex[:6]}"
    clients = []
    for rank in range(tp):
        c = CacheClient(StorageConfig(tp_rank=rank, tp_size=tp, model_name=model))
        c.register_mem_host_pool_v2(c.create_host_pool("mha", **KV), PoolName.KV)
        c.register_mem_host_pool_v2(c.create_host_pool("mamba", **MAMBA), PoolName.MAMBA)
        dep = c.register_deployment()
        clients.append(c)
    client = clients[0]
    dep_spec = ray.get(cluster.controller.deployments.remote())[dep]
    deployment = Deployment.from_dict(dep_spec)
    queries = [PoolQuery(PoolName.MAMBA, TRAIL, 1)]
    prompts = [[uuid.uuid4().hex for _ in range(pages)] for _ in range(8)]
    for keys in prompts:  # store every rank's objects of every page
        raw.put_tiny(group_objects(deployment, keys, queries).objects)
    transfer = [PoolTransfer(PoolName.MAMBA, None, None, TRAIL)]
    group, rawt = [], []
    for n in range(calls):
        keys = prompts[n % len(prompts)]
        objects = group_objects(deployment, keys, queries).objects
        t = time.perf_counter()
        hit = client.group_exists(keys, transfer)
        group.append(time.perf_counter() - t)
        t = time.perf_counter()
        raw.store.batch_is_exist(objects)
        rawt.append(time.perf_counter() - t)
        assert hit.kv_hit_pages == pages
    fresh = [[uuid.uuid4().hex for _ in range(pages)] for _ in range(256)]
    distinct = _throughput(clients, fresh, transfer, False, concurrency, seconds)
    shared = _throughput(clients, fresh, transfer, True, concurrency, seconds)
    raw_qps = _raw_throughput(raw, deployment, fresh, queries, concurrency, seconds)
    for c in clients:
        c.close()
    return {"tp": tp, "pages": pages, "objects": len(objects),
            "group_p50_ms": _pct(group, 0.5), "group_p99_ms": _pct(group, 0.99),
            "raw_p50_ms": _pct(rawt, 0.5), "raw_p99_ms": _pct(rawt, 0.99),
            "added_p50_ms": _pct(group, 0.5) - _pct(rawt, 0.5),
            "qps_distinct": distinct, "qps_group_shared": shared, "qps_raw": raw_qps,
            "group_mean_ms": statistics.mean(group) * 1e3}


class _RawStore:
    """A pure-consumer Mooncake client in the driver with a 4 KiB registered buffer."""

    def __init__(self, cluster) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        rc = self.store.setup("127.0.0.1", cluster.metadata_server, 0, 16 * MIB, "tcp", "",
                              cluster.master_address)
        if rc != 0:
            raise RuntimeError(f"raw Mooncake setup failed: {rc}")
        self._buf = torch.zeros(4096, dtype=torch.uint8)
        self.ptr = self._buf.data_ptr()
        self.store.register_buffer(self.ptr, 4096)

    def put_tiny(self, keys: list[str], attempts: int = 5) -> None:
        """Store 64-byte objects under ``keys`` (in chunks, retrying transient -800)."""
        todo = list(keys)
        for _ in range(attempts):
            failed = []
            for i in range(0, len(todo), 256):
                chunk = todo[i:i + 256]
                codes = self.store.batch_put_from(chunk, [self.ptr] * len(chunk),
                                                  [64] * len(chunk))
                failed += [k for k, c in zip(chunk, codes, strict=True) if c != 0]
            if not failed:
                return
            todo = failed
        raise RuntimeError(f"{len(todo)} objects could not be stored")

    def close(self) -> None:
        self.store.close()


def group_rows(cluster, tp_sizes: Sequence[int] = (2, 4), pages: int = 128, calls: int = 200,
               concurrency: int = 32, seconds: float = 3.0) -> list[dict]:
    """One row of figures per TP size on a running raykv ``cluster`` (whose group answer
    window should be 0, so every query reaches the store). Latencies in ms, throughput
    in queries/s."""
    raw = _RawStore(cluster)
    try:
        return [_bench_tp(cluster, raw, tp, pages, calls, concurrency, seconds)
                for tp in tp_sizes]
    finally:
        raw.close()


def render_group(rows: list[dict], concurrency: int, console: Console) -> None:
    """Print the group-exists table of ``rows`` with rich."""
    pages = rows[0]["pages"] if rows else 0
    table = Table(title=f"group_exists vs raw batch_is_exist ({pages} pages, KV + Mamba, "
                  f"{concurrency} callers)")
    for col in ("TP", "objects", "group p50/p99 ms", "raw p50/p99 ms", "added p50 ms",
                "q/s distinct", "q/s TP group", "raw checks/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["tp"]), str(r["objects"]),
                      f"{r['group_p50_ms']:.2f} / {r['group_p99_ms']:.2f}",
                      f"{r['raw_p50_ms']:.2f} / {r['raw_p99_ms']:.2f}",
                      f"{r['added_p50_ms']:.2f}", f"{r['qps_distinct']:.0f}",
                      f"{r['qps_group_shared']:.0f}", f"{r['qps_raw']:.0f}")
    console.print(table)


def run_group_bench(tp_sizes: Sequence[int] = (2, 4), pages: int = 128, calls: int = 200,
                    concurrency: int = 32, seconds: float = 3.0, out_dir: str | None = None,
                    console: Console | None = None) -> dict:
    """Run the benchmark (own single-node cluster); print a table, write
    ``bench_group.json`` into ``out_dir`` (default ``raykv-out/``), return the figures.
    Latencies in ms, throughput in queries/s."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    console = console or Console()
    out = Path(out_dir or "raykv-out")
    out.mkdir(parents=True, exist_ok=True)
    with start_local(num_nodes=1, global_segment_size=512 * MIB, group_window_s=0.0) as cluster:
        rows = group_rows(cluster, tp_sizes, pages, calls, concurrency, seconds)
    render_group(rows, concurrency, console)
    result = {"rows": rows, "config": {"pages": pages, "calls": calls,
                                       "concurrency": concurrency, "seconds": seconds,
                                       "cpus": os.cpu_count()}}
    path = out / "bench_group.json"
    path.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {path}")
    return result
