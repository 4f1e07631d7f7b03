"""Data-plane benchmark: the whole raykv path against raw Mooncake and memcpy.

``run_dataplane_bench`` starts an embedded two-node cluster in which the head node (where
the driver runs) contributes no store memory, so every object lands in the other node's
segment and every byte crosses Mooncake's transport (TCP loopback on one machine). It
then measures, for each page size:

- **whole path**: the driver as a rank, ``CacheClient.batch_set_v1`` / ``batch_get_v1``
  of ``batch`` pages of an MLA host pool (one object per page), through the node actor;
- **raw Mooncake**: a plain ``MooncakeDistributedStore`` in the driver process,
  ``batch_put_from`` / ``batch_get_into`` of ``batch`` objects of the same size from a
  registered buffer, against the same store;
- **memcpy**: ``torch`` ``dst.copy_(src)`` of the same number of bytes;
- **tenant**: the whole path again for a rank of a tenant (keyed page hashes, owner
  claims, a tenant's key prefix), paired with the whole path without one in every
  iteration, so what tenancy costs is read off one run.

and the per-call latency of 1-page batches on both paths, and (``lab.bench.group``)
group-exists latency and throughput against a raw ``batch_is_exist`` of the same
objects. Units: sizes in bytes, bandwidth in GB/s (1e9 bytes per second), durations in
seconds, latencies in ms, throughput in queries/s.
"""

from __future__ import annotations

import os
import secrets
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from raykv import CacheClient, GiB, HostPool, KiB, MiB, StorageConfig, local_settings
from raykv.controllers.keyed_hashes import KeyedHashes
from raykv.controllers.tenancy import TENANT_SECRET_ENV, tenant_secret
from raykv_lab.bench.group import group_rows, judge_group, render_group, render_targets
from raykv_lab.bench.toolkit import (
    KV_CACHE_DIM,
    PAGE_TOKENS,
    BenchRun,
    RawStore,
    bars_and_panel,
    check_codes,
    gbps_text,
    grouped_bars,
    human_bytes,
    latency_ms,
    layer_num_for,
    machine_info,
    right_table,
    start_cluster,
    summarize,
    timed,
    write_figure,
)
from rich.console import Console

DEFAULT_PAGE_SIZES = (64 * KiB, 1 * MiB, 4 * MiB)
# Store memory on node 2. Objects are removed after every iteration, so one iteration
# (whole path, tenant, raw: batch x page bytes each) must fit: 3 x 128 x 4 MiB = 1.5 GiB
# by default.
SEGMENT_BYTES = 3 * GiB
BENCH_TENANT = "raykv-bench"
LATENCY_PAGE_BYTES = 64 * KiB
LATENCY_CALLS = 200
TARGET_RATIO = 0.9
TARGET_MIN_PAGE_BYTES = 1 * MiB
SMALL_TARGET_RATIO = 0.7  # pages below TARGET_MIN_PAGE_BYTES
TARGET_OVERHEAD_MS = 1.5  # whole path p50 minus raw p50, 1-page set and get


@dataclass
class Pages:
    """The pages of one benchmark size: a pool of ``2 * batch`` pages, the first
    ``batch`` the source of puts, the others the target of gets. The raw baseline's
    buffer is split the same way (``half``)."""

    page_bytes: int
    batch: int
    pool: HostPool
    src_indices: torch.Tensor
    dst_indices: torch.Tensor

    @property
    def pool_bytes(self) -> torch.Tensor:
        """The whole pool as flat bytes (its MLA ``kv_buffer``)."""
        return self.pool.kv_buffer.view(-1).view(torch.uint8)

    def half(self, data: torch.Tensor, which: int) -> torch.Tensor:
        """Source (0) or target (1) half of a buffer of ``2 * batch`` pages."""
        n = self.batch * self.page_bytes
        return data[which * n:(which + 1) * n]


def make_pages(client: CacheClient, page_bytes: int, batch: int) -> Pages:
    """Create an MLA pool of ``2 * batch`` pages of ``page_bytes`` bytes; random source pages."""
    pool = client.create_host_pool("mla", page_size=PAGE_TOKENS, size=2 * batch * PAGE_TOKENS,
                                   layer_num=layer_num_for(page_bytes),
                                   kv_cache_dim=KV_CACHE_DIM, dtype=torch.uint8)
    n = batch * PAGE_TOKENS
    pages = Pages(page_bytes, batch, pool, torch.arange(n), torch.arange(n, 2 * n))
    _, object_sizes = pool.get_page_buffer_meta(pages.src_indices[:PAGE_TOKENS])
    if object_sizes != [page_bytes]:
        raise RuntimeError(f"a pool page is objects of {object_sizes} bytes, expected one of "
                           f"{page_bytes}")
    client.register_mem_pool_host(pool)
    pages.half(pages.pool_bytes, 0).random_(0, 256)
    return pages


def whole_round(client: CacheClient, pages: Pages, hashes: list[str]) -> tuple[float, float]:
    """Whole path: ``batch_set_v1`` from the source pages, ``batch_get_v1`` into the
    target pages; (put seconds, get seconds). ``RuntimeError`` if a page failed."""
    t_put, ok_put = timed(client.batch_set_v1, hashes, pages.src_indices)
    t_get, ok_get = timed(client.batch_get_v1, hashes, pages.dst_indices)
    if not (all(ok_put) and all(ok_get)):
        raise RuntimeError(f"whole path, {pages.page_bytes}-byte pages: "
                           f"{ok_put.count(False)} puts and {ok_get.count(False)} gets of "
                           f"{len(hashes)} pages failed")
    return t_put, t_get


def raw_round(raw: RawStore, pages: Pages, keys: list[str]) -> tuple[float, float]:
    """Raw Mooncake: ``batch_put_from`` from the source half of the registered buffer,
    ``batch_get_into`` the target half; (put seconds, get seconds)."""
    size = pages.page_bytes
    sizes = [size] * pages.batch
    src, dst = raw.ptrs(0, pages.batch, size), raw.ptrs(pages.batch, pages.batch, size)
    t_put, put_codes = raw.timed(raw.store.batch_put_from, keys, src, sizes)
    t_get, get_codes = raw.timed(raw.store.batch_get_into, keys, dst, sizes)
    check_codes("raw batch_put_from", put_codes, lambda c: c == 0)
    check_codes("raw batch_get_into", get_codes, lambda c: c == size)
    return t_put, t_get


def bench_size(client: CacheClient, tenant: CacheClient, raw: RawStore, page_bytes: int,
               batch: int, iters: int, run_id: str) -> dict:
    """Whole-path, tenant whole-path and raw put/get of ``batch`` pages of ``page_bytes``
    bytes: ``iters`` timed iterations after one untimed warm-up that also checks the
    bytes read back. The paths take turns going first, so none always runs on a warmer
    store.

    ``ratio_put`` / ``ratio_get``: median over iterations of whole-path GB/s over raw GB/s
    of the same iteration; ``ratio_*_best``: best whole-path GB/s over best raw GB/s.
    ``tenant_ratio_put`` / ``tenant_ratio_get``: the same median of the tenant's GB/s
    over the whole path's without a tenant.
    """
    pages = make_pages(client, page_bytes, batch)
    tpages = make_pages(tenant, page_bytes, batch)
    raw.resize(2 * batch * page_bytes)
    pages.half(raw.buffer, 0).copy_(pages.half(pages.pool_bytes, 0))
    tpages.half(tpages.pool_bytes, 0).copy_(pages.half(pages.pool_bytes, 0))
    keyed = KeyedHashes(tenant_secret(BENCH_TENANT))
    times: dict[str, list[float]] = {k: [] for k in ("whole_put", "whole_get", "tenant_put",
                                                     "tenant_get", "raw_put", "raw_get")}
    try:
        for it in range(iters + 1):
            hashes = [f"bench-{run_id}-{page_bytes}-{it}-{i}" for i in range(batch)]
            raw_keys = [f"raw-{h}" for h in hashes]
            if it == 0:
                for data in (pages.pool_bytes, tpages.pool_bytes, raw.buffer):
                    pages.half(data, 1).zero_()
            rounds = {"whole": (whole_round, client, pages, hashes),
                      "tenant": (whole_round, tenant, tpages, hashes),
                      "raw": (raw_round, raw, pages, raw_keys)}
            order = list(rounds)[it % 3:] + list(rounds)[:it % 3]
            took = {name: rounds[name][0](*rounds[name][1:]) for name in order}
            if it == 0:
                for name, data in (("whole path", pages.pool_bytes),
                                   ("tenant", tpages.pool_bytes), ("raw", raw.buffer)):
                    if not torch.equal(pages.half(data, 0), pages.half(data, 1)):
                        raise RuntimeError(f"{name}, {page_bytes}-byte pages: the bytes read "
                                           "back differ from the bytes written")
            else:
                for name in rounds:
                    times[f"{name}_put"].append(took[name][0])
                    times[f"{name}_get"].append(took[name][1])
            raw.remove([k for h in hashes for k in client.key_scheme.kv_keys(h)]
                       + [k for h in keyed.keys(hashes) for k in tenant.key_scheme.kv_keys(h)]
                       + raw_keys)
    finally:
        client.destroy_host_pool(pages.pool)
        tenant.destroy_host_pool(tpages.pool)
    nbytes = batch * page_bytes
    out = {"page_bytes": page_bytes, "batch": batch, "batch_bytes": nbytes}
    out |= {name: summarize(nbytes, t) for name, t in times.items()}
    out["memcpy"] = bench_memcpy(nbytes, iters)
    for op in ("put", "get"):
        # Paired: the paths ran back to back in each iteration, so load that comes and
        # goes on the machine cancels out of each iteration's ratio.
        pairs = zip(times[f"raw_{op}"], times[f"whole_{op}"], strict=True)
        out[f"ratio_{op}"] = statistics.median(raw_t / whole_t for raw_t, whole_t in pairs)
        out[f"ratio_{op}_best"] = out[f"whole_{op}"]["best_gbps"] / out[f"raw_{op}"]["best_gbps"]
        pairs = zip(times[f"whole_{op}"], times[f"tenant_{op}"], strict=True)
        out[f"tenant_ratio_{op}"] = statistics.median(w / t for w, t in pairs)
    return out


def bench_memcpy(nbytes: int, iters: int) -> dict:
    """``dst.copy_(src)`` of ``nbytes`` bytes in host memory, ``iters`` timed copies."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)
    dst = torch.empty_like(src)
    dst.copy_(src)  # faults the pages in
    return summarize(nbytes, [timed(dst.copy_, src)[0] for _ in range(iters)])


def bench_latency(client: CacheClient, raw: RawStore, run_id: str,
                  calls: int = LATENCY_CALLS) -> dict:
    """Per-call latency of 1-page batches of ``LATENCY_PAGE_BYTES`` bytes on both paths,
    fresh keys every call, plus one bare Ray round trip (``health``) for reference."""
    pages = make_pages(client, LATENCY_PAGE_BYTES, 1)
    raw.resize(2 * LATENCY_PAGE_BYTES)
    pages.half(raw.buffer, 0).copy_(pages.half(pages.pool_bytes, 0))
    size = [LATENCY_PAGE_BYTES]
    src, dst = raw.ptrs(0, 1, LATENCY_PAGE_BYTES), raw.ptrs(1, 1, LATENCY_PAGE_BYTES)
    expected: dict[str, Callable[[object], bool]] = {
        "whole_set": lambda r: r == [True], "whole_get": lambda r: r == [True],
        "whole_exists": lambda r: r == 1, "ray_round_trip": bool,
        "raw_put": lambda r: r == [0], "raw_get": lambda r: r == size,
        "raw_exists": lambda r: r == [1],
    }
    times: dict[str, list[float]] = {name: [] for name in expected}
    written: list[str] = []
    try:
        for i in range(calls):
            hashes = [f"lat-{run_id}-{i}"]
            keys = [f"raw-{hashes[0]}"]
            written += client.key_scheme.kv_keys(hashes[0]) + keys
            results = {  # (seconds, result) per operation, run in this order
                "whole_set": timed(client.batch_set_v1, hashes, pages.src_indices),
                "whole_get": timed(client.batch_get_v1, hashes, pages.dst_indices),
                "whole_exists": timed(client.batch_exists, hashes),
                "ray_round_trip": timed(client.health),
                "raw_put": raw.timed(raw.store.batch_put_from, keys, src, size),
                "raw_get": raw.timed(raw.store.batch_get_into, keys, dst, size),
                "raw_exists": raw.timed(raw.store.batch_is_exist, keys),
            }
            for name, (t, result) in results.items():
                if not expected[name](result):
                    raise RuntimeError(f"latency run, {name} call {i} returned {result!r}")
                times[name].append(t)
        raw.remove(written)
    finally:
        client.destroy_host_pool(pages.pool)
    return {"page_bytes": LATENCY_PAGE_BYTES} | {k: latency_ms(t) for k, t in times.items()}


def render(result: dict, console: Console) -> None:
    """Print the bandwidth and latency tables of ``result`` with rich."""
    table = right_table(
        f"raykv data plane, GB/s median (best) over {result['config']['iters']} "
        f"iterations, batch of {result['config']['batch']} pages",
        ("page", "whole put", "raw put", "put ratio", "whole get", "raw get", "get ratio",
         "memcpy"),
        caption="ratio = whole path / raw Mooncake: median of per-iteration ratios "
                "(best / best)")
    for s in result["sizes"]:
        table.add_row(human_bytes(s["page_bytes"]), gbps_text(s["whole_put"]),
                      gbps_text(s["raw_put"]),
                      f"{s['ratio_put']:.2f} ({s['ratio_put_best']:.2f})",
                      gbps_text(s["whole_get"]), gbps_text(s["raw_get"]),
                      f"{s['ratio_get']:.2f} ({s['ratio_get_best']:.2f})",
                      gbps_text(s["memcpy"]))
    console.print(table)
    ttable = right_table(
        "a tenant's rank (keyed page hashes, owner claims) vs a rank without one, GB/s "
        "median (best)", ("page", "put", "tenant put", "ratio", "get", "tenant get",
                          "ratio"),
        caption="ratio = tenant / no tenant: median of per-iteration ratios")
    for s in result["sizes"]:
        ttable.add_row(human_bytes(s["page_bytes"]), gbps_text(s["whole_put"]),
                       gbps_text(s["tenant_put"]), f"{s['tenant_ratio_put']:.2f}",
                       gbps_text(s["whole_get"]), gbps_text(s["tenant_get"]),
                       f"{s['tenant_ratio_get']:.2f}")
    console.print(ttable)
    lat = result["latency"]
    ltable = right_table(f"per-call latency, 1 page of {human_bytes(lat['page_bytes'])}, "
                         f"{lat['whole_set']['calls']} calls, ms",
                         ("operation", "whole path p50", "whole path p99", "raw p50",
                          "raw p99", "overhead p50"))
    for label, whole, base in LATENCY_PAIRS:
        ltable.add_row(label, f"{lat[whole]['p50_ms']:.3f}", f"{lat[whole]['p99_ms']:.3f}",
                       f"{lat[base]['p50_ms']:.3f}", f"{lat[base]['p99_ms']:.3f}",
                       f"{lat[whole]['p50_ms'] - lat[base]['p50_ms']:.3f}")
    rt = lat["ray_round_trip"]
    ltable.add_row("Ray round trip (health)", f"{rt['p50_ms']:.3f}", f"{rt['p99_ms']:.3f}",
                   "-", "-", "-")
    console.print(ltable)
    if result["group"]:
        render_group(result["group"], result["config"]["group_concurrency"], console)
    render_targets(result["targets"], console)


LATENCY_PAIRS = (("set / put", "whole_set", "raw_put"), ("get", "whole_get", "raw_get"),
                 ("exists", "whole_exists", "raw_exists"))


def judge(sizes: list[dict], latency: dict) -> dict[str, bool | None]:
    """The targets on this run's medians: None where this run has no such case."""
    big = [s for s in sizes if s["page_bytes"] >= TARGET_MIN_PAGE_BYTES]
    small = [s for s in sizes if s["page_bytes"] < TARGET_MIN_PAGE_BYTES]

    def ratios_at_least(group: list[dict], target: float) -> bool | None:
        return (all(min(s["ratio_put"], s["ratio_get"]) >= target for s in group)
                if group else None)
    overhead = [latency[w]["p50_ms"] - latency[b]["p50_ms"] for _, w, b in LATENCY_PAIRS[:2]]
    return {
        f">= {TARGET_RATIO}x raw for pages >= {human_bytes(TARGET_MIN_PAGE_BYTES)}":
            ratios_at_least(big, TARGET_RATIO),
        f">= {SMALL_TARGET_RATIO}x raw for smaller pages": ratios_at_least(small,
                                                                         SMALL_TARGET_RATIO),
        f"1-page set/get overhead < {TARGET_OVERHEAD_MS} ms p50":
            max(overhead) < TARGET_OVERHEAD_MS,
    }


def plot(result: dict, path: Path) -> None:
    """A PNG of two panels: grouped bars of median GB/s by page size (whole vs raw, put
    and get; memcpy GB/s under each size), and p50 latency in ms of 1-page calls and of
    group queries (raykv vs raw Mooncake)."""
    sizes = result["sizes"]
    fig, ax, lax = bars_and_panel()
    x = grouped_bars(ax, sizes, (("whole_put", "whole path put", "#1f77b4"),
                                 ("raw_put", "raw Mooncake put", "#aec7e8"),
                                 ("whole_get", "whole path get", "#ff7f0e"),
                                 ("raw_get", "raw Mooncake get", "#ffbb78")))
    ax.set_xticks(x, [f"{human_bytes(s['page_bytes'])}\nmemcpy {s['memcpy']['median_gbps']:.1f}"
                      for s in sizes])
    ax.set_xlabel(f"page size (batch of {result['config']['batch']} pages)")
    ax.set_ylabel("GB/s (1e9 bytes/s), median")
    ax.set_title("data plane vs raw Mooncake (TCP loopback, other node's segment)", fontsize=10)
    ax.legend(fontsize=8)
    lat = result["latency"]
    labels = [label for label, _, _ in LATENCY_PAIRS]
    ours = [lat[w]["p50_ms"] for _, w, _ in LATENCY_PAIRS]
    raw = [lat[b]["p50_ms"] for _, _, b in LATENCY_PAIRS]
    for row in result["group"]:
        for case in ("cold", "warm"):
            labels.append(f"group\nTP={row['tp']}\n{case}")
            ours.append(row[f"{case}_p50_ms"])
            raw.append(row[f"{case}_raw_p50_ms"])
    lx = np.arange(len(labels))
    for off, values, label, color in ((-0.2, ours, "raykv", "#2ca02c"),
                                      (0.2, raw, "raw Mooncake", "#98df8a")):
        bars = lax.bar(lx + off, values, 0.4, label=label, color=color)
        lax.bar_label(bars, fmt="%.2f", fontsize=7)
    lax.set_xticks(lx, labels, fontsize=7)
    lax.set_ylabel("p50 latency, ms")
    lax.set_title(f"1-page calls ({human_bytes(lat['page_bytes'])}) and group queries",
                  fontsize=10)
    lax.legend(fontsize=8)
    write_figure(fig, path)


def run_dataplane_bench(
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    batch: int = 128,
    iters: int = 5,
    out_dir: str | None = None,
    console: Console | None = None,
    group_tp_sizes: Sequence[int] = (2, 4),
    group_pages: int = 128,
    group_concurrency: int = 32,
    group_seconds: float = 3.0,
) -> dict:
    """Benchmark the data plane; print tables, write JSON and PNG, return the figures.

    ``page_sizes`` are page object sizes in bytes (multiples of 32 KiB), ``batch`` pages
    move per call, ``iters`` timed iterations per size follow one untimed warm-up that
    also checks the bytes read back. Starts (and stops) its own two-node embedded
    cluster, so Ray must not be initialised. Writes ``bench_dataplane.json`` and
    ``bench_dataplane.png`` into ``out_dir`` (default ``raykv-out/``). Bandwidth is in
    GB/s (1e9 bytes/s), latency in ms, durations in seconds. Group queries
    (``group_tp_sizes``, empty to skip) run in the same cluster with an answer window of
    0; see ``lab.bench.group``. ``targets`` maps each target to met / not met /
    None (this run has no such case).
    """
    if batch < 1 or iters < 1:
        raise ValueError(f"batch and iters must be >= 1, got batch={batch}, iters={iters}")
    if not page_sizes:
        raise ValueError("page_sizes is empty")
    for size in page_sizes:
        layer_num_for(size)
    if 3 * batch * max(page_sizes) > SEGMENT_BYTES:
        raise ValueError(f"{batch} pages of {human_bytes(max(page_sizes))} on three paths do "
                         f"not fit the {human_bytes(SEGMENT_BYTES)} store segment")
    run = BenchRun.begin(out_dir, console)
    console = run.console
    cluster = start_cluster(console, 2, local_settings(group_window_s=0.0),
                            segment_sizes=[0, SEGMENT_BYTES])
    with cluster:
        client = CacheClient(StorageConfig(is_mla_model=True, model_name="raykv-bench"))
        # The tenant's secret: this process's own if it has one, else a fresh one.
        os.environ.setdefault(TENANT_SECRET_ENV, secrets.token_hex(32))
        tenant = CacheClient(StorageConfig(is_mla_model=True, model_name="raykv-bench",
                                           extra_config={"tenant": BENCH_TENANT}))
        # Match the raw client's priority to the node actors' (Ray workers run niced).
        niceness = os.getpriority(os.PRIO_PROCESS, client.health()["pid"])
        raw = RawStore(cluster.metadata_server, cluster.master_address, niceness)
        try:
            results = []
            for size in page_sizes:
                console.print(f"[dim]{human_bytes(size)} pages ...[/dim]")
                results.append(bench_size(client, tenant, raw, size, batch, iters,
                                          run.run_id))
            console.print("[dim]1-page latency ...[/dim]")
            latency = bench_latency(client, raw, run.run_id)
            console.print("[dim]group exists ...[/dim]")
            group = group_rows(cluster, group_tp_sizes, group_pages,
                               concurrency=group_concurrency,
                               seconds=group_seconds) if group_tp_sizes else []
        finally:
            raw.close()
            tenant.close()
            client.close()
    result = {
        "run_id": run.run_id,
        "machine": machine_info(),
        "config": {"page_sizes": list(page_sizes), "batch": batch, "iters": iters,
                   "segment_bytes": SEGMENT_BYTES, "nodes": 2, "raw_client_nice": niceness,
                   "raw_buffer": "page-aligned private memory",
                   "page_geometry": f"MLA, {PAGE_TOKENS} tokens x {KV_CACHE_DIM} bytes "
                                    "per layer, uint8",
                   "group_tp_sizes": list(group_tp_sizes), "group_pages": group_pages,
                   "group_concurrency": group_concurrency, "group_seconds": group_seconds},
        "sizes": results,
        "latency": latency,
        "group": group,
        "targets": judge(results, latency) | judge_group(group),
        "elapsed_s": run.elapsed_s(),
    }
    render(result, console)
    return run.save(result, "bench_dataplane", plot)

