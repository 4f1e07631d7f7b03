"""What every benchmark shares: statistics, units, the raw Mooncake client, the run's
set-up and cluster start, tables, plots and the JSON/PNG files.

Units: sizes in bytes, bandwidth in GB/s (``GB`` = 1e9 bytes per second), durations in
seconds, latencies in ms.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from raykv import GiB, KiB, MiB
from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from raykv import LocalCluster, NodeSettings

GB = 1e9
# MLA page geometry of the data-plane and ranks benchmarks: PAGE_TOKENS tokens of
# KV_CACHE_DIM one-byte elements per layer; the layer count makes a page of the asked size.
PAGE_TOKENS = 64
KV_CACHE_DIM = 512
DEFAULT_OUT = "raykv-out"


# ------------------------------------------------------------------ statistics
def gbps(nbytes: int, seconds: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second) of moving ``nbytes`` bytes in ``seconds``."""
    return nbytes / seconds / GB


def summarize(nbytes: int, seconds: Sequence[float]) -> dict:
    """Median and best GB/s of moving ``nbytes`` bytes once per duration in ``seconds``."""
    return {"median_gbps": gbps(nbytes, statistics.median(seconds)),
            "best_gbps": gbps(nbytes, min(seconds)),
            "seconds": list(seconds)}


def gbps_text(summary: dict) -> str:
    """A ``summarize`` result as ``median (best)`` GB/s, e.g. ``1.52 (1.61)``."""
    return f"{summary['median_gbps']:.2f} ({summary['best_gbps']:.2f})"


def median_ci(values: Sequence[float], level: float = 0.9, draws: int = 2000,
              seed: int = 0) -> tuple[float, float]:
    """A bootstrap ``level`` confidence interval of the median of ``values`` (resampled
    ``draws`` times with a fixed ``seed``, so one run's numbers always give one interval).
    On this shared 2-core machine one iteration's ratio swings by +-30%; the interval says
    how far the median of a run can be trusted."""
    rng = np.random.default_rng(seed)
    samples = rng.choice(np.asarray(values, dtype=float), size=(draws, len(values)))
    medians = np.median(samples, axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(medians, tail)), float(np.quantile(medians, 1 - tail))


def ratio_text(row: dict, key: str) -> str:
    """``row[key]`` (a median ratio) and its interval ``row[key + "_ci90"]`` as
    ``0.95 [0.91-0.99]``; JSON written before intervals existed has none."""
    lo, hi = row.get(f"{key}_ci90", (row[key],) * 2)
    return f"{row[key]:.2f} [{lo:.2f}-{hi:.2f}]"


def latency_ms(seconds: Sequence[float]) -> dict:
    """p50 and p99 of per-call durations (given in seconds), in milliseconds."""
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "calls": len(ms)}


def timed(fn: Callable[..., object], *args) -> tuple[float, object]:
    """Call ``fn(*args)`` once; return (seconds it took, its result)."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def human_bytes(n: int) -> str:
    """``65536`` -> ``"64 KiB"``, ``4194304`` -> ``"4 MiB"``."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def layer_num_for(page_bytes: int) -> int:
    """Layers of a uint8 MLA page of ``PAGE_TOKENS`` x ``KV_CACHE_DIM`` per layer that make
    a page of exactly ``page_bytes`` bytes; ``ValueError`` if none does."""
    per_layer = PAGE_TOKENS * KV_CACHE_DIM
    if page_bytes <= 0 or page_bytes % per_layer:
        raise ValueError(f"page size {page_bytes} bytes is not a positive multiple of "
                         f"{per_layer} bytes ({PAGE_TOKENS} tokens x {KV_CACHE_DIM} bytes)")
    return page_bytes // per_layer


def check_codes(what: str, codes: Sequence[int], ok: Callable[[int], bool]) -> None:
    """Raise ``RuntimeError`` naming ``what`` and the first bad code unless all are ok."""
    bad = [c for c in codes if not ok(c)]
    if bad:
        raise RuntimeError(f"{what}: {len(bad)} of {len(codes)} objects failed "
                           f"(first code {bad[0]})")


# ------------------------------------------------------------ raw Mooncake client
def page_aligned_bytes(nbytes: int) -> torch.Tensor:
    """A zeroed uint8 tensor of ``nbytes`` bytes starting on a memory-page boundary.

    The shared host pools are page-aligned mappings; torch's own allocations are only
    64-byte aligned, and on these machines a Mooncake TCP get into memory that is off a
    page boundary runs about 30% slower, which would handicap the raw baseline.
    """
    base = torch.zeros(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
    skip = -base.data_ptr() % mmap.PAGESIZE
    return base[skip:skip + nbytes]


def lower_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value to ``niceness`` (never lowers it)."""
    tid = threading.get_native_id()
    if niceness > os.getpriority(os.PRIO_PROCESS, tid):
        os.setpriority(os.PRIO_PROCESS, tid, niceness)


def raw_client(metadata_server: str, master_address: str, host: str = "127.0.0.1"):
    """A plain ``MooncakeDistributedStore`` on ``host`` (this machine's address its
    peers reach it at) that contributes no segment."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(host, metadata_server, 0, 16 * MiB, "tcp", "", master_address)
    if rc != 0:
        raise RuntimeError(f"raw Mooncake client setup failed with code {rc}")
    return store


class RawStore:
    """The raw side of every benchmark: a plain Mooncake client (``raw_client``, a pure
    consumer of the store) with at most one registered buffer (set by ``resize``) that
    holds source and target objects.

    ``niceness`` None: every call runs on the calling thread. A number: every call made
    through ``call`` / ``timed`` (and the set-up, so the transfer threads Mooncake starts
    inherit it) runs on one thread of its own whose nice value is ``niceness``. Ray runs
    its workers, the node actors among them, at nice 15, and on a small machine a nice-0
    client against a nice-15 segment owner moves bytes measurably slower than a nice-15
    one, which would make the baseline differ from the whole path in priority only.
    ``store`` may also be called directly, from any thread.
    """

    def __init__(self, metadata_server: str, master_address: str,
                 niceness: int | None = None, host: str = "127.0.0.1") -> None:
        self._thread = None if niceness is None else ThreadPoolExecutor(
            1, thread_name_prefix="raw-mooncake", initializer=lower_thread_priority,
            initargs=(niceness,))
        self.store = self.call(raw_client, metadata_server, master_address, host)
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def call(self, fn: Callable[..., object], *args):
        """``fn(*args)`` on the client's thread (the calling one without ``niceness``)."""
        if self._thread is None:
            return fn(*args)
        return self._thread.submit(fn, *args).result()

    def timed(self, fn: Callable[..., object], *args) -> tuple[float, object]:
        """``timed(fn, *args)`` on the client's thread: the hand-over is not timed."""
        return self.call(timed, fn, *args)

    def resize(self, nbytes: int) -> None:
        """Replace the registered buffer with a page-aligned one of ``nbytes`` bytes."""
        self.release()
        self.buffer = page_aligned_bytes(nbytes)
        rc = self.call(self.store.register_buffer, self.buffer.data_ptr(), nbytes)
        if rc != 0:
            raise RuntimeError(f"register_buffer of {nbytes} bytes failed with code {rc}")

    def release(self) -> None:
        """Unregister the buffer (if any)."""
        if self.buffer.numel():
            self.call(self.store.unregister_buffer, self.buffer.data_ptr())
            self.buffer = torch.empty(0, dtype=torch.uint8)

    def ptrs(self, first: int, count: int, size: int) -> list[int]:
        """Pointers of ``count`` slots of ``size`` bytes from slot ``first`` of the buffer."""
        base = self.buffer.data_ptr()
        return [base + (first + i) * size for i in range(count)]

    def put_tiny(self, keys: list[str], attempts: int = 5) -> None:
        """Store 64-byte objects (the buffer's first bytes) under ``keys``, in chunks of
        256, retrying the failed ones (a transient -800) up to ``attempts`` times."""
        todo = list(keys)
        ptr = self.buffer.data_ptr()
        for _ in range(attempts):
            failed = []
            for i in range(0, len(todo), 256):
                chunk = todo[i:i + 256]
                codes = self.call(self.store.batch_put_from, chunk, [ptr] * len(chunk),
                                  [64] * len(chunk))
                failed += [k for k, c in zip(chunk, codes, strict=True) if c != 0]
            if not failed:
                return
            todo = failed
        raise RuntimeError(f"{len(todo)} objects could not be stored")

    def remove(self, keys: list[str]) -> None:
        """Force-remove ``keys`` (whatever wrote them) so the segment never fills."""
        check_codes("batch_remove", self.call(self.store.batch_remove, keys, True),
                    lambda c: c == 0)

    def close(self) -> None:
        self.release()
        self.call(self.store.close)
        if self._thread is not None:
            self._thread.shutdown()


# ---------------------------------------------------------------- the run itself
def mooncake_wheel() -> tuple[str, str]:
    """(distribution, version) of the installed Mooncake wheel, the non-CUDA one first;
    ``importlib.metadata.PackageNotFoundError`` if neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"):
        try:
            return dist, version(dist)
        except PackageNotFoundError:
            continue
    raise PackageNotFoundError("mooncake-transfer-engine")


def machine_info() -> dict:
    """Where the figures were taken: CPU count, OS, library versions, CUDA."""
    from importlib.metadata import PackageNotFoundError

    import ray

    try:
        mooncake = " ".join(mooncake_wheel())
    except PackageNotFoundError:
        mooncake = "unknown"
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "ray": ray.__version__, "mooncake": mooncake,
            "transport": "tcp (loopback between two Ray nodes on this machine)"}


@dataclass
class BenchRun:
    """One benchmark run: where it prints and writes, the ``run_id`` (8 hex digits) in
    every key it stores, and when it started (``time.perf_counter`` seconds)."""

    console: Console
    out: Path
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def begin(cls, out_dir: str | None = None, console: Console | None = None) -> BenchRun:
        """Quiet Mooncake's log (``MC_LOG_LEVEL=ERROR``, inherited by the processes the
        run starts), create ``out_dir`` (default ``raykv-out/``) and start the clock."""
        os.environ["MC_LOG_LEVEL"] = "ERROR"
        out = Path(out_dir or DEFAULT_OUT)
        out.mkdir(parents=True, exist_ok=True)
        return cls(console or Console(), out)

    def elapsed_s(self) -> float:
        """Seconds since the run began."""
        return time.perf_counter() - self.started

    def save(self, result: dict, stem: str,
             plot: Callable[[dict, Path], None] | None = None) -> dict:
        """``save(result, self.out, stem, plot, self.console)``."""
        return save(result, self.out, stem, plot, self.console)


def start_cluster(console: Console, num_nodes: int, settings: NodeSettings | None = None,
                  **kw) -> LocalCluster:
    """``start_local(num_nodes, settings, **kw)`` under a status line on ``console``; the
    caller stops it (``with cluster:``). Ray must not be initialised."""
    from raykv import start_local

    nodes = f"{num_nodes} node{'s' if num_nodes > 1 else ''}"
    with console.status(f"starting Ray ({nodes}), mooncake_master and the node actors"):
        return start_local(num_nodes, settings, **kw)


def save(result: dict, out: Path, stem: str, plot: Callable[[dict, Path], None] | None,
         console: Console) -> dict:
    """Write ``result`` as ``out/<stem>.json`` and, with a ``plot``, its figure as
    ``out/<stem>.png``; print what was written (and ``result["elapsed_s"]``, if any) and
    return ``result`` with the files' paths under ``files``."""
    json_path = out / f"{stem}.json"
    json_path.write_text(json.dumps(result, indent=2))
    result["files"] = {"json": str(json_path)}
    wrote = f"wrote {json_path}"
    if plot is not None:
        png_path = out / f"{stem}.png"
        plot(result, png_path)
        result["files"]["png"] = str(png_path)
        wrote += f" and {png_path}"
    if "elapsed_s" in result:
        wrote += f" ({result['elapsed_s']:.0f} s)"
    console.print(wrote)
    return result


# ------------------------------------------------------------- tables and plots
def right_table(title: str, columns: Sequence[str], caption: str | None = None) -> Table:
    """A rich table of right-justified ``columns``."""
    table = Table(title=title, caption=caption)
    for col in columns:
        table.add_column(col, justify="right")
    return table


def bars_and_panel() -> tuple[Figure, Axes, Axes]:
    """A 13 x 4.8 inch figure of two panels, 3:2 wide: the bars and a companion."""
    from raykv_lab.plotting import figure_class

    fig = figure_class()(figsize=(13, 4.8))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
    return fig, left, right


def grouped_bars(ax: Axes, rows: Sequence[dict],
                 series: Sequence[tuple[str, str, str]]) -> np.ndarray:
    """One group of bars per row, one bar per ``series`` entry (``key, label, color``)
    of height ``row[key]["median_gbps"]``, each labelled with its value; returns the
    groups' x positions."""
    x = np.arange(len(rows))
    width = 0.8 / len(series)
    for i, (key, label, color) in enumerate(series):
        bars = ax.bar(x + (i - (len(series) - 1) / 2) * width,
                      [r[key]["median_gbps"] for r in rows], width, label=label, color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    return x


def write_figure(fig: Figure, path: Path, dpi: int = 120) -> None:
    """Lay ``fig`` out tightly and write it as a PNG to ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
