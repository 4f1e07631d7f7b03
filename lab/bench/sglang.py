"""SGLang benchmark: SGLang's own backups and prefetches through ``RayKVStore`` against
SGLang's built-in ``MooncakeStore``, on the same store, in the same run.

``run_sglang_bench`` starts an embedded two-node cluster in which the head node (where
the SGLang process joins) contributes no store memory, so every object lands in the
other node's segment and every byte crosses Mooncake's transport (TCP loopback here), for
both backends. It then runs ``raykv_lab.bench.sglang_runner`` in SGLang's environment
(``sglang_python``: SGLang cannot share raykv's venv, see ``scripts/sglang-venv.sh``), which
drives SGLang 0.5.23's ``HybridCacheController`` over one SGLang host pool with both
backends: ``write_storage`` and ``prefetch`` of ``batch`` pages per call (see that
module for what is timed). Here the seconds become pages/s and GB/s (1e9 bytes/s) of
whole pages (K and V of every layer), and ratios raykv / MooncakeStore: the median of
the per-iteration ratios (both backends ran back to back in each iteration).

The SGLang process runs at the node actors' nice value (Ray runs its workers niced), so
MooncakeStore's transfer threads, which run in that process, and raykv's, which run in
the node actor, have the same priority (see ``lab.bench.toolkit.RawStore``).

``standalone=True`` runs the nodes in standalone Mooncake mode: the store's buffers then
belong to ``mooncake_client``, which cannot map SGLang's memory, so ``RayKVStore`` serves
SGLang's pool through a staging copy (``staging_pages = batch``): that run measures the
copy's cost.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import ray
from raykv import GiB, KiB, MiB, local_settings
from raykv_lab.bench.toolkit import (
    BenchRun,
    bars_and_panel,
    gbps_text,
    grouped_bars,
    human_bytes,
    machine_info,
    median_ci,
    ratio_text,
    right_table,
    start_cluster,
    summarize,
    write_figure,
)
from rich.console import Console

DEFAULT_PAGE_SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
LAYER_PAGE_BYTES = 64 * KiB     # K + V of one layer of one 64-token page (sglang_runner)
SEGMENT_BYTES = 3 * GiB
TARGET_RATIO = 0.9
TARGET_MIN_PAGE_BYTES = 1 * MiB
OPS = ("write", "prefetch", "load")
SGLANG_VENV_PYTHON = os.path.join(".venv-sglang", "bin", "python")
RUNNER = "raykv_lab.bench.sglang_runner"  # the SGLang side, run by SGLang's python


def sglang_python(path: str | None = None) -> str:
    """The python of SGLang's environment: ``path``, else ``$RAYKV_SGLANG_PYTHON``, else
    ``.venv-sglang/bin/python`` here; ``ValueError`` naming what to do if it is missing."""
    python = path or os.environ.get("RAYKV_SGLANG_PYTHON") or SGLANG_VENV_PYTHON
    if not os.path.exists(python):
        raise ValueError(f"no SGLang python at {python}: build the SGLang venv with "
                         "`scripts/sglang-venv.sh` (sglang 0.5.23 and raykv, the same ray as here) "
                         "or pass --sglang-python / set RAYKV_SGLANG_PYTHON")
    return python


def sglang_env(python: str) -> dict[str, str]:
    """What a process of ``python``'s SGLang adds to its environment: when ``python`` is a
    venv's, SGLang's page-hash extension (compiled on first use, ~20 CPU-s) is taken from
    the venv's ``torch_extensions`` folder, where ``scripts/sglang-venv.sh`` built it, with
    the venv's own ``bin`` first on ``PATH`` (the ninja it was built with: another ninja
    version takes the build for out of date and compiles it again); nothing when
    ``TORCH_EXTENSIONS_DIR`` is set already or ``python`` is no venv's (SGLang's default,
    under HOME)."""
    venv = os.path.dirname(os.path.dirname(python))
    if "TORCH_EXTENSIONS_DIR" in os.environ or not os.path.exists(
            os.path.join(venv, "pyvenv.cfg")):
        return {}
    return {"TORCH_EXTENSIONS_DIR": os.path.join(venv, "torch_extensions"),
            "PATH": os.pathsep.join([os.path.join(venv, "bin"), os.environ.get("PATH", "")])}


def check_sizes(page_sizes: Sequence[int], batch: int, iters: int) -> None:
    """``ValueError`` unless every page size is a positive multiple of 64 KiB and one
    iteration of both backends fits the store segment."""
    if batch < 1 or iters < 1:
        raise ValueError(f"batch and iters must be >= 1, got batch={batch}, iters={iters}")
    if not page_sizes:
        raise ValueError("page_sizes is empty")
    for size in page_sizes:
        if size <= 0 or size % LAYER_PAGE_BYTES:
            raise ValueError(f"page size {size} bytes is not a positive multiple of "
                             f"{human_bytes(LAYER_PAGE_BYTES)} (K + V of one layer of a "
                             "64-token page of 2 x 128 bf16)")
    if 2 * batch * max(page_sizes) > SEGMENT_BYTES:
        raise ValueError(f"{batch} pages of {human_bytes(max(page_sizes))} for both backends "
                         f"do not fit the {human_bytes(SEGMENT_BYTES)} store segment")


def run_driver(python: str, spec: dict, niceness: int, timeout_s: float) -> dict:
    """Run the SGLang side with ``spec`` at nice ``niceness``; its JSON result."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    env |= sglang_env(python)
    increment = max(0, niceness - os.getpriority(os.PRIO_PROCESS, 0))
    try:
        proc = subprocess.run(
            ["nice", "-n", str(increment), python, "-m", RUNNER, f.name],
            capture_output=True, text=True, timeout=timeout_s, env=env)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the SGLang side failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def size_row(raw: dict) -> dict:
    """GB/s, pages/s and paired ratios of one page size from the SGLang side's seconds."""
    page, batch, times = raw["page_bytes"], raw["batch"], raw["times"]
    nbytes = batch * page
    row = {k: raw[k] for k in ("page_bytes", "object_bytes", "layers", "batch",
                               "raykv_zero_copy", "raykv_mode", "raykv_staged_bytes")}
    row["batch_bytes"] = nbytes
    for name, seconds in times.items():
        row[name] = summarize(nbytes, seconds) | {
            "median_pages_s": batch / statistics.median(seconds)}
    for op in OPS:
        pairs = zip(times[f"raykv_{op}"], times[f"mooncake_{op}"], strict=True)
        ratios = [m / r for r, m in pairs]
        row[f"ratio_{op}"] = statistics.median(ratios)
        row[f"ratio_{op}_ci90"] = median_ci(ratios)
    return row


def judge(rows: list[dict]) -> dict[str, bool | None]:
    """The target on this run's medians (None: no page size >= 1 MiB)."""
    big = [r for r in rows if r["page_bytes"] >= TARGET_MIN_PAGE_BYTES]
    met = (all(min(r["ratio_write"], r["ratio_prefetch"]) >= TARGET_RATIO for r in big)
           if big else None)
    return {f"write and prefetch >= {TARGET_RATIO}x MooncakeStore for pages >= "
            f"{human_bytes(TARGET_MIN_PAGE_BYTES)}": met}


def render(result: dict, console: Console) -> None:
    cfg = result["config"]
    table = right_table(
        f"SGLang {result['sglang']} HiCache L3, GB/s median (best) and pages/s, "
        f"{cfg['iters']} iterations of {cfg['batch']} pages, {cfg['mode']} mode",
        ("page", "backend", "write GB/s", "write pages/s", "prefetch GB/s",
         "prefetch pages/s", "load GB/s"),
        caption="ratio = RayKVStore / MooncakeStore: median of per-iteration ratios [90% "
                "bootstrap interval of that median]; prefetch = hit query + load")
    for r in result["sizes"]:
        for b, label in (("raykv", "RayKVStore"), ("mooncake", "MooncakeStore")):
            table.add_row(human_bytes(r["page_bytes"]) if b == "raykv" else "", label,
                          gbps_text(r[f"{b}_write"]),
                          f"{r[f'{b}_write']['median_pages_s']:.0f}",
                          gbps_text(r[f"{b}_prefetch"]),
                          f"{r[f'{b}_prefetch']['median_pages_s']:.0f}",
                          gbps_text(r[f"{b}_load"]))
        table.add_row("", "ratio", ratio_text(r, "ratio_write"), "",
                      ratio_text(r, "ratio_prefetch"), "", ratio_text(r, "ratio_load"),
                      end_section=True)
    console.print(table)
    for target, met in result["targets"].items():
        verdict = {True: "[green]met[/green]", False: "[red]not met[/red]",
                   None: "[dim]no case[/dim]"}[met]
        console.print(f"target: {target}: {verdict}")


def plot(result: dict, path: Path) -> None:
    """Grouped bars of median GB/s by page size (RayKVStore vs MooncakeStore, write and
    prefetch) and the paired ratios against the 0.9 target."""
    rows = result["sizes"]
    fig, ax, rax = bars_and_panel()
    x = grouped_bars(ax, rows, (("raykv_write", "RayKVStore write", "#1f77b4"),
                                ("mooncake_write", "MooncakeStore write", "#aec7e8"),
                                ("raykv_prefetch", "RayKVStore prefetch", "#ff7f0e"),
                                ("mooncake_prefetch", "MooncakeStore prefetch", "#ffbb78")))
    labels = [human_bytes(r["page_bytes"]) for r in rows]
    ax.set_xticks(x, labels)
    ax.set_xlabel(f"page size (K + V, all layers; {result['config']['batch']} pages per call)")
    ax.set_ylabel("GB/s (1e9 bytes/s), median")
    ax.set_title(f"SGLang {result['sglang']} write_storage / prefetch, "
                 f"{result['config']['mode']} mode", fontsize=10)
    ax.legend(fontsize=8)
    for op, marker in (("write", "o"), ("prefetch", "s"), ("load", "^")):
        rax.plot(x, [r[f"ratio_{op}"] for r in rows], marker=marker, label=op)
    rax.axhline(TARGET_RATIO, color="grey", linestyle="--", linewidth=1, label="target 0.9")
    rax.set_xticks(x, labels)
    rax.set_ylabel("RayKVStore / MooncakeStore (median of paired ratios)")
    rax.set_title("ratio", fontsize=10)
    rax.legend(fontsize=8)
    write_figure(fig, path)


def run_sglang_bench(
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    batch: int = 128,
    iters: int = 5,
    out_dir: str | None = None,
    console: Console | None = None,
    python: str | None = None,
    standalone: bool = False,
    timeout_s: float = 1800.0,
) -> dict:
    """Benchmark SGLang's HiCache L3 through RayKVStore vs MooncakeStore; print the table,
    write ``bench_sglang.json`` and ``.png`` (``bench_sglang_standalone.*`` with
    ``standalone``) into ``out_dir`` (default ``raykv-out/``), return the figures.

    ``page_sizes`` in bytes (multiples of 64 KiB), ``batch`` pages per SGLang call,
    ``iters`` timed iterations per size after one untimed warm-up that checks the bytes.
    ``python``: SGLang's python (see ``sglang_python``). Starts (and stops) its own
    two-node cluster, so Ray must not be initialised.
    """
    check_sizes(page_sizes, batch, iters)
    python = sglang_python(python)
    run = BenchRun.begin(out_dir, console)
    pool_budget = 4 * batch * max(page_sizes) if standalone else None
    settings = local_settings(group_window_s=0.0, standalone=standalone,
                              host_pool_bytes=pool_budget)
    cluster = start_cluster(run.console, 2, settings, segment_sizes=[0, SEGMENT_BYTES])
    with cluster:
        head = cluster.node_ids[0]
        pid = ray.get(cluster.node_actors[head].health.remote())["pid"]
        niceness = os.getpriority(os.PRIO_PROCESS, pid)
        spec = {"ray_address": ray.get_runtime_context().gcs_address,
                "namespace": cluster.namespace, "node_id": head,
                "mooncake": {"master_server_address": cluster.master_address,
                             "metadata_server": cluster.metadata_server,
                             "local_hostname": "127.0.0.1", "protocol": "tcp",
                             "global_segment_size": 0, "check_server": False},
                "page_sizes": list(page_sizes), "batch": batch, "iters": iters,
                "run_id": run.run_id, "staging_pages": batch if standalone else None}
        run.console.print(f"[dim]SGLang ({python}): "
                          f"{', '.join(map(human_bytes, page_sizes))} pages ...[/dim]")
        raw = run_driver(python, spec, niceness, timeout_s)
    rows = [size_row(r) for r in raw["sizes"]]
    result = {
        "run_id": run.run_id,
        "machine": machine_info(),
        "sglang": raw["sglang"],
        "sglang_environment": raw["environment"],
        "config": {"page_sizes": list(page_sizes), "batch": batch, "iters": iters,
                   "segment_bytes": SEGMENT_BYTES, "nodes": 2,
                   "mode": "standalone" if standalone else "embedded",
                   "sglang_nice": niceness, "sglang_python": python,
                   "page_geometry": "MHA, 64 tokens x 2 heads x 128 bf16, K and V per layer; "
                                    "layers = page bytes / 64 KiB; 2 objects per page",
                   "host_pool": "one SGLang MHATokenToKVPoolHost (page_first, allocator "
                                "shm) shared by both backends"},
        "sizes": rows,
        "targets": judge(rows),
        "elapsed_s": run.elapsed_s(),
    }
    render(result, run.console)
    return run.save(result, "bench_sglang_standalone" if standalone else "bench_sglang", plot)

