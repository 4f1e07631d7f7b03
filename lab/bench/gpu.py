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
- **vLLM layouts** (``gpu_vllm``): a device KV cache in each of vLLM's physical
  layouts moved through the connector worker's own paths (the node's L2, and the
  staging pool into the store), loaded into the next layout's cache and compared there,
  against the same blocks' pinned device copies.

Units: bytes, GB/s (1e9 bytes per second), seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from raykv import (
    CacheClient,
    GiB,
    KiB,
    LocalCluster,
    MiB,
    StorageConfig,
    local_settings,
)
from raykv_lab.bench.dataplane import Pages, make_pages
from raykv_lab.bench.gpu_vllm import PATHS, VllmGeometry, bench_vllm_layouts, l2_pages
from raykv_lab.bench.toolkit import (
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
    v = result["vllm_layouts"]
    g = v["geometry"]
    table = right_table(
        f"vLLM KV cache on the device through the connector worker, GB/s median over "
        f"{g['rounds']} rounds of {g['moved']} blocks ({human_bytes(g['bytes'])})",
        ("layout", "loaded into", "L2 save", "L2 load", "store save", "store load",
         "pinned d2h", "pinned h2d"),
        caption="save from the layout, load into the next one, bytes compared on the device; "
                "pinned = the same blocks' copies into and out of a torch pin_memory buffer")
    for name, row in v["layouts"].items():
        table.add_row(name, row["loaded_into"], *(f"{row['gbps'][k]:.2f}" for k in PATHS))
    console.print(table)
    console.print(f"L2 pool pinned {v['l2_pinned']}, staging pool pinned "
                  f"{v['staging_pinned']}; every load byte-exact")
    b = v["saves_behind"]
    ms = b["median_ms"]
    console.print(f"L2 save of {b['blocks']} blocks right after a forward (stand-in: "
                  f"{b['products']} products of {b['forward_dim']}-square bf16 matrices, "
                  f"{ms['forward_s']:.1f} ms): on the step the host waits "
                  f"{ms['sync_s']:.1f} ms; behind it {ms['behind_step_s']:.2f} ms (committed "
                  f"{ms['behind_done_s']:.1f} ms after; one L2 op {ms['l2_op_s']:.2f} ms); "
                  f"every save holds the forward's values")


def start_gpu_bench_cluster(vllm: VllmGeometry, vllm_rounds: int,
                            console: Console | None = None) -> LocalCluster:
    """The two-node embedded cluster ``run_gpu_bench`` runs on, for ``vllm_rounds`` of the
    vLLM part in geometry ``vllm``: the head node contributes no store memory, the other
    holds the page sizes' objects and what the vLLM part keeps; the head's L2 holds
    every block the vLLM part moves. Ray must not be initialised; the caller stops it."""
    # the vLLM part keeps every block it moved: in the head node's L2, and in the store
    # twice (the store path, and L2's puts behind)
    l2_bytes = l2_pages(vllm, vllm_rounds) * vllm.block_bytes
    return start_cluster(console or Console(), 2,
                         local_settings(group_window_s=0.0, l2_bytes=l2_bytes + 64 * MiB),
                         segment_sizes=[0, SEGMENT_BYTES + 2 * l2_bytes])


def run_gpu_bench(page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES, batch: int = 64,
                  iters: int = 5, out_dir: str | None = None,
                  console: Console | None = None, device: str = "cuda",
                  vllm: VllmGeometry | None = None, vllm_rounds: int = 3,
                  cluster: LocalCluster | None = None) -> dict:
    """Benchmark the GPU path; print tables, write ``bench_gpu.json``, return the figures.
    ``vllm``, ``vllm_rounds``: the vLLM part's KV cache geometry (default
    ``VllmGeometry()``) and rounds (``gpu_vllm.bench_vllm_layouts``). ``RuntimeError``
    without a CUDA device. ``cluster``: a running cluster from
    ``start_gpu_bench_cluster`` with the same ``vllm`` and ``vllm_rounds`` (left
    running); None: starts its own and stops it at the end (Ray must not be
    initialised). ``device="cpu"`` runs the same steps with host tensors in place of
    device ones (what the CPU-only tests check: the plumbing and the byte comparison,
    not a GPU's figures)."""
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
    vllm = vllm or VllmGeometry()
    run = BenchRun.begin(out_dir, console)
    console = run.console
    with (contextlib.nullcontext(cluster) if cluster is not None
          else start_gpu_bench_cluster(vllm, vllm_rounds, console)) as cluster:
        client = CacheClient(StorageConfig(is_mla_model=True, model_name="raykv-bench-gpu"))
        raw = RawStore(cluster.metadata_server, cluster.master_address)
        try:
            sizes = []
            for size in page_sizes:
                console.print(f"[dim]{human_bytes(size)} pages ...[/dim]")
                sizes.append(bench_size(client, raw, size, batch, iters, run.run_id,
                                        device))
            console.print("[dim]vLLM KV cache layouts ...[/dim]")
            layouts = bench_vllm_layouts(run.run_id, device, vllm, vllm_rounds,
                                         forward_dim=8192 if device == "cuda" else 64)
        finally:
            raw.close()
            client.close()
    result = {"config": {"page_sizes": list(page_sizes), "batch": batch, "iters": iters,
                         "device": device},
              "machine": machine_info() | {"gpu": torch.cuda.get_device_name()
                                           if device == "cuda" else None},
              "sizes": sizes, "vllm_layouts": layouts}
    render(result, console)
    return save(result, run.out, "bench_gpu", None, console)
