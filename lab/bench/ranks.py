"""Ranks per node: N concurrent ranks through one node actor against N raw Mooncake clients.

``run_ranks_bench`` starts an embedded two-node cluster whose store memory lies on node 2
(node 1, where the driver runs, contributes no segment), so every byte crosses Mooncake's
transport. For each page size and each N it runs two phases, one after the other, in the
same cluster:

- **raykv**: N rank actors on node 1, each a ``CacheClient`` with its own MLA host pool,
  looping ``batch_set_v1`` of ``batch`` fresh pages, ``batch_get_v1`` of them into other
  pages of its pool, and removing them (through a consumer Mooncake client of its own,
  used for nothing else, so the store never fills);
- **raw**: N actors on node 1, each with its own ``MooncakeDistributedStore`` (segment 0,
  one registered page-aligned buffer), looping ``batch_is_exist`` (as raykv's
  put-if-absent does), ``batch_put_from``, ``batch_get_into`` and ``batch_remove`` of the
  same number of fresh objects of the same size.

Every actor starts at the same instant and loops for ``seconds``; aggregate GB/s = bytes
put + bytes got by all actors / wall time of the phase. CPU: utime + stime from
``/proc/<pid>/stat`` of every process of that side (both node actors, and the rank or raw
actors) over the phase; CPU-s per GB = CPU seconds / GB moved. Phases alternate which side
goes first per round; ratios are raykv / raw within one round, median over rounds.
Units: sizes in bytes, GB = 1e9 bytes.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv import GiB, KiB, MiB
from raykv_lab.bench.toolkit import (
    GB,
    KV_CACHE_DIM,
    PAGE_TOKENS,
    BenchRun,
    RawStore,
    human_bytes,
    layer_num_for,
    machine_info,
    median_ci,
    ratio_text,
    right_table,
    start_cluster,
    write_figure,
)
from rich.console import Console
from rich.table import Table

DEFAULT_PAGE_SIZES = (64 * KiB, 256 * KiB, 1 * MiB)
DEFAULT_RANKS = (1, 2, 4, 8)
SEGMENT_BYTES = 2 * GiB
TARGET_RATIO = 0.9
TARGET_CPU_RATIO = 1.2
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of process ``pid`` so far, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _wait_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        time.sleep(delay)


class _Worker:
    """What both sides' workers share: ``_round(prefix)`` puts then gets ``batch`` fresh
    pages of ``page_bytes`` (set by ``prepare``) and removes them."""

    index: int
    batch: int
    page_bytes: int

    def _round(self, prefix: str) -> None:
        raise NotImplementedError

    def pid(self) -> int:
        return os.getpid()

    def run(self, run_id: str, start: float, seconds: float) -> tuple[int, float]:
        """Rounds from wall time ``start`` until ``start + seconds``: (bytes moved, end)."""
        _wait_until(start)
        rounds = 0
        while time.time() < start + seconds:
            self._round(f"{run_id}-{self.index}-{rounds}")
            rounds += 1
        return 2 * rounds * self.batch * self.page_bytes, time.time()


@ray.remote(num_cpus=0)
class RankWorker(_Worker):
    """One inference rank: a ``CacheClient`` on node 1 with one MLA pool per page size."""

    def __init__(self, index: int, metadata_server: str, master_address: str) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from raykv import CacheClient, StorageConfig

        self.index = index
        self.client = CacheClient(StorageConfig(is_mla_model=True,
                                                model_name=f"raykv-ranks-{index}"))
        self.janitor = RawStore(metadata_server, master_address)
        self.pool = None
        self.batch = 0

    def prepare(self, page_bytes: int, batch: int) -> None:
        """A pool of ``2 * batch`` pages of ``page_bytes``: the first half random."""
        import torch

        self.release()
        self.pool = self.client.create_host_pool(
            "mla", name=f"ranks-{self.index}", page_size=PAGE_TOKENS,
            size=2 * batch * PAGE_TOKENS, layer_num=layer_num_for(page_bytes),
            kv_cache_dim=KV_CACHE_DIM, dtype=torch.uint8)
        self.client.register_mem_pool_host(self.pool)
        self.batch = batch
        self.page_bytes = page_bytes
        n = batch * PAGE_TOKENS
        self.src, self.dst = torch.arange(n), torch.arange(n, 2 * n)
        flat = self.pool.kv_buffer.view(-1).view(torch.uint8)
        flat[:batch * page_bytes].random_(0, 256)

    def _round(self, prefix: str) -> None:
        hashes = [f"{prefix}-{i}" for i in range(self.batch)]
        ok_put = self.client.batch_set_v1(hashes, self.src)
        ok_get = self.client.batch_get_v1(hashes, self.dst)
        if not (all(ok_put) and all(ok_get)):
            raise RuntimeError(f"rank {self.index}: {ok_put.count(False)} puts and "
                               f"{ok_get.count(False)} gets of {len(hashes)} pages failed")
        self.janitor.remove([k for h in hashes for k in self.client.key_scheme.kv_keys(h)])

    def verify(self, run_id: str) -> bool:
        """One round whose bytes read back are compared with the bytes written."""
        import torch

        flat = self.pool.kv_buffer.view(-1).view(torch.uint8)
        n = self.batch * self.page_bytes
        flat[n:2 * n].zero_()
        self._round(f"verify-{run_id}-{self.index}")
        return bool(torch.equal(flat[:n], flat[n:2 * n]))

    def release(self) -> None:
        if self.pool is not None:
            self.client.destroy_host_pool(self.pool)
            self.pool = None


@ray.remote(num_cpus=0)
class RawWorker(_Worker):
    """One independent Mooncake client on node 1 (segment 0, one registered buffer)."""

    def __init__(self, index: int, metadata_server: str, master_address: str) -> None:
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        self.index = index
        self.raw = RawStore(metadata_server, master_address)

    def prepare(self, page_bytes: int, batch: int) -> None:
        self.raw.resize(2 * batch * page_bytes)
        self.raw.buffer[:batch * page_bytes].random_(0, 256)
        self.batch, self.page_bytes = batch, page_bytes
        self.src = self.raw.ptrs(0, batch, page_bytes)
        self.dst = self.raw.ptrs(batch, batch, page_bytes)
        self.sizes = [page_bytes] * batch

    def _round(self, prefix: str) -> None:
        keys = [f"raw-{prefix}-{i}" for i in range(self.batch)]
        store = self.raw.store
        present = store.batch_is_exist(keys)
        todo = [i for i, e in enumerate(present) if e != 1]
        put = store.batch_put_from([keys[i] for i in todo], [self.src[i] for i in todo],
                                   [self.sizes[i] for i in todo])
        got = store.batch_get_into(keys, self.dst, self.sizes)
        if any(c != 0 for c in put) or any(c != self.page_bytes for c in got):
            raise RuntimeError(f"raw client {self.index}: put codes {set(put)}, get codes "
                               f"{set(got)}")
        self.raw.remove(keys)

    def verify(self, run_id: str) -> bool:
        import torch

        n = self.batch * self.page_bytes
        buffer = self.raw.buffer
        buffer[n:].zero_()
        self._round(f"verify-{run_id}-{self.index}")
        return bool(torch.equal(buffer[:n], buffer[n:]))

    def release(self) -> None:
        self.raw.release()


def phase(workers: list, pids: dict[int, str], run_id: str, seconds: float) -> dict:
    """Run ``workers`` together for ``seconds``; GB/s and CPU-s of the processes ``pids``
    (pid -> role; ``cpu_by_role``: CPU-s summed per role)."""
    before = {p: cpu_seconds(p) for p in pids}
    start = time.time() + 0.3
    results = ray.get([w.run.remote(run_id, start, seconds) for w in workers])
    cpu = {p: cpu_seconds(p) - before[p] for p in pids}
    nbytes = sum(b for b, _ in results)
    wall = max(end for _, end in results) - start
    total_cpu = sum(cpu.values())
    by_role: dict[str, float] = {}
    for p, role in pids.items():
        by_role[role] = by_role.get(role, 0.0) + cpu[p]
    return {"bytes": nbytes, "wall_s": wall, "gbps": nbytes / wall / GB,
            "cpu_s": total_cpu, "cpu_s_per_gb": total_cpu / (nbytes / GB) if nbytes else None,
            "cpu_by_role": by_role}


def bench_case(ranks: list, raws: list, node_pids: dict[int, str], n: int, page_bytes: int,
               batch: int, seconds: float, rounds: int, run_id: str) -> dict:
    """``rounds`` pairs of phases (raykv, raw; order alternating) with ``n`` actors each;
    ``node_pids``: pid -> role of the node actors, counted on both sides."""
    sides = {"raykv": ranks[:n], "raw": raws[:n]}
    roles = {"raykv": "rank actors", "raw": "raw clients"}
    pids = {name: node_pids | {p: roles[name] for p in ray.get([w.pid.remote() for w in ws])}
            for name, ws in sides.items()}
    for ws in sides.values():
        ray.get([w.prepare.remote(page_bytes, batch) for w in ws])
        if not all(ray.get([w.verify.remote(f"{run_id}-{n}-{page_bytes}") for w in ws])):
            raise RuntimeError(f"{page_bytes}-byte pages, N={n}: bytes read back differ")
    runs: dict[str, list[dict]] = {"raykv": [], "raw": []}
    for r in range(rounds):
        order = ("raykv", "raw") if r % 2 == 0 else ("raw", "raykv")
        for name in order:
            runs[name].append(phase(sides[name], pids[name],
                                    f"{run_id}-{name}-{n}-{page_bytes}-{r}", seconds))
    for ws in sides.values():
        ray.get([w.release.remote() for w in ws])
    out = {"ranks": n, "page_bytes": page_bytes, "batch": batch, "runs": runs}
    for name in runs:
        out[f"{name}_gbps"] = statistics.median(x["gbps"] for x in runs[name])
        out[f"{name}_cpu_s_per_gb"] = statistics.median(x["cpu_s_per_gb"] for x in runs[name])
    pairs = list(zip(runs["raykv"], runs["raw"], strict=True))
    ratios = [a["gbps"] / b["gbps"] for a, b in pairs]
    out["ratio"] = statistics.median(ratios)
    out["ratio_ci90"] = median_ci(ratios)
    out["cpu_ratio"] = statistics.median(a["cpu_s_per_gb"] / b["cpu_s_per_gb"] for a, b in pairs)
    return out


def judge(cases: list[dict]) -> dict[str, bool | None]:
    """The targets on this run; None where the run has no such case. The
    throughput targets count pages of 256 KiB and up (64 KiB rows are
    reported, not judged)."""
    def all_of(rows: list[dict], ok) -> bool | None:
        return all(ok(r) for r in rows) if rows else None

    big = [c for c in cases if c["page_bytes"] >= 256 * KiB]
    n8 = [c for c in cases if c["ranks"] == 8]
    return {
        f"8 ranks >= {TARGET_RATIO}x of 8 raw clients at pages >= 256 KiB":
            all_of([c for c in big if c["ranks"] == 8], lambda c: c["ratio"] >= TARGET_RATIO),
        f">= {TARGET_RATIO}x raw at every N, pages >= 256 KiB":
            all_of(big, lambda c: c["ratio"] >= TARGET_RATIO),
        f"CPU-s per GB <= {TARGET_CPU_RATIO}x raw at N=8":
            all_of(n8, lambda c: c["cpu_ratio"] <= TARGET_CPU_RATIO),
    }


def render(result: dict, console: Console) -> None:
    cfg = result["config"]
    table = right_table(
        f"ranks per node: N ranks through one node actor vs N raw Mooncake clients, batch "
        f"of {cfg['batch']} pages, {cfg['seconds']} s phases, {cfg['rounds']} round(s)",
        ("page", "N", "raykv GB/s", "raw GB/s", "ratio", "raykv CPU-s/GB", "raw CPU-s/GB",
         "CPU ratio"),
        caption="GB/s = (put + get bytes) / wall time, all actors together; CPU-s/GB over "
                "every process of the side; ratio = raykv / raw (median over rounds [90% "
                "bootstrap interval of that median])")
    for c in result["cases"]:
        table.add_row(human_bytes(c["page_bytes"]), str(c["ranks"]), f"{c['raykv_gbps']:.2f}",
                      f"{c['raw_gbps']:.2f}", ratio_text(c, "ratio"),
                      f"{c['raykv_cpu_s_per_gb']:.2f}", f"{c['raw_cpu_s_per_gb']:.2f}",
                      f"{c['cpu_ratio']:.2f}")
    console.print(table)
    roles = right_table("CPU-s per GB by process, largest N of each page size (median round)",
                        ("page", "N", "side", "node actor 1", "node actor 2",
                         "ranks / raw clients"))
    most = max(c["ranks"] for c in result["cases"])
    for c in result["cases"]:
        if c["ranks"] != most:
            continue
        for side in ("raykv", "raw"):
            runs = sorted(c["runs"][side], key=lambda x: x["cpu_s_per_gb"])
            run = runs[len(runs) // 2]
            gb = run["bytes"] / GB
            per = {k: v / gb for k, v in run["cpu_by_role"].items()}
            workers = per.get("rank actors", per.get("raw clients", 0.0))
            roles.add_row(human_bytes(c["page_bytes"]), str(c["ranks"]), side,
                          f"{per.get('node actor 1', 0.0):.2f}",
                          f"{per.get('node actor 2', 0.0):.2f}", f"{workers:.2f}")
    console.print(roles)
    targets = Table(title="targets")
    targets.add_column("target")
    targets.add_column("met")
    for name, ok in result["targets"].items():
        targets.add_row(name, "-" if ok is None else ("[green]yes" if ok else "[red]no"))
    console.print(targets)


def plot(result: dict, path: Path) -> None:
    """Two panels per page size row: aggregate GB/s and CPU-s per GB against N."""
    from raykv_lab.plotting import figure_class

    sizes = result["config"]["page_sizes"]
    fig = figure_class()(figsize=(11, 3.6 * len(sizes)))
    axes = fig.subplots(len(sizes), 2, squeeze=False)
    for row, size in zip(axes, sizes, strict=True):
        cases = [c for c in result["cases"] if c["page_bytes"] == size]
        ns = [c["ranks"] for c in cases]
        for ax, key, label in ((row[0], "gbps", "aggregate GB/s"),
                               (row[1], "cpu_s_per_gb", "CPU-s per GB moved")):
            ax.plot(ns, [c[f"raykv_{key}"] for c in cases], "o-", label="raykv (one node actor)")
            ax.plot(ns, [c[f"raw_{key}"] for c in cases], "s--", label="N raw Mooncake clients")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.set_xlabel("ranks on the node (N)")
            ax.set_ylabel(label)
            ax.set_ylim(bottom=0)
            ax.set_title(f"{human_bytes(size)} pages: {label}", fontsize=10)
            ax.legend(fontsize=8)
    write_figure(fig, path, dpi=110)


def run_ranks_bench(
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    ranks: Sequence[int] = DEFAULT_RANKS,
    batch: int = 32,
    seconds: float = 3.0,
    rounds: int = 1,
    out_dir: str | None = None,
    console: Console | None = None,
    cluster=None,
) -> dict:
    """Benchmark N ranks per node; print tables, write ``bench_ranks.json`` and
    ``bench_ranks.png`` into ``out_dir`` (default ``raykv-out/``), return the figures.

    Starts (and stops) its own two-node embedded cluster unless ``cluster`` (a
    ``LocalCluster`` whose second node holds the store memory) is given.
    """
    if batch < 1 or seconds <= 0 or rounds < 1:
        raise ValueError(f"batch, seconds and rounds must be positive, got {batch}, "
                         f"{seconds}, {rounds}")
    if not page_sizes or not ranks or min(ranks) < 1:
        raise ValueError("page_sizes and ranks must be non-empty, ranks >= 1")
    for size in page_sizes:
        layer_num_for(size)
    if 2 * max(ranks) * batch * max(page_sizes) > SEGMENT_BYTES:
        raise ValueError(f"{max(ranks)} x {batch} pages of {human_bytes(max(page_sizes))} do "
                         f"not fit the {human_bytes(SEGMENT_BYTES)} store segment")
    run = BenchRun.begin(out_dir, console)
    if cluster is None:
        with start_cluster(run.console, 2, segment_sizes=[0, SEGMENT_BYTES]) as own:
            cases = _bench(own, page_sizes, ranks, batch, seconds, rounds, run.run_id,
                           run.console)
    else:
        cases = _bench(cluster, page_sizes, ranks, batch, seconds, rounds, run.run_id,
                       run.console)
    result = {
        "run_id": run.run_id,
        "machine": machine_info() | {"loadavg": os.getloadavg()},
        "config": {"page_sizes": list(page_sizes), "ranks": list(ranks), "batch": batch,
                   "seconds": seconds, "rounds": rounds, "segment_bytes": SEGMENT_BYTES,
                   "nodes": 2, "store_memory": "node 2 only",
                   "page_geometry": f"MLA, {PAGE_TOKENS} tokens x {KV_CACHE_DIM} bytes "
                                    "per layer, uint8"},
        "cases": cases,
        "targets": judge(cases),
        "elapsed_s": run.elapsed_s(),
    }
    render(result, run.console)
    return run.save(result, "bench_ranks", plot)


def _bench(cluster, page_sizes, ranks, batch, seconds, rounds, run_id, console) -> list[dict]:
    node1 = cluster.node_ids[0]
    pin = NodeAffinitySchedulingStrategy(node1, soft=False)
    most = max(ranks)
    args = (cluster.metadata_server, cluster.master_address)
    rank_workers = [RankWorker.options(scheduling_strategy=pin).remote(i, *args)
                    for i in range(most)]
    raw_workers = [RawWorker.options(scheduling_strategy=pin).remote(i, *args)
                   for i in range(most)]
    actors = cluster.node_actors
    node_pids = {ray.get(actors[n].health.remote())["pid"]: f"node actor {i + 1}"
                 for i, n in enumerate(cluster.node_ids[:2])}
    ray.get([w.pid.remote() for w in rank_workers + raw_workers])
    cases = []
    try:
        for size in page_sizes:
            for n in ranks:
                console.print(f"[dim]{human_bytes(size)} pages, N={n} ...[/dim]")
                cases.append(bench_case(rank_workers, raw_workers, node_pids, n, size, batch,
                                        seconds, rounds, run_id))
    finally:
        for w in rank_workers + raw_workers:
            ray.kill(w)
    return cases
