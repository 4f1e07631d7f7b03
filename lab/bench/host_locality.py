"""What locality is worth, on emulated hosts: a same-host L2 hit against L3 reads of the
same prefix, from the host's own segment and across a shaped link.

``run_locality_bench`` starts two emulated hosts (``start_hosts(2)``, root only):
host A (host 0, the head) holds the whole Mooncake segment, host B (host 1) none, so
an object lives on A and B reaches it only over its link (B's, shaped in turn to each
rate of ``links``; ``"unshaped"``: no ``tc`` shaping, what the machine moves through a
veth pair). Ranks are Ray actors doing what a vLLM worker does (no vLLM: the engine's
KV cache is a list of per-layer ``(blocks, heads, block_size, 2 * head_dim)`` tensors,
vLLM's CPU block layout, one block of every layer per page; ``geometry``):

- a *writer* on A saves the prefix (``pages`` blocks of random bytes, a seed of its
  own per page size) through the node's L2 (``L2Blocks.save``); A's node actor puts it
  to L3 behind (write-behind), onto A's segment;
- **L2, same host**: another rank on A (another engine of the deployment) loads it
  with ``L2Blocks.load`` (pages acquired from A's L2, copied into its blocks);
- **L3, own segment**: the same rank loads it as a worker without L2 does:
  ``batch_get_v2`` through a staging pool of ``pages`` pages (``StagedPool``; A's
  node actor gets it from A's segment, then the rank copies it into its blocks);
- **L3, across the link**: a rank on B loads it the same way (B's node actor gets it
  from A's segment, over B's link).

Each load starts from zeroed blocks and is compared byte for byte with the prefix
written (outside the timed part); a load that is short or differs fails the run. Per
link rate and page size: ``iters`` timed loads per source after an untimed warm-up,
the sources in turn (order rotating per iteration). Figures: the median latency per
prefix (p50, ms), GB/s of it (1e9 bytes/s), L2 over cross-host L3 (latency ratio:
how many times faster the L2 hit is), the fraction of the link a cross-host load
fills (bits per second over the rate), and the Mooncake gets each source made on its
node (the node's ``get_objects`` counter: none for L2, one per page for L3).
What the emulation shows and cannot: docs/benchmarks.md, *Across emulated hosts*.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
from raykv.cache_actors.rank.client import CacheClient
from raykv.cache_actors.rank.staging_pools import EngineMemory, StagedPool, staging_layout
from raykv.controllers.contract import PoolName, PoolTransfer, StorageConfig
from raykv.controllers.pool_layout import KiB, MiB, PoolLayout
from raykv.integrations.vllm.l2_blocks import L2Blocks
from raykv_lab.bench.toolkit import gbps, human_bytes, right_table
from raykv_lab.host_plan import parse_rate
from rich.console import Console

UNSHAPED = "unshaped"
DEFAULT_LINKS = ("1gbit", "10gbit", "25gbit", UNSHAPED)
DEFAULT_PAGE_SIZES = (256 * KiB, 2 * MiB)
"""256 KiB pages, and 2 MiB: one 16-token block of Llama-3-8B (32 layers, 8 KV heads of
128, K and V, bf16) per page, so 64 pages are a 1024-token prompt's prefix."""
DEFAULT_PAGES = 64
BLOCK_TOKENS = 16
KV_HEADS = 8
HEAD_DIM = 128
LAYER_BYTES = BLOCK_TOKENS * KV_HEADS * 2 * HEAD_DIM * 2
"""Bytes of one block of one layer (K and V, bf16): 64 KiB."""
SOURCES = ("l2", "l3_own", "l3_cross")
TIMEOUT_S = 60.0
"""Deadline of each rank's raykv calls, in seconds (a 128 MiB prefix over 1 Gbit/s
takes about 1.1 s)."""
FLUSH_WAIT_S = 120.0


def geometry(page_bytes: int) -> dict:
    """The ``PoolLayout.vllm`` arguments of a page of ``page_bytes`` bytes: 16-token
    blocks of 8 KV heads of head_dim 128 (K and V: 256 values per head and token), bf16,
    as many layers as make the page. ``ValueError`` unless ``page_bytes`` is a positive
    multiple of ``LAYER_BYTES``."""
    if page_bytes < LAYER_BYTES or page_bytes % LAYER_BYTES:
        raise ValueError(f"a locality page is a whole number of layers of "
                         f"{human_bytes(LAYER_BYTES)}, got {page_bytes} bytes")
    return {"page_size": BLOCK_TOKENS, "layer_num": page_bytes // LAYER_BYTES,
            "head_num": KV_HEADS, "head_dim": 2 * HEAD_DIM, "dtype": "bfloat16",
            "itemsize": 2}


def prefix_layers(seed: int, geom: dict, pages: int) -> list[torch.Tensor]:
    """The prefix of ``seed``: per layer ``(pages, heads, block, 2 * head_dim)`` bf16
    tensors of random bytes (the same in every process)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (pages, geom["head_num"], geom["page_size"], geom["head_dim"])
    return [torch.randint(0, 256, (*shape[:-1], 2 * shape[-1]), dtype=torch.uint8,
                          generator=gen).view(torch.bfloat16)
            for _ in range(geom["layer_num"])]


@ray.remote(num_cpus=0)
class LocalityRank:
    """One rank of the deployment ``model_name`` on its node: vLLM-shaped blocks, a
    staging pool registered as its KV pool (a worker's L3 path) and, on first use, the
    node's L2 of the deployment (``L2Blocks``). Methods run one at a time."""

    def __init__(self, model_name: str, page_bytes: int, pages: int, seed: int) -> None:
        geom = geometry(page_bytes)
        self._pages, self._seed, self._geom = pages, seed, geom
        self._client = CacheClient(StorageConfig(model_name=model_name,
                                                 extra_config={"timeout_s": TIMEOUT_S}))
        self._layout = PoolLayout.vllm(size=pages * geom["page_size"], **geom)
        block = (geom["head_num"], geom["page_size"], geom["head_dim"])
        self._layers = [torch.zeros((pages, *block), dtype=torch.bfloat16)
                        for _ in range(geom["layer_num"])]
        self._want: list[torch.Tensor] | None = None  # the prefix, once a read compares
        staging = self._client.create_host_pool(staging_layout(self._layout, pages),
                                                per_process=True)
        self._client.register_mem_host_pool_v2(
            StagedPool(EngineMemory(self._layout, self._layers), staging, pages,
                       shared=True, stage=self._stage), PoolName.KV)
        self._l2: L2Blocks | None = None

    def _stage(self, pool) -> list[torch.Tensor]:
        """A pool's pages per layer, lining up with the blocks (as the vLLM worker's)."""
        buf = pool.kv_buffer
        pages = buf.view(buf.shape[0], buf.shape[1], -1)
        return [pages[:, layer].view(buf.shape[0], *self._layers[0].shape[1:])
                for layer in range(buf.shape[1])]

    def _l2_blocks(self) -> L2Blocks:
        if self._l2 is None:
            self._l2 = L2Blocks.open(self._client, self._layers, self._stage,
                                     staging_layout(self._layout, 1), self._pages)
            if self._l2 is None:
                raise RuntimeError("the node has no L2 room for the prefix")
        return self._l2

    def write(self, hashes: list[str]) -> int:
        """Save the prefix into the node's L2 (written behind to L3): blocks saved."""
        for block, src in zip(self._layers, prefix_layers(self._seed, self._geom,
                                                          self._pages), strict=True):
            block.copy_(src)
        saved, full = self._l2_blocks().save(list(range(self._pages)), hashes)
        if full:
            raise RuntimeError(f"the node's L2 had no page for {len(full)} blocks")
        return saved

    def read(self, source: str, hashes: list[str]) -> dict:
        """Load the prefix into zeroed blocks from ``source`` (``l2``: the node's L2;
        otherwise L3 through the staging pool): ``{"s": seconds of the load, "loaded":
        leading blocks loaded, "same": every byte equals the prefix written}``."""
        for block in self._layers:
            block.zero_()
        ids = list(range(self._pages))
        if source == "l2":
            l2 = self._l2_blocks()
            t0 = time.perf_counter()
            loaded, _ = l2.load(ids, hashes)
            seconds = time.perf_counter() - t0
        else:
            slots = (torch.tensor(ids)[:, None] * self._geom["page_size"]
                     + torch.arange(self._geom["page_size"])).reshape(-1)
            t0 = time.perf_counter()
            ok = self._client.batch_get_v2([PoolTransfer(PoolName.KV, hashes, slots)]
                                           )[PoolName.KV]
            seconds = time.perf_counter() - t0
            loaded = ok.index(False) if False in ok else len(ok)
        if self._want is None:
            self._want = prefix_layers(self._seed, self._geom, self._pages)
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(self._layers, self._want, strict=True))
        return {"s": seconds, "loaded": loaded, "same": same}

    def close(self) -> None:
        self._client.close()


def _gets(actor) -> int:
    """The node actor's Mooncake objects got so far (``get_objects``)."""
    return ray.get(actor.stats.remote()).counters.get("get_objects", 0)


def wait_written(actor, puts: int) -> None:
    """Wait until the node actor's L2 put ``puts`` pages to L3 behind the writer
    (``RuntimeError`` after ``FLUSH_WAIT_S``)."""
    deadline = time.monotonic() + FLUSH_WAIT_S
    while (done := ray.get(actor.stats.remote()).l2.l3_put) < puts:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the write-behind put {done} of {puts} pages to L3 in "
                               f"{FLUSH_WAIT_S:.0f} s")
        time.sleep(0.05)


class Prefix:
    """One page size's prefix: its deployment, hashes and ranks (writer and L2/L3
    reader on host A, L3 reader on host B)."""

    def __init__(self, cluster, node_a: str, node_b: str, page_bytes: int, pages: int,
                 run_id: str, seed: int) -> None:
        model = f"raykv-bench-locality-{run_id}-{page_bytes}"
        self.page_bytes, self.pages = page_bytes, pages
        self.hashes = [f"locality-{run_id}-{page_bytes}-{i}" for i in range(pages)]

        def rank(node: str):
            return LocalityRank.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node, soft=False)).remote(model, page_bytes, pages, seed)

        self.writer, self.reader_a, self.reader_b = rank(node_a), rank(node_a), rank(node_b)
        self.readers = {"l2": (self.reader_a, cluster.node_actors[node_a]),
                        "l3_own": (self.reader_a, cluster.node_actors[node_a]),
                        "l3_cross": (self.reader_b, cluster.node_actors[node_b])}

    def close(self) -> None:
        for r in (self.writer, self.reader_a, self.reader_b):
            ray.get(r.close.remote())
            ray.kill(r)


def bench_prefix(prefix: Prefix, link: str, iters: int) -> dict:
    """One row: ``iters`` timed loads of the prefix from each source (after a warm-up),
    sources in turn; ``RuntimeError`` if any load is short or has wrong bytes."""
    times: dict[str, list[float]] = {s: [] for s in SOURCES}
    gets = dict.fromkeys(SOURCES, 0)
    for it in range(iters + 1):
        order = SOURCES[it % 3:] + SOURCES[:it % 3]
        for source in order:
            reader, node = prefix.readers[source]
            before = _gets(node)
            r = ray.get(reader.read.remote(source, prefix.hashes))
            if r["loaded"] != prefix.pages or not r["same"]:
                raise RuntimeError(f"{source} at {link}: {r['loaded']} of {prefix.pages} "
                                   f"pages loaded, bytes {'equal' if r['same'] else 'differ'}")
            if it:
                times[source].append(r["s"])
                gets[source] += _gets(node) - before
    nbytes = prefix.pages * prefix.page_bytes
    row: dict = {"link": link, "page_bytes": prefix.page_bytes, "pages": prefix.pages,
                 "prefix_bytes": nbytes, "verified_loads": 3 * (iters + 1)}
    for source, ts in times.items():
        p50 = statistics.median(ts)
        row[source] = {"p50_ms": 1000 * p50, "gbps": gbps(nbytes, p50),
                       "ms": [1000 * t for t in ts], "gets_per_load": gets[source] / iters}
    row["l2_vs_cross"] = row["l3_cross"]["p50_ms"] / row["l2"]["p50_ms"]
    row["own_vs_cross"] = row["l3_cross"]["p50_ms"] / row["l3_own"]["p50_ms"]
    row["cross_link_fraction"] = (None if link == UNSHAPED
                                  else row["l3_cross"]["gbps"] * 8e9 / parse_rate(link))
    return row


def run_locality_bench(links: Sequence[str] = DEFAULT_LINKS,
                       page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
                       pages: int = DEFAULT_PAGES, iters: int = 3,
                       out_dir: str | None = None, console: Console | None = None) -> dict:
    """Run the benchmark (see the module docstring); print a table, write
    ``bench_hosts_locality.json`` into ``out_dir`` (default ``raykv-out/``), return the
    figures. Starts and stops its own emulated hosts: root only, Ray not initialised.
    ``ValueError`` for a bad link rate or page size before anything starts."""
    from raykv.clusters.local import local_settings
    from raykv_lab.hosts import start_hosts

    console = console or Console()
    for link in links:
        if link != UNSHAPED:
            parse_rate(link)
    for size in page_sizes:
        geometry(size)
    prefix_bytes = pages * sum(page_sizes)
    run_id = uuid.uuid4().hex[:8]
    first = None if links[0] == UNSHAPED else links[0]
    with console.status("starting 2 emulated hosts, mooncake_master and the cache actors"):
        cluster = start_hosts(2, settings=local_settings(l2_bytes=prefix_bytes + 64 * MiB),
                              link=first, segment_sizes=[prefix_bytes + 64 * MiB, 0],
                              cpus_per_node=1, log_to_driver=False)
    rows = []
    with cluster:
        node_a, node_b = sorted(cluster.node_ids, key=cluster.ray_nodes.host_of)
        prefixes = []
        try:
            with console.status("writing the prefixes into host A's L2 (and L3 behind)"):
                for seed, size in enumerate(page_sizes, 1):
                    prefixes.append(Prefix(cluster, node_a, node_b, size, pages, run_id,
                                            seed))
                    ray.get(prefixes[-1].writer.write.remote(prefixes[-1].hashes))
                    wait_written(cluster.node_actors[node_a], len(prefixes) * pages)
            shaped = first is not None
            for link in links:
                if link != UNSHAPED:
                    cluster.ray_nodes.set_rate(1, link)
                elif shaped:
                    cluster.ray_nodes.set_rate(1, None)
                shaped = link != UNSHAPED
                for prefix in prefixes:
                    with console.status(f"{link}, {human_bytes(prefix.page_bytes)} pages"):
                        rows.append(bench_prefix(prefix, link, iters))
        finally:
            for prefix in prefixes:
                prefix.close()
    console.print(_table(rows, pages))
    result = {"benchmark": "hosts_locality", "pages": pages, "iters": iters, "rows": rows}
    out = Path(out_dir or "raykv-out")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_hosts_locality.json").write_text(json.dumps(result, indent=2))
    return result


def _table(rows: list[dict], pages: int):
    table = right_table(f"What locality is worth: a {pages}-page prefix written on host A",
                        ["link", "page", "L2, host A", "L3 own segment, host A",
                         "L3 across the link, host B", "L2 / cross", "link used"],
                        caption="p50 ms per prefix (GB/s); L2 / cross: how many times "
                                "faster the L2 hit loads than the cross-host read")
    for r in rows:
        cells = [f"{r[s]['p50_ms']:.1f} ({r[s]['gbps']:.2f})" for s in SOURCES]
        frac = r["cross_link_fraction"]
        table.add_row(r["link"], human_bytes(r["page_bytes"]), *cells,
                      f"{r['l2_vs_cross']:.1f}x", "-" if frac is None else f"{frac:.2f}")
    return table
