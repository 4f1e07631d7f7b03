"""Cross-host L3 benchmark on emulated hosts: raykv against raw Mooncake on shaped links.

``run_hosts_bench`` starts two emulated hosts (``start_hosts(2)``, root only):
host 0 (the head, where the driver runs as a rank) contributes no store memory, host 1
holds the whole segment, so every byte crosses host 1's link, shaped in turn to each
rate of ``links`` (``tc`` ``tbf``, both ways) in the same cluster and run. For each
rate and page size it times, alternating which goes first:

- **raykv**: the driver's ``CacheClient.batch_set_v1`` / ``batch_get_v1`` of ``batch``
  pages of an MLA host pool through host 0's node actor;
- **raw**: a plain ``MooncakeDistributedStore`` in the driver bound to host 0's address,
  ``batch_put_from`` / ``batch_get_into`` of the same bytes,

and reports GB/s (1e9 bytes/s), raykv over raw (the median of per-iteration ratios) and
the **fraction of the link** each reaches (bits moved per second over the link rate).
What the emulation shows and cannot: docs/benchmarks.md, *Across emulated hosts*.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from raykv.cache_actors.rank.client import CacheClient
from raykv.controllers.contract import StorageConfig
from raykv.controllers.pool_layout import MiB
from raykv_lab.bench.dataplane import make_pages, raw_round, whole_round
from raykv_lab.bench.toolkit import RawStore, gbps, human_bytes, right_table
from raykv_lab.host_plan import parse_rate
from rich.console import Console

DEFAULT_LINKS = ("1gbit", "10gbit", "25gbit")
DEFAULT_PAGE_SIZES = (1 * MiB, 4 * MiB)
SEGMENT_BYTES = 768 * MiB


def bench_link(client: CacheClient, raw: RawStore, link: str, page_bytes: int, batch: int,
               iters: int, run_id: str) -> dict:
    """One row: ``iters`` timed iterations (after an untimed warm-up) of raykv and raw
    put/get of ``batch`` pages of ``page_bytes`` over a link of rate ``link``."""
    pages = make_pages(client, page_bytes, batch)
    raw.resize(2 * batch * page_bytes)
    pages.half(raw.buffer, 0).copy_(pages.half(pages.pool_bytes, 0))
    times: dict[str, list[float]] = {k: [] for k in ("raykv_put", "raykv_get", "raw_put",
                                                     "raw_get")}
    try:
        for it in range(iters + 1):
            hashes = [f"hosts-{run_id}-{link}-{page_bytes}-{it}-{i}" for i in range(batch)]
            raw_keys = [f"raw-{h}" for h in hashes]
            rounds = [("raykv", whole_round, client, hashes), ("raw", raw_round, raw, raw_keys)]
            for name, run, side, keys in (rounds if it % 2 else rounds[::-1]):
                t_put, t_get = run(side, pages, keys)
                if it:
                    times[f"{name}_put"].append(t_put)
                    times[f"{name}_get"].append(t_get)
            raw.remove([k for h in hashes for k in client.key_scheme.kv_keys(h)] + raw_keys)
    finally:
        client.destroy_host_pool(pages.pool)
    nbytes, rate = batch * page_bytes, parse_rate(link)
    row = {"link": link, "page_bytes": page_bytes, "batch": batch}
    for key, ts in times.items():
        median = gbps(nbytes, statistics.median(ts))
        row[f"{key}_gbps"] = median
        row[f"{key}_link_fraction"] = median * 8e9 / rate
    for op in ("put", "get"):
        row[f"ratio_{op}"] = statistics.median(
            r / w for r, w in zip(times[f"raw_{op}"], times[f"raykv_{op}"], strict=True))
    return row


def run_hosts_bench(links: Sequence[str] = DEFAULT_LINKS,
                    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES, batch: int = 32,
                    iters: int = 3, out_dir: str | None = None,
                    console: Console | None = None) -> dict:
    """Run the benchmark (see the module docstring); print a table, write
    ``bench_hosts.json`` into ``out_dir`` (default ``raykv-out/``), return the figures.
    Starts and stops its own emulated hosts: root only, Ray not initialised."""
    import uuid

    from raykv_lab.hosts import start_hosts

    console = console or Console()
    for link in links:
        parse_rate(link)
    run_id = uuid.uuid4().hex[:8]
    with console.status("starting 2 emulated hosts, mooncake_master and the cache actors"):
        cluster = start_hosts(2, link=links[0], segment_sizes=[0, SEGMENT_BYTES], cpus_per_node=1,
                              log_to_driver=False)
    rows = []
    with cluster:
        client = CacheClient(StorageConfig(is_mla_model=True, model_name="raykv-bench-hosts"))
        raw = RawStore(cluster.metadata_server, cluster.master_address, niceness=15,
                       host=cluster.ray_nodes.address(0))
        try:
            for link in links:
                cluster.ray_nodes.set_rate(1, link)
                for size in page_sizes:
                    with console.status(f"{link}, {human_bytes(size)} pages"):
                        rows.append(bench_link(client, raw, link, size, batch, iters, run_id))
        finally:
            raw.close()
            client.close()
    table = right_table("Across emulated hosts: host 0 <-> host 1's segment",
                        ["link", "page", "raykv put", "raw put", "raykv get", "raw get",
                         "ratio put", "ratio get"],
                        caption="GB/s (fraction of the link); ratio: raykv / raw, median "
                                "of per-iteration ratios")
    for r in rows:
        cells = [f"{r[f'{k}_gbps']:.2f} ({r[f'{k}_link_fraction']:.2f})"
                 for k in ("raykv_put", "raw_put", "raykv_get", "raw_get")]
        table.add_row(r["link"], human_bytes(r["page_bytes"]), *cells,
                      f"{r['ratio_put']:.2f}x", f"{r['ratio_get']:.2f}x")
    console.print(table)
    result = {"benchmark": "hosts", "batch": batch, "iters": iters, "rows": rows}
    out = Path(out_dir or "raykv-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hosts.json").write_text(json.dumps(result, indent=2))
    return result
