"""``raykv bench-gpu``'s vLLM part: a device KV cache in each of vLLM 0.32's physical
layouts, moved through the connector worker's own two paths, byte for byte.

vLLM hands its connector one logical ``[B, H, N, C]`` view per layer over a physical
layout named by the order of its axes (``vllm.v1.kv_cache_layout.KVCacheLayout``: the
logical ``[L, B, H, N, C]`` permuted, e.g. ``LBNHC``, one ``[B, N, H, C]`` tensor per
layer, or ``BLNHC``, every layer of a block side by side). ``LAYOUTS`` lists those
orders; ``kv_cache`` builds such a cache on the device without vLLM. Each layout's
cache is served by one ``VllmWorkerKV``: the worker's own views (``kv_views``), its
staging pool (``StagedPool`` + ``batch_set_v2`` / ``batch_get_v2``: the store path, L3)
and its node-local cache (``L2Blocks``: an L2 pool, the node puts to L3 behind). Blocks saved
from one layout are loaded into the next layout's cache and compared there as logical
views, so every pair proves that a page's bytes do not depend on the physical layout.
The floor of each save and load is the same blocks' device copies into and out of a
buffer torch allocated pinned, timed in the same round. Last, ``bench_saves_behind``: a
step's L2 save right after a stand-in forward, on the step and behind it (what
``async_transfers`` runs), the blocks reused at once, each save compared with the
forward's values.

Units: bytes, GB/s (1e9 bytes per second), seconds.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from raykv import (
    CacheClient,
    EngineMemory,
    PoolLayout,
    PoolName,
    PoolTransfer,
    StagedPool,
    StorageConfig,
    staging_layout,
)
from raykv.integrations.vllm.kv_views import (
    block_slots,
    block_views,
    pool_block_views,
    pool_dims,
)
from raykv.integrations.vllm.l2_blocks import L2Blocks
from raykv_lab.bench.toolkit import timed

# vLLM 0.32's KVCacheLayout members: the physical order of the logical [L, B, H, N, C].
LAYOUTS: dict[str, tuple[int, ...]] = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}


@dataclass(frozen=True)
class VllmGeometry:
    """A model's KV cache as vLLM holds it: ``layers`` layers of ``blocks`` blocks of
    ``block_size`` tokens, ``heads`` KV heads of ``head_size`` values for K and as many
    for V (``C = 2 * head_size``), bf16; ``moved`` blocks per transfer; ``window``:
    the staging pool's pages. Default: Llama-3-8B's (32 layers, 8 KV heads of 128),
    2 MiB per block."""

    layers: int = 32
    heads: int = 8
    head_size: int = 128
    block_size: int = 16
    blocks: int = 128
    moved: int = 64
    window: int = 64

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of every layer (one page)."""
        return self.layers * self.heads * self.block_size * 2 * self.head_size * 2

    def layout(self) -> PoolLayout:
        """The raykv pool layout of this geometry's blocks, as the worker registers it."""
        heads, dim = pool_dims((self.heads, self.block_size, 2 * self.head_size),
                               self.block_size)
        return PoolLayout.vllm(page_size=self.block_size, size=self.blocks * self.block_size,
                               layer_num=self.layers, head_num=heads, head_dim=dim,
                               dtype="bfloat16", itemsize=2)


def kv_cache(geo: VllmGeometry, order: tuple[int, ...], device: str) -> list[torch.Tensor]:
    """A KV cache of ``geo`` in the physical layout ``order`` (one buffer, as vLLM
    allocates it), as vLLM hands it to a connector: one logical ``[B, H, N, C]`` view
    per layer. Filled with random values."""
    logical = (geo.layers, geo.blocks, geo.heads, geo.block_size, 2 * geo.head_size)
    raw = torch.randn([logical[i] for i in order], dtype=torch.bfloat16, device=device)
    view = raw.permute([order.index(i) for i in range(5)])
    return [view[layer] for layer in range(geo.layers)]


class VllmWorkerKV:
    """One vLLM worker's KV cache (``layers``: vLLM's per-layer logical views) served
    as the connector's worker serves it, by a client of its own: the staging pool of
    ``geo.window`` pages registered as the KV pool, and the node's L2 pool of at most
    ``l2_pages`` pages (None: the node had no room)."""

    def __init__(self, geo: VllmGeometry, layers: list[torch.Tensor], model_name: str,
                 l2_pages: int) -> None:
        self.geo = geo
        self.layers = block_views(layers, geo.blocks, geo.block_size)
        block_shape = tuple(self.layers[0].shape[1:])
        layout = geo.layout()
        self.client = CacheClient(StorageConfig(model_name=model_name, extra_config={
            "kv_dtype": "bfloat16", "page_size": geo.block_size}))
        try:
            self.pool = self.client.create_host_pool(staging_layout(layout, geo.window),
                                                     per_process=True)

            def pages(pool) -> list[torch.Tensor]:
                return pool_block_views(pool.kv_buffer, block_shape)

            self.client.register_mem_host_pool_v2(StagedPool(
                EngineMemory(layout, self.layers), self.pool, geo.window, shared=True,
                stage=pages), PoolName.KV)
            self.l2 = L2Blocks.open(self.client, self.layers, pages,
                                    staging_layout(layout, 1), l2_pages)
        except BaseException:
            self.client.close()
            raise

    def _slots(self, block_ids: list[int]) -> torch.Tensor:
        return block_slots(block_ids, self.geo.block_size)

    def save_l3(self, block_ids: list[int], hashes: list[str]) -> int:
        """Blocks saved through the staging pool into the store."""
        return sum(self.client.batch_set_v2([PoolTransfer(
            PoolName.KV, hashes, self._slots(block_ids))])[PoolName.KV])

    def load_l3(self, block_ids: list[int], hashes: list[str]) -> int:
        """Blocks loaded from the store through the staging pool."""
        return sum(self.client.batch_get_v2([PoolTransfer(
            PoolName.KV, hashes, self._slots(block_ids))])[PoolName.KV])

    def save_l2(self, block_ids: list[int], hashes: list[str]) -> int:
        """Blocks now in the node's L2 (the node puts them to L3 behind)."""
        return self.l2.save(block_ids, hashes)[0]

    def load_l2(self, block_ids: list[int], hashes: list[str]) -> int:
        """Leading blocks loaded from the node's L2."""
        return self.l2.load(block_ids, hashes)[0]

    def close(self) -> None:
        self.client.destroy_host_pool(self.pool)
        self.client.close()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, *args) -> tuple[float, object]:
    """(seconds from a synchronised device until ``fn(*args)`` and the device work it
    queued are done, its result)."""
    _sync()
    t, out = timed(fn, *args)
    _sync()
    return t, out


def _equal(a: VllmWorkerKV, b: VllmWorkerKV, n: int) -> bool:
    """Whether blocks ``[0, n)`` of ``a`` and of ``b`` hold the same logical bytes."""
    return all(torch.equal(x[:n], y[:n]) for x, y in zip(a.layers, b.layers, strict=True))


def _copies(src: VllmWorkerKV, dst: VllmWorkerKV, host: list[torch.Tensor],
            n: int) -> tuple[float, float]:
    """The floor: blocks ``[0, n)`` of ``src`` into the pinned ``host`` buffers and from
    them into ``dst``, layer by layer; (device -> host s, host -> device s)."""
    t_d2h, _ = _timed(lambda: [h.copy_(x[:n]) for h, x in zip(host, src.layers, strict=True)])
    t_h2d, _ = _timed(lambda: [y[:n].copy_(h) for h, y in zip(host, dst.layers, strict=True)])
    return t_d2h, t_h2d


PATHS = ("l2_save", "l2_load", "l3_save", "l3_load", "copy_d2h", "copy_h2d")
FORWARD_PRODUCTS = 10  # the stand-in forward: this many square matrix products


def _forward(src: VllmWorkerKV, n: int, fresh: list[torch.Tensor], work: torch.Tensor) -> None:
    """A stand-in for vLLM's forward, queued on the current stream: ``FORWARD_PRODUCTS``
    products of ``work`` with itself, then ``fresh`` into blocks ``[0, n)`` of every
    layer of ``src`` (the KV the step's saves must take, not the blocks' earlier
    values)."""
    for _ in range(FORWARD_PRODUCTS):
        torch.mm(work, work)
    for x, f in zip(src.layers, fresh, strict=True):
        x[:n].copy_(f)


def bench_saves_behind(src: VllmWorkerKV, dst: VllmWorkerKV, n: int, run_id: str,
                       rounds: int, forward_dim: int) -> dict:
    """A step's L2 save right after its forward was queued, ``rounds`` times each way:
    on the step (``L2Blocks.save``: the host waits for the forward and the copy) and
    behind it (``save_behind``: the blocks gathered on the current stream, copied to the
    host on the L2's; ``wait`` at the next step), the saved blocks then zeroed on the
    current stream at once, as vLLM zeroes a freed block it gives to another request
    (a copy behind that read vLLM's blocks on a stream of its own could read those
    zeros). Seconds the host spent in the save (``sync_s``,
    ``behind_step_s``), until the behind save was committed (``behind_done_s``), and
    of the forward alone (``forward_s``), and of one L2 op with nothing in it
    (``l2_op_s``: a node round trip, of which a save behind makes one); each save then
    loaded into ``dst`` and compared with the forward's values, not the zeros
    (``RuntimeError`` if they differ)."""
    work = torch.randn(forward_dim, forward_dim, dtype=torch.bfloat16,
                       device=src.layers[0].device)
    ids = list(range(n))
    times: dict[str, list[float]] = {k: [] for k in ("forward_s", "sync_s", "behind_step_s",
                                                      "behind_done_s", "l2_op_s")}
    for r in range(rounds):
        times["l2_op_s"].append(timed(src.l2.release)[0])
        for way in ("forward", "sync", "behind"):
            fresh = [torch.randn_like(x[:n]) for x in src.layers]
            hashes = [f"gpu-vllm-{run_id}-{way}-{r}-{b}" for b in ids]
            _sync()
            t0 = time.perf_counter()
            _forward(src, n, fresh, work)
            if way == "forward":
                _sync()
                times["forward_s"].append(time.perf_counter() - t0)
                continue
            t0 = time.perf_counter()
            if way == "sync":
                saved, _ = src.l2.save(ids, hashes)
                times["sync_s"].append(time.perf_counter() - t0)
            else:
                behind = src.l2.save_behind(ids, hashes)
                times["behind_step_s"].append(time.perf_counter() - t0)
            for x in src.layers:  # vLLM reusing the blocks
                x[:n].zero_()
            if way == "behind":
                saved, _ = behind.wait()
                times["behind_done_s"].append(time.perf_counter() - t0)
            for y in dst.layers:
                y[:n].zero_()
            loaded = dst.load_l2(ids, hashes)
            _sync()
            same = all(torch.equal(y[:n], f) for y, f in zip(dst.layers, fresh, strict=True))
            if saved != n or loaded != n or not same:
                raise RuntimeError(f"L2 save {way} the forward: {saved} of {n} blocks saved, "
                                   f"{loaded} loaded, or the bytes loaded are not the "
                                   "forward's")
    return {"forward_dim": forward_dim, "products": FORWARD_PRODUCTS, "blocks": n,
            "equal": True, "median_ms": {k: statistics.median(v) * 1e3
                                         for k, v in times.items()}, "seconds": times}


def l2_pages(geo: VllmGeometry, rounds: int, layouts: dict = LAYOUTS) -> int:
    """L2 pages ``bench_vllm_layouts`` keeps: every block it saved into L2."""
    return (len(layouts) + 2) * rounds * geo.moved


def bench_vllm_layouts(run_id: str, device: str, geo: VllmGeometry, rounds: int = 3,
                       layouts: dict[str, tuple[int, ...]] = LAYOUTS,
                       forward_dim: int = 8192) -> dict:
    """Per layout X (and the next one, Y): ``rounds`` times, ``geo.moved`` blocks of X
    saved into L2 and loaded from L2 into Y, saved through the staging pool into the
    store and loaded from it into Y, each load compared with X on the device; and the
    same blocks' pinned device copies. ``RuntimeError`` if a block did not move or came
    back with other bytes. Needs a cluster whose node L2 holds
    ``l2_pages(geo, rounds, layouts)`` pages. Then ``bench_saves_behind`` over the first
    two layouts (a stand-in forward of ``forward_dim``-square products)."""
    names = list(layouts)
    n = geo.moved
    pages = l2_pages(geo, rounds, layouts)
    workers = {}
    try:
        for name in names:
            workers[name] = VllmWorkerKV(geo, kv_cache(geo, layouts[name], device),
                                         "raykv-bench-gpu-vllm", pages)
        if any(w.l2 is None for w in workers.values()):
            raise RuntimeError(f"the node had no L2 room for {pages} pages of "
                               f"{geo.block_bytes} bytes")
        host = [torch.empty(x[:n].shape, dtype=x.dtype, pin_memory=device == "cuda")
                for x in workers[names[0]].layers]
        per_layout = {}
        for i, name in enumerate(names):
            src, dst = workers[name], workers[names[(i + 1) % len(names)]]
            times: dict[str, list[float]] = {k: [] for k in PATHS}
            ids = list(range(n))
            for r in range(rounds):
                for tier in ("l3", "l2"):
                    hashes = [f"gpu-vllm-{run_id}-{name}-{tier}-{r}-{b}" for b in ids]
                    for y in dst.layers:
                        y[:n].zero_()
                    t_save, saved = _timed(getattr(src, f"save_{tier}"), ids, hashes)
                    t_load, loaded = _timed(getattr(dst, f"load_{tier}"), ids, hashes)
                    if saved != n or loaded != n:
                        raise RuntimeError(f"vLLM layout {name}, {tier}: {saved} of {n} "
                                           f"blocks saved, {loaded} loaded")
                    if not _equal(src, dst, n):
                        raise RuntimeError(f"vLLM layout {name} -> {names[(i + 1) % len(names)]}"
                                           f", {tier}: the blocks loaded differ from the "
                                           "blocks saved")
                    times[f"{tier}_save"].append(t_save)
                    times[f"{tier}_load"].append(t_load)
                t_d2h, t_h2d = _copies(src, dst, host, n)
                times["copy_d2h"].append(t_d2h)
                times["copy_h2d"].append(t_h2d)
            nbytes = n * geo.block_bytes
            med = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
            per_layout[name] = {"loaded_into": names[(i + 1) % len(names)], "equal": True,
                                "gbps": med, "seconds": times}
        behind = bench_saves_behind(workers[names[0]], workers[names[1]], n, run_id, rounds,
                                    forward_dim)
        l2_pinned = workers[names[0]].l2.pool.pinned
        staging_pinned = workers[names[0]].pool.pinned
    finally:
        for w in workers.values():
            w.close()
    return {"geometry": {"layers": geo.layers, "heads": geo.heads, "head_size": geo.head_size,
                         "block_size": geo.block_size, "block_bytes": geo.block_bytes,
                         "moved": n, "bytes": n * geo.block_bytes, "rounds": rounds},
            "l2_pinned": l2_pinned, "staging_pinned": staging_pinned,
            "layouts": per_layout, "saves_behind": behind}
