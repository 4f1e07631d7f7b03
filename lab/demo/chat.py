"""What both demos share: the console and the 2-node cluster, the multi-turn chat and the
long prompt under progress bars, the machine, the Mooncake traffic report and the TTFT
figure. A demo supplies how one request runs on its engines and what it records.

Durations in the records are ms; byte counts are bytes (printed in MiB).
"""

from __future__ import annotations

import os
import platform
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import ray
import torch
from raykv import MiB, local_settings
from raykv.example_engine.workload import ChatWorkload
from raykv_lab.bench.toolkit import start_cluster, write_figure
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from raykv import LocalCluster

T = TypeVar("T")
L3_COUNTERS = ("put_bytes", "get_bytes", "put_objects", "get_objects")


def demo_console(console: Console | None = None) -> Console:
    """``console``, else one on the terminal (120 columns when output is not a terminal)."""
    return console or Console(width=None if Console().is_terminal else 120)


def start_demo_cluster(console: Console, **kw) -> LocalCluster:
    """The demos' embedded cluster: 2 nodes with 1 GiB of store memory each (``kw``:
    more ``start_local`` arguments), announced on ``console``; the caller stops it."""
    cluster = start_cluster(console, 2, local_settings(global_segment_size=1 << 30), **kw)
    console.print(f"[bold]raykv[/] cluster up: nodes "
                  f"{', '.join(n[:8] for n in cluster.node_ids)}; Mooncake master "
                  f"{cluster.master_address}")
    return cluster


def progress(console: Console) -> Progress:
    """A progress bar: description, bar, done / total, time elapsed."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console)


def run_chat(work: ChatWorkload, nodes: int, console: Console,
             serve: Callable[[int, list[int]], tuple[list[int], dict]]) -> list[dict]:
    """Every request of ``work`` in its order over ``nodes`` nodes, under a progress bar.

    ``serve(node, prompt)`` runs one request (``prompt``: token ids) and returns (the
    reply's token ids, the request's record). A session's next prompt is its last prompt,
    the reply and the next user message. Returns the records in order, each led by its
    ``session``, ``turn`` and ``node``.
    """
    system = work.system_prompt()
    history = {s: list(system) for s in range(work.sessions)}
    requests = []
    with progress(console) as bar:
        task = bar.add_task("multi-turn chat", total=work.sessions * work.turns)
        for session, turn, node in work.schedule(nodes):
            prompt = history[session] + work.user_message(session, turn)
            bar.update(task, description=f"session {session} turn {turn} on node {node} "
                       f"({len(prompt)} tokens)")
            reply, record = serve(node, prompt)
            history[session] = prompt + reply
            requests.append(dict(session=session, turn=turn, node=node) | record)
            bar.advance(task)
    return requests


def long_prompt_tokens(n: int, vocab: int, first_id: int = 0) -> list[int]:
    """The long prompt: ``n`` token ids drawn from ``[first_id, vocab)``, seeded by ``n``."""
    rng = random.Random(f"long/{n}")
    return [rng.randrange(first_id, vocab) for _ in range(n)]


def run_steps(console: Console, label: str,
              steps: Sequence[tuple[str, Callable[[], T]]]) -> dict[str, T]:
    """Run ``steps`` (name, call) in order under a progress bar named ``label``; each
    step's result by its name."""
    done: dict[str, T] = {}
    with progress(console) as bar:
        task = bar.add_task(label, total=len(steps))
        for name, step in steps:
            bar.update(task, description=f"{label}: {name}")
            done[name] = step()
            bar.advance(task)
    return done


def l3_traffic(cluster: LocalCluster) -> dict[str, int]:
    """Bytes and objects the node actors have put into and got from Mooncake so far,
    summed over nodes (``L3_COUNTERS``)."""
    stats = ray.get([a.stats.remote() for a in cluster.node_actors.values()])
    return {k: sum(s.counters.get(k, 0) for s in stats) for k in L3_COUNTERS}


def print_l3_traffic(console: Console, io: dict[str, int]) -> None:
    """One line: ``l3_traffic``'s figures, in MiB and objects."""
    console.print(f"Mooncake traffic (node actors): put {io['put_bytes'] / MiB:.1f} MiB in "
                  f"{io['put_objects']} objects, get {io['get_bytes'] / MiB:.1f} MiB in "
                  f"{io['get_objects']} objects")


def machine() -> dict:
    """Where the demo ran: platform, processor, CPUs, load, library versions."""
    return dict(platform=platform.platform(), processor=platform.processor() or "unknown",
                cpus=os.cpu_count(), load_avg=os.getloadavg(), torch=torch.__version__,
                ray=ray.__version__, python=platform.python_version())


def plot_ttft(requests: list[dict], bars: dict[str, float], tokens: int, path: Path, *,
              without: tuple[str, str] = ("ttft_recompute_ms", "without raykv (recompute)"),
              tiers: dict[str, str] | None = None) -> None:
    """The demo's figure: left, TTFT per request with raykv (``ttft_ms``) and without
    (``without``: the record key and its legend); with ``tiers`` (record key -> label,
    at most 4), below it each request's prompt tokens per tier, stacked; right, the
    ``tokens``-token prompt's TTFT per way of serving it (``bars``: label -> ms, at most
    5, the first one grey)."""
    from raykv_lab.plotting import figure_class

    fig = figure_class()(figsize=(13 + len(bars) - 3, 7 if tiers else 4.5))
    widths = {"width_ratios": [3, len(bars) / 3]}
    if tiers:
        grid = fig.add_gridspec(2, 2, height_ratios=[3, 2], **widths)
        ax1, ax2 = fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[:, 1])
        _plot_tiers(fig.add_subplot(grid[1, 0], sharex=ax1), requests, tiers)
    else:
        ax1, ax2 = fig.subplots(1, 2, gridspec_kw=widths)
    x = range(len(requests))
    key, label = without
    ax1.bar([i - 0.2 for i in x], [r[key] for r in requests], 0.4, label=label,
            color="#bbbbbb")
    ax1.bar([i + 0.2 for i in x], [r["ttft_ms"] for r in requests], 0.4,
            label="with raykv", color="#1f77b4")
    ax1.set_xticks(list(x), [f"s{r['session']}t{r['turn']}\nnode{r['node']}"
                             for r in requests], fontsize=7)
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("Multi-turn chat: time to first token per request")
    ax1.legend()
    names, vals = list(bars), list(bars.values())
    ax2.bar(names, vals,
            color=["#bbbbbb", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd"][:len(vals)])
    ax2.set_yscale("log")
    ax2.tick_params(axis="x", labelsize=8)
    ax2.set_ylabel("TTFT (ms, log)")
    ax2.set_title(f"{tokens}-token prompt")
    for i, v in enumerate(vals):
        ax2.annotate(f"{v:.0f}", (i, v), ha="center", va="bottom", fontsize=8)
    write_figure(fig, path, dpi=110)


def _plot_tiers(ax, requests: list[dict], tiers: dict[str, str]) -> None:
    """Each request's prompt tokens per tier (``tiers``: record key -> label), stacked."""
    bottom = [0] * len(requests)
    x = list(range(len(requests)))
    for (key, label), color in zip(tiers.items(),
                                   ("#ff7f0e", "#2ca02c", "#1f77b4", "#bbbbbb"), strict=False):
        vals = [r[key] for r in requests]
        ax.bar(x, vals, 0.6, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.set_ylim(0, max(bottom, default=0) * 1.4 or 1)  # room for the legend
    ax.set_ylabel("prompt tokens")
    ax.set_title("Where each prompt's tokens came from (with raykv)", fontsize=9)
    ax.legend(fontsize=7, ncol=len(tiers))
