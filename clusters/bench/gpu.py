"""GPU benchmark: KV pages from a CUDA device through raykv and back, byte for byte.

``run_gpu_bench`` needs one CUDA GPU. It starts an embedded two-node cluster in which
the head node (where the driver runs, as the rank) contributes no store memory, so every
object crosses Mooncake's transport, and measures for each page size:

- **host pool**: the device -> host copy of ``batch`` pages into a raykv host pool (which
  the rank page-locks with ``cudaHostRegister`` when it maps it) and the host -> device
  copy back, against the same copies into a buffer that torch allocated pinned
  (``pin_memory=True``) and into a pageable one, in the same iteration;
- **whole path**: device -> pool, ``batch_set_v1``, ``batch_get_v1`` into other pages of
  the pool, pool -> device, then a byte comparison on the device (every iteration);
- **raw Mooncake**: ``batch_put_from`` / ``batch_get_into`` of the same bytes from a
  plain client's registered buffer;
- **vLLM layout**: vLLM's CUDA KV cache layout (per layer ``(2, num_blocks,
  block_size, num_kv_heads, head_size)``, the block axis second) served through a
  staging pool the way the connector's worker serves it (``StagedPool`` over per-layer
  block views), saved and loaded into other blocks, compared on the device.

Units: bytes, GB/s (1e9 bytes per second), seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from raykv import (
    CacheClient,
    EngineMemory,
    GiB,
    KiB,
    MiB,
    PoolLayout,
    PoolName,
    PoolTransfer,
    StagedPool,
    StorageConfig,
    staging_layout,
)
from raykv.clusters.bench.dataplane import Pages, make_pages
from raykv.clusters.bench.toolkit import (
    BenchRun,
    RawStore,
    check_codes,
    gbps_text,
    human_bytes,
    layer_num_for,
    machine_info,
    right_table,
    save,
    start_cluster,
    summarize,
    timed,
)
from rich.console import Console

DEFAULT_PAGE_SIZES = (256 * KiB, 1 * MiB, 4 * MiB)
SEGMENT_BYTES = 3 * GiB
# vLLM-layout check: a small model's geometry (bf16, 16-token blocks).
VLLM_LAYERS, VLLM_HEADS, VLLM_HEAD_SIZE, VLLM_BLOCK = 8, 8, 128, 16
VLLM_BLOCKS, VLLM_WINDOW = 256, 64


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _synced(fn, *args) -> object:
    """``fn(*args)``, then wait for the device work it queued."""
    out = fn(*args)
    _sync()
    return out


def _cuda_timed(fn, *args) -> tuple[float, object]:
    """``timed(fn, *args)`` from a synchronised device until the work ``fn`` queued is
    done; (seconds, result)."""
    _sync()
    return timed(_synced, fn, *args)


def _copies(dev: torch.Tensor, host: torch.Tensor) -> tuple[float, float]:
    """(device -> host seconds, host -> device seconds) of ``dev``'s bytes."""
    t_d2h, _ = _cuda_timed(host.copy_, dev)
    t_h2d, _ = _cuda_timed(dev.copy_, host)
    return t_d2h, t_h2d


def bench_size(client: CacheClient, raw: RawStore, page_bytes: int, batch: int, iters: int,
               run_id: str, device: str = "cuda") -> dict:
    """One page size: ``iters`` timed iterations after one untimed warm-up; every
    iteration compares the bytes that came back on the device (``RuntimeError`` if they
    differ or a page failed)."""
    pages: Pages = make_pages(client, page_bytes, batch)
    n = batch * page_bytes
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    scratch = torch.empty_like(src)  # the host copies' device side: src stays untouched
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=device == "cuda")
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.zero_()
    raw.resize(2 * n)
    pinned_pool = pages.pool.pinned
    times: dict[str, list[float]] = {k: [] for k in (
        "pool_d2h", "pool_h2d", "pinned_d2h", "pinned_h2d", "pageable_d2h", "pageable_h2d",
        "whole_put", "whole_get", "raw_put", "raw_get", "round_trip")}
    try:
        for it in range(iters + 1):
            scratch.copy_(src)
            took = {}
            for name, host in (("pool", pages.half(pages.pool_bytes, 0)),
                               ("pinned", pinned), ("pageable", pageable)):
                took[f"{name}_d2h"], took[f"{name}_h2d"] = _copies(scratch, host)
            hashes = [f"gpu-{run_id}-{page_bytes}-{it}-{i}" for i in range(batch)]
            dst.zero_()
            t_d2h, _ = _cuda_timed(pages.half(pages.pool_bytes, 0).copy_, src)
            t_put, ok_put = _cuda_timed(client.batch_set_v1, hashes, pages.src_indices)
            t_get, ok_get = _cuda_timed(client.batch_get_v1, hashes, pages.dst_indices)
            t_h2d, _ = _cuda_timed(dst.copy_, pages.half(pages.pool_bytes, 1))
            if not (all(ok_put) and all(ok_get)):
                raise RuntimeError(f"{human_bytes(page_bytes)} pages: {ok_put.count(False)} "
                                   f"puts and {ok_get.count(False)} gets failed")
            if not torch.equal(src, dst):
                raise RuntimeError(f"{human_bytes(page_bytes)} pages: the bytes back on the "
                                   "device differ from the bytes sent")
            took |= {"whole_put": t_put, "whole_get": t_get,
                     "round_trip": t_d2h + t_put + t_get + t_h2d}
            raw_keys = [f"raw-{h}" for h in hashes]
            pages.half(raw.buffer, 0).copy_(pages.half(pages.pool_bytes, 0))
            took["raw_put"], codes = raw.timed(raw.store.batch_put_from, raw_keys,
                                               raw.ptrs(0, batch, page_bytes),
                                               [page_bytes] * batch)
            check_codes("raw batch_put_from", codes, lambda c: c == 0)
            took["raw_get"], codes = raw.timed(raw.store.batch_get_into, raw_keys,
                                               raw.ptrs(batch, batch, page_bytes),
                                               [page_bytes] * batch)
            check_codes("raw batch_get_into", codes, lambda c: c == page_bytes)
            raw.remove([k for h in hashes for k in client.key_scheme.kv_keys(h)] + raw_keys)
            if it:
                for k, t in took.items():
                    times[k].append(t)
    finally:
        client.destroy_host_pool(pages.pool)
        raw.release()
    out = {"page_bytes": page_bytes, "batch": batch, "batch_bytes": n,
           "pool_pinned": pinned_pool}
    out |= {k: summarize(n, t) for k, t in times.items()}
    for d in ("d2h", "h2d"):
        out[f"ratio_pool_{d}"] = (out[f"pool_{d}"]["median_gbps"]
                                  / out[f"pinned_{d}"]["median_gbps"])
        out[f"ratio_pageable_{d}"] = (out[f"pageable_{d}"]["median_gbps"]
                                      / out[f"pinned_{d}"]["median_gbps"])
    for op in ("put", "get"):
        out[f"ratio_{op}"] = out[f"whole_{op}"]["median_gbps"] / out[f"raw_{op}"]["median_gbps"]
    return out


def vllm_layout_views(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's CUDA per-layer KV tensors ``(2, num_blocks, block_size, heads, head_size)``
    as ``(num_blocks, 2, block_size, heads, head_size)`` views (block axis first, as
    the connector's worker takes them)."""
    return [t.movedim(1, 0) for t in layers]


def bench_vllm_layout(run_id: str, device: str = "cuda") -> dict:
    """Save ``VLLM_BLOCKS // 2`` blocks of a CUDA KV cache in vLLM's layout through a
    windowed staging pool and load them into the other half; compare on the device."""
    shape = (2, VLLM_BLOCKS, VLLM_BLOCK, VLLM_HEADS, VLLM_HEAD_SIZE)
    layers = [torch.randn(shape, dtype=torch.bfloat16, device=device)
              for _ in range(VLLM_LAYERS)]
    views = vllm_layout_views(layers)
    block_shape = tuple(views[0].shape[1:])
    per_block = math.prod(block_shape) // VLLM_BLOCK
    layout = PoolLayout.vllm(page_size=VLLM_BLOCK, size=VLLM_BLOCKS * VLLM_BLOCK,
                             layer_num=VLLM_LAYERS, head_num=1, head_dim=per_block,
                             dtype="bfloat16", itemsize=2)

    def stage(pool) -> list[torch.Tensor]:
        buf = pool.kv_buffer
        flat = buf.view(buf.shape[0], buf.shape[1], -1)
        return [flat[:, i].view(buf.shape[0], *block_shape) for i in range(buf.shape[1])]

    client = CacheClient(StorageConfig(model_name="raykv-bench-gpu-vllm",
                                       extra_config={"kv_dtype": "bfloat16",
                                                     "page_size": VLLM_BLOCK}))
    pool = client.create_host_pool(staging_layout(layout, VLLM_WINDOW), per_process=True)
    try:
        staged = StagedPool(EngineMemory(layout, views), pool, VLLM_WINDOW, shared=True,
                            stage=stage)
        client.register_mem_host_pool_v2(staged, PoolName.KV)
        staging_pinned = pool.pinned
        half = VLLM_BLOCKS // 2
        hashes = [f"gpu-vllm-{run_id}-{i}" for i in range(half)]

        def slots(blocks: range) -> torch.Tensor:
            ids = torch.tensor(list(blocks), dtype=torch.long)
            return (ids[:, None] * VLLM_BLOCK + torch.arange(VLLM_BLOCK)).reshape(-1)

        t_save, ok_save = _cuda_timed(client.batch_set_v2,
                                      [PoolTransfer(PoolName.KV, hashes, slots(range(half)))])
        t_load, ok_load = _cuda_timed(client.batch_get_v2, [PoolTransfer(
            PoolName.KV, hashes, slots(range(half, VLLM_BLOCKS)))])
        _sync()
        equal = all(torch.equal(t[:, :half], t[:, half:]) for t in layers)
        nbytes = half * VLLM_LAYERS * math.prod(block_shape) * 2
        return {"blocks": half, "block_shape": list(block_shape), "layers": VLLM_LAYERS,
                "bytes": nbytes, "saved": sum(ok_save[PoolName.KV]),
                "loaded": sum(ok_load[PoolName.KV]), "equal": equal,
                "save_gbps": nbytes / t_save / 1e9, "load_gbps": nbytes / t_load / 1e9,
                "staging_pinned": staging_pinned}
    finally:
        client.destroy_host_pool(pool)
        client.close()


def render(result: dict, console: Console) -> None:
    """Print the tables of ``result``."""
    table = right_table(
        f"GPU <-> raykv, GB/s median (best) over {result['config']['iters']} iterations, "
        f"batch of {result['config']['batch']} pages",
        ("page", "pool d2h", "pinned d2h", "pageable d2h", "pool h2d", "pinned h2d",
         "pageable h2d", "whole put", "raw put", "whole get", "raw get", "round trip"),
        caption="pool = raykv host pool (page-locked by the rank); pinned = torch "
                "pin_memory buffer; round trip = d2h + put + get + h2d")
    for s in result["sizes"]:
        table.add_row(human_bytes(s["page_bytes"]), *(gbps_text(s[k]) for k in (
            "pool_d2h", "pinned_d2h", "pageable_d2h", "pool_h2d", "pinned_h2d",
            "pageable_h2d", "whole_put", "raw_put", "whole_get", "raw_get", "round_trip")))
    console.print(table)
    for s in result["sizes"]:
        console.print(f"{human_bytes(s['page_bytes'])}: pool pinned {s['pool_pinned']}; "
                      f"pool/pinned d2h {s['ratio_pool_d2h']:.2f}, h2d "
                      f"{s['ratio_pool_h2d']:.2f}; pageable/pinned d2h "
                      f"{s['ratio_pageable_d2h']:.2f}, h2d {s['ratio_pageable_h2d']:.2f}; "
                      f"whole/raw put {s['ratio_put']:.2f}, get {s['ratio_get']:.2f}")
    v = result["vllm_layout"]
    console.print(f"vLLM CUDA layout: {v['saved']}/{v['blocks']} blocks saved, "
                  f"{v['loaded']}/{v['blocks']} loaded, bytes equal: {v['equal']}; save "
                  f"{v['save_gbps']:.2f} GB/s, load {v['load_gbps']:.2f} GB/s "
                  f"({human_bytes(v['bytes'])}), staging pinned {v['staging_pinned']}")


def run_gpu_bench(page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES, batch: int = 64,
                  iters: int = 5, out_dir: str | None = None,
                  console: Console | None = None, device: str = "cuda") -> dict:
    """Benchmark the GPU path; print tables, write ``bench_gpu.json``, return the figures.
    ``RuntimeError`` without a CUDA device. Starts (and stops) its own two-node embedded
    cluster, so Ray must not be initialised. ``device="cpu"`` runs the same steps with
    host tensors in place of device ones (what the CPU-only tests check: the plumbing
    and the byte comparison, not a GPU's figures)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("raykv bench-gpu needs a CUDA GPU (torch.cuda.is_available() is "
                           "False)")
    if batch < 1 or iters < 1:
        raise ValueError(f"batch and iters must be >= 1, got batch={batch}, iters={iters}")
    for size in page_sizes:
        layer_num_for(size)
    if 2 * batch * max(page_sizes) > SEGMENT_BYTES:
        raise ValueError(f"{batch} pages of {human_bytes(max(page_sizes))} on two paths do "
                         f"not fit the {human_bytes(SEGMENT_BYTES)} store segment")
    run = BenchRun.begin(out_dir, console)
    console = run.console
    cluster = start_cluster(console, 2, global_segment_size=[0, SEGMENT_BYTES],
                            group_window_s=0.0)
    with cluster:
        client = CacheClient(StorageConfig(is_mla_model=True, model_name="raykv-bench-gpu"))
        raw = RawStore(cluster.metadata_server, cluster.master_address)
        try:
            sizes = []
            for size in page_sizes:
                console.print(f"[dim]{human_bytes(size)} pages ...[/dim]")
                sizes.append(bench_size(client, raw, size, batch, iters, run.run_id,
                                        device))
            console.print("[dim]vLLM CUDA layout ...[/dim]")
            vllm = bench_vllm_layout(run.run_id, device)
        finally:
            raw.close()
            client.close()
    result = {"config": {"page_sizes": list(page_sizes), "batch": batch, "iters": iters,
                         "device": device},
              "machine": machine_info() | {"gpu": torch.cuda.get_device_name()
                                           if device == "cuda" else None},
              "sizes": sizes, "vllm_layout": vllm}
    render(result, console)
    return save(result, run.out, "bench_gpu", None, console)
