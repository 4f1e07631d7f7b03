"""The figure of a ``raykv sim`` sweep (``sweep``): hit rate and TTFT against host
capacity per node and against node count; matplotlib imported only here
(``lab.plotting``, the ``bench`` extra)."""

from __future__ import annotations

from pathlib import Path

from raykv_lab.plotting import figure_class
from raykv_lab.sim.sweep import SWEEP_RUNS


def draw(result: dict, path: str | Path) -> None:
    """Four panels, written as PNG to ``path``: block hit rate and TTFT p50 per run
    (and the references' hit rates) against host tokens per node, then against nodes."""
    fig = figure_class()(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2)
    for col, (key, label, scale) in enumerate((
            ("capacity", "host memory per node (M tokens)", 1e-6),
            ("nodes", "nodes", 1))):
        points = result[key]
        xs = [p["host_tokens" if key == "capacity" else "nodes"] * scale for p in points]
        hit, ttft = axes[0][col], axes[1][col]
        for run in SWEEP_RUNS:
            hit.plot(xs, [100 * p["runs"][run]["block_hit_rate"] for p in points],
                     marker="o", label=run)
            ttft.plot(xs, [p["runs"][run]["ttft_p50_s"] for p in points], marker="o",
                      label=run)
        for ref, style in (("belady_host", "-."), ("belady", ":"), ("unbounded", "--")):
            hit.plot(xs, [100 * p["bounds"][ref] for p in points], linestyle=style,
                     color="grey", label=ref)
        hit.set(xlabel=label, ylabel="prefix hit rate (% of blocks)", ylim=(0, None))
        ttft.set(xlabel=label, ylabel="TTFT p50 (s, cost model)", ylim=(0, None))
        for ax in (hit, ttft):
            if key == "capacity":
                ax.set_xscale("log")
                ax.minorticks_off()
            ax.set_xticks(xs, [f"{x:g}" for x in xs])
        hit.legend(fontsize=8)
        ttft.legend(fontsize=8)
    s = result["setup"]
    fig.suptitle(f"raykv sim: {result['requests']} requests, {s['engines_per_node']} "
                 f"engines per node (capacity sweep at {s['nodes']} nodes, node sweep at "
                 f"{(s['l2_tokens'] + s['l3_tokens']) / 1e6:g}M tokens per node)")
    fig.savefig(path, dpi=110)
