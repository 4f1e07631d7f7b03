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
@click.option("--engine", default="example", show_default=True,
              type=click.Choice(["example", "vllm"]),
              help="example: the example engine (nothing to install); vllm: real vLLM "
              "engines (pip install 'raykv[vllm]') on a random-weight Llama made locally.")
@click.option("--variant", default=None,
              type=click.Choice(["mha", "mla", "hybrid", "mha-draft", "mla-draft",
                                 "hybrid-draft"]),
              help="Example engine's model: attention kind, hybrid (Mamba-like layers), "
              "draft model.  [default: hybrid-draft]")
@click.option("--hidden", default=None, type=int,
              help="Model width.  [default: 512 example, 384 vllm]")
@click.option("--layers", default=None, type=int, help="[default: 8 example, 6 vllm]")
@click.option("--head-dim", default=None, type=int, help="[default: 64]")
@click.option("--page-size", default=None, type=int,
              help="Tokens per page (vllm: per block).  [default: 64 example, 128 vllm]")
@click.option("--sessions", default=4, show_default=True)
@click.option("--turns", default=3, show_default=True)
@click.option("--system-tokens", default=1024, show_default=True,
              help="Shared system prompt length.")
@click.option("--user-tokens", default=64, show_default=True, help="Per user message.")
@click.option("--reply-tokens", default=16, show_default=True, help="Decoded per turn.")
@click.option("--long-prompt", default=4096, show_default=True,
              help="Tokens of the prompt timed recomputed vs fully cached.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for demo.json and demo.png (vllm: demo_vllm.json, .png).")
def demo(engine: str, **options) -> None:
    """Multi-turn chat on a 2-node cluster: TTFT with raykv vs without, hit rates."""
    options = {k: v for k, v in options.items() if v is not None}
    if engine == "example":
        from raykv.clusters.demo.example_demo import run_demo

        sys.exit(0 if run_demo(**options) else 1)
    import importlib.util

    if "variant" in options:
        raise click.UsageError("--variant chooses the example engine's model; --engine vllm "
                               "runs a Llama (--hidden, --layers, --head-dim)")
    if importlib.util.find_spec("vllm") is None:
        raise click.ClickException("--engine vllm needs vLLM: pip install 'raykv[vllm]' "
                                   "(see the README, 'Use from vLLM')")
    from raykv.clusters.demo.vllm_demo import run_vllm_demo

    sys.exit(0 if run_vllm_demo(**options)["ok"] else 1)


def parse_size(text: str) -> int:
    """``"512M"``, ``"1GB"``, ``"64KiB"`` or ``"4096"`` -> bytes (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 512M or 1GB") from None


ADDRESS = click.option("--address", default="auto", show_default=True,
                       help="Ray cluster address (as for `ray.init`).")
NAMESPACE_OPT = click.option("--namespace", default="raykv", show_default=True,
                             help="Ray namespace of raykv's actors.")


@main.command()
@ADDRESS
@NAMESPACE_OPT
@click.option("--master-address", default=None, help="host:port of an existing Mooncake "
              "master (with --metadata-server); default: run one on the head node.")
@click.option("--metadata-server", default=None, help="Metadata URL of that master.")
@click.option("--segment-size", default="1GB", show_default=True,
              help="Memory each node contributes to the store.")
@click.option("--protocol", default="tcp", show_default=True, type=click.Choice(["tcp", "rdma"]))
@click.option("--mooncake-host", default=None, help="Address Mooncake binds and advertises "
              "on every node (default: the node's IP; 127.0.0.1 when all nodes share one "
              "machine).")
@click.option("--standalone", is_flag=True, help="Each node's segment lives in a "
              "mooncake_client process its cache actor supervises, so it survives a crash "
              "of the actor (default: embedded in the actor).")
@click.option("--host-pool-size", default=None, help="Per node budget for host pools "
              "(default: no limit; 1GB with --standalone, where it is requested from "
              "mooncake_client).")
@click.option("--confirm-ttl", default=2.0, show_default=True, help="Seconds group queries "
              "trust a page the store confirmed present (below the master's object lease, "
              "-default_kv_lease_ttl; 0: always ask the store).")
def up(address: str, namespace: str, master_address: str | None, metadata_server: str | None,
       segment_size: str, protocol: str, mooncake_host: str | None, standalone: bool,
       host_pool_size: str | None, confirm_ttl: float) -> None:
    """Start raykv on a running Ray cluster (master, controller, one actor per node)."""
    from raykv.clusters import deploy

    if host_pool_size is None:
        host_pool_size = "1GB" if standalone else "0"
    try:
        info = deploy.up(address, namespace=namespace, master_address=master_address,
                         metadata_server=metadata_server,
                         global_segment_size=parse_size(segment_size), protocol=protocol,
                         mooncake_host=mooncake_host, standalone=standalone,
                         host_pool_bytes=parse_size(host_pool_size),
                         confirm_ttl_s=confirm_ttl)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"raykv is up in namespace {namespace!r} ({info['mode']} mode): master "
               f"{info['master_address']}, metadata {info['metadata_server']}, "
               f"{len(info['node_ids'])} node actor(s)")


@main.command()
@ADDRESS
@NAMESPACE_OPT
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
def status(address: str, namespace: str, as_json: bool) -> None:
    """Per node: pools, bytes, pages, objects moved and hit rates per pool."""
    import json

    from raykv.clusters import deploy
    from raykv.clusters.status_view import render_status

    try:
        state = deploy.status(address, namespace)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    if as_json:
        click.echo(json.dumps(state, indent=2, default=str))
    else:
        render_status(state)


@main.command()
@ADDRESS
@NAMESPACE_OPT
def down(address: str, namespace: str) -> None:
    """Stop raykv on the cluster: reconciler, node actors (pools removed), controller,
    master."""
    from raykv.clusters import deploy

    deploy.down(address, namespace)
    click.echo(f"raykv is down in namespace {namespace!r}")


@main.command()
@click.option("--engine", default="raykv", show_default=True,
              type=click.Choice(["raykv", "sglang"]),
              help="raykv: the data plane vs raw Mooncake and memcpy (bench_dataplane.*). "
                   "sglang: SGLang's write_storage / prefetch through RayKVStore vs SGLang's "
                   "built-in MooncakeStore (bench_sglang.*), run in SGLang's venv.")
@click.option("--page-sizes", default=None,
              help="Comma-separated page sizes (K/M suffixes) [default: 64K,1M,4M; "
                   "sglang: 64K,256K,1M,4M, multiples of 64K].")
@click.option("--batch", default=128, show_default=True, help="Pages per batch call.")
@click.option("--iters", default=5, show_default=True, help="Timed iterations per size.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for the JSON and PNG.")
@click.option("--ranks", "with_ranks", is_flag=True,
              help="Also run `raykv bench-ranks` with its defaults afterwards.")
@click.option("--sglang-python", default=None, help="--engine sglang: SGLang's python "
              "[default: $RAYKV_SGLANG_PYTHON, else .venv-sglang/bin/python].")
@click.option("--standalone", is_flag=True, help="--engine sglang: nodes in standalone "
              "Mooncake mode (RayKVStore then stages SGLang's pages; bench_sglang_standalone.*).")
def bench(engine: str, page_sizes: str | None, batch: int, iters: int, out_dir: str,
          with_ranks: bool, sglang_python: str | None, standalone: bool) -> None:
    """Data-plane GB/s: raykv's whole path vs raw Mooncake vs memcpy, in one run; or
    (--engine sglang) SGLang's HiCache L3 through raykv vs SGLang's MooncakeStore."""
    sizes = [parse_size(s) for s in page_sizes.split(",")] if page_sizes else None
    if engine == "sglang":
        from raykv.clusters.bench.sglang import DEFAULT_PAGE_SIZES, run_sglang_bench

        try:
            run_sglang_bench(page_sizes=sizes or DEFAULT_PAGE_SIZES, batch=batch,
                             iters=iters, out_dir=out_dir, python=sglang_python,
                             standalone=standalone)
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    else:
        if sglang_python or standalone:
            raise click.UsageError("--sglang-python and --standalone need --engine sglang")
        from raykv.clusters.bench.dataplane import DEFAULT_PAGE_SIZES, run_dataplane_bench

        run_dataplane_bench(page_sizes=sizes or DEFAULT_PAGE_SIZES, batch=batch,
                            iters=iters, out_dir=out_dir)
    if with_ranks:
        from raykv.clusters.bench.ranks import run_ranks_bench

        run_ranks_bench(out_dir=out_dir)


@main.command("bench-ranks")
@click.option("--page-sizes", default="64K,256K,1M", show_default=True,
              help="Comma-separated page sizes (K/M suffixes, multiples of 32K).")
@click.option("--ranks", default="1,2,4,8", show_default=True,
              help="Comma-separated numbers of concurrent ranks on the node.")
@click.option("--batch", default=32, show_default=True, help="Pages per batch call.")
@click.option("--seconds", default=3.0, show_default=True, help="Per phase (side, N, size).")
@click.option("--rounds", default=1, show_default=True,
              help="Phase pairs (raykv, raw) per case; ratios are medians over rounds.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_ranks.json and .png.")
def bench_ranks(page_sizes: str, ranks: str, batch: int, seconds: float, rounds: int,
                out_dir: str) -> None:
    """N ranks on a node through its one cache actor vs N raw Mooncake clients: aggregate
    GB/s and CPU-s per GB, in one run."""
    from raykv.clusters.bench.ranks import run_ranks_bench

    try:
        run_ranks_bench(page_sizes=[parse_size(s) for s in page_sizes.split(",")],
                        ranks=[int(n) for n in ranks.split(",")], batch=batch,
                        seconds=seconds, rounds=rounds, out_dir=out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from None


@main.command("bench-group")
@click.option("--tp-sizes", default="2,4", show_default=True)
@click.option("--pages", default=128, show_default=True)
@click.option("--concurrency", default=32, show_default=True, help="Queries in flight.")
@click.option("--seconds", default=3.0, show_default=True, help="Per throughput run.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True)
def bench_group(tp_sizes: str, pages: int, concurrency: int, seconds: float,
                out_dir: str) -> None:
    """Group-exists latency and throughput vs raw batch_is_exist, in one run."""
    from raykv.clusters.bench.group import run_group_bench

    run_group_bench([int(t) for t in tp_sizes.split(",")], pages=pages,
                    concurrency=concurrency, seconds=seconds, out_dir=out_dir)


if __name__ == "__main__":
    main()
