"""The ``raykv`` command line."""

from __future__ import annotations

import os
import sys

import click


@click.group()
def main() -> None:
    """raykv: a Ray-native distributed KV cache for LLM inference."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


@main.command()
@click.option("--pages", default=64, show_default=True, help="Pages each rank writes.")
@click.option("--page-size", default=16, show_default=True, help="Tokens per page.")
@click.option("--layers", default=8, show_default=True)
@click.option("--heads", default=8, show_default=True, help="KV heads per TP rank.")
@click.option("--head-dim", default=128, show_default=True)
@click.option("--tp-size", default=2, show_default=True)
def demo(pages: int, page_size: int, layers: int, heads: int, head_dim: int,
         tp_size: int) -> None:
    """Start an embedded 2-node cluster; write KV pages on one node, read them on the other."""
    from clusters.demo import run_demo

    ok = run_demo(pages=pages, page_size=page_size, layers=layers, heads=heads,
                  head_dim=head_dim, tp_size=tp_size)
    sys.exit(0 if ok else 1)


@main.command()
@click.option("--page-sizes", default="64K,1M,4M", show_default=True,
              help="Comma-separated page sizes (K/M suffixes).")
@click.option("--batch", default=128, show_default=True, help="Pages per batch call.")
@click.option("--iters", default=5, show_default=True, help="Timed iterations per size.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_dataplane.json and .png.")
def bench(page_sizes: str, batch: int, iters: int, out_dir: str) -> None:
    """Data-plane GB/s: raykv's whole path vs raw Mooncake vs memcpy, in one run."""
    from clusters.bench import run_dataplane_bench

    units = {"K": 1 << 10, "M": 1 << 20}
    sizes = [int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)
             for s in page_sizes.split(",")]
    run_dataplane_bench(page_sizes=sizes, batch=batch, iters=iters, out_dir=out_dir)


if __name__ == "__main__":
    main()
