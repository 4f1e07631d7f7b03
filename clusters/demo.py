"""``raykv demo``: pages written by ranks on one node, read back bit-exact on another.

Ranks are Ray actors pinned to a node, as inference ranks would be. Only keys, indices
and SHA-256 digests of the pages travel through Ray; the bytes move rank -> shared pool
-> node actor -> Mooncake -> node actor of the other node -> its shared pool.
"""

from __future__ import annotations

import hashlib
import time

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from rich.console import Console
from rich.table import Table

from cache_actors import CacheClient
from clusters.local import start_local
from controllers import StorageConfig


@ray.remote(num_cpus=0)
class DemoRank:
    """One TP rank of a toy MHA deployment with a shared host pool on its node."""

    def __init__(self, config: StorageConfig, pool_args: dict) -> None:
        self.client = CacheClient(config)
        self.pool = self.client.create_host_pool("mha", **pool_args)
        self.client.register_mem_pool_host(self.pool)

    def fill(self, seed: int) -> None:
        """Stand-in for KV computed on the GPU: seeded random values."""
        g = torch.Generator().manual_seed(seed)
        self.pool.kv_buffer.copy_(torch.randn(self.pool.kv_buffer.shape, generator=g))

    def digest(self, pages: int) -> str:
        """SHA-256 of the first ``pages`` pages of K and V."""
        slots = pages * self.pool.page_size
        data = self.pool.kv_buffer[:, :slots].contiguous().view(torch.uint8)
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()

    def run(self, method: str, *args) -> tuple[object, float]:
        """Call a CacheClient method; returns (result, seconds)."""
        t = time.perf_counter()
        out = getattr(self.client, method)(*args)
        return out, time.perf_counter() - t


def _rank(node_id: str, tp_rank: int, tp_size: int, model: str, pool_args: dict):
    cfg = StorageConfig(tp_rank=tp_rank, tp_size=tp_size, model_name=model)
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    return DemoRank.options(scheduling_strategy=strategy).remote(cfg, pool_args)


def run_demo(pages: int = 64, page_size: int = 16, layers: int = 8, heads: int = 8,
             head_dim: int = 128, tp_size: int = 2, console: Console | None = None) -> bool:
    """Run the demo; returns True if every rank read back bit-exact what was written."""
    console = console or Console()
    model = "demo/toy-mha"
    pool_args = dict(page_size=page_size, size=pages * page_size, layer_num=layers,
                     head_num=heads, head_dim=head_dim, dtype=torch.bfloat16)
    page_bytes = 2 * page_size * layers * heads * head_dim * 2
    keys = [hashlib.sha256(f"{model}/prefix/{i}".encode()).hexdigest()[:32]
            for i in range(pages)]
    idx = torch.arange(pages * page_size)
    with console.status("starting Ray (2 nodes), mooncake_master and the cache actors"):
        cluster = start_local(num_nodes=2)
    with cluster:
        node1, node2 = cluster.node_ids
        console.print(f"[bold]raykv[/] cluster up: nodes {node1[:8]} and {node2[:8]}, "
                      f"Mooncake master {cluster.master_address}, "
                      f"metadata {cluster.metadata_server}")
        writers = [_rank(node1, r, tp_size, model, pool_args) for r in range(tp_size)]
        readers = [_rank(node2, r, tp_size, model, pool_args) for r in range(tp_size)]
        ray.get([w.fill.remote(r) for r, w in enumerate(writers)])
        table = Table(title=f"{pages} pages x {tp_size} TP ranks, {page_bytes >> 10} KiB "
                      "per page per rank (K+V, bf16)")
        for col in ("step", "rank", "node", "result", "ms", "GB/s"):
            table.add_column(col)
        ok = True
        for r, (w, rd) in enumerate(zip(writers, readers, strict=True)):
            stored, t_set = ray.get(w.run.remote("batch_set_v1", keys, idx))
            again, t_again = ray.get(w.run.remote("batch_set_v1", keys, idx))
            hit, t_ex = ray.get(rd.run.remote("batch_exists", keys))
            got, t_get = ray.get(rd.run.remote("batch_get_v1", keys, idx))
            same = ray.get(w.digest.remote(pages)) == ray.get(rd.digest.remote(pages))
            ok &= all(stored) and all(got) and hit == pages and same
            gbs = pages * page_bytes / 1e9
            table.add_row("batch_set_v1", f"tp{r}", node1[:8], f"{sum(stored)}/{pages} stored",
                          f"{t_set * 1e3:.1f}", f"{gbs / t_set:.2f}")
            table.add_row("batch_set_v1 again", f"tp{r}", node1[:8],
                          f"{sum(again)}/{pages} present (put-if-absent)",
                          f"{t_again * 1e3:.1f}", "")
            table.add_row("batch_exists", f"tp{r}", node2[:8], f"{hit} leading pages",
                          f"{t_ex * 1e3:.1f}", "")
            table.add_row("batch_get_v1", f"tp{r}", node2[:8], f"{sum(got)}/{pages} read",
                          f"{t_get * 1e3:.1f}", f"{gbs / t_get:.2f}")
            table.add_row("compare", f"tp{r}", "", "bit-exact" if same else "[red]DIFFERENT",
                          "", "")
        console.print(table)
        stats = ray.get([a.stats.remote() for a in cluster.node_actors.values()])
        for s in stats:
            c = s["counters"]
            console.print(f"node {s['node_id'][:8]}: {len(s['pools'])} pools, "
                          f"put {c.get('put_objects', 0)} objects "
                          f"({c.get('put_bytes', 0) / 2**20:.1f} MiB), "
                          f"got {c.get('get_objects', 0)} objects "
                          f"({c.get('get_bytes', 0) / 2**20:.1f} MiB)")
        console.print("[green]OK[/]: pages written on one node were read back bit-exact on "
                      "the other" if ok else "[red]FAILED[/]")
    return ok
