"""The lab's commands of ``raykv``: ``demo``, the benchmarks (``bench*``), the simulator
(``sim*``) and emulated hosts (``emulate-hosts``, ``clean-hosts``). ``raykv``'s command
line finds them through the entry point group ``raykv.commands`` (``COMMANDS``), so they
appear only where the lab is installed; options, errors and exit codes follow
``raykv.clusters.cli``'s conventions and reuse its option types.
"""

from __future__ import annotations

import sys

import click
from click.core import ParameterSource
from raykv.clusters.cli import (
    LOAD_GUARD,
    NAMESPACE_OPT,
    POSITIVE,
    SECONDS,
    IntList,
    SizeList,
    epilog,
    node_options,
    node_settings_of,
    progress,
    short_size,
    spinner,
)
from raykv.controllers.node_settings import DEFAULTS, L2_EVICTIONS, PLACEMENTS
from raykv.controllers.pool_layout import KiB


@click.group()
def lab() -> None:
    """The lab's commands (``COMMANDS`` holds them)."""


# The benchmarks' page quanta (a test keeps them equal to the benchmarks' own): raykv's
# bench and bench-ranks build MLA pages of 64 tokens x 512 one-byte elements per layer;
# the SGLang bench pages of 64 tokens x K + V of 128 bf16 per layer.
BENCH_PAGE_QUANTUM = 32 * KiB
SGLANG_PAGE_QUANTUM = 64 * KiB

def _require_figures() -> None:
    """Fail before a long run, rather than at its figure, if matplotlib is missing."""
    from raykv_lab.plotting import MissingMatplotlibError, require_matplotlib

    try:
        require_matplotlib()
    except MissingMatplotlibError as e:
        raise click.ClickException(str(e)) from None


@lab.command(epilog=epilog(one=(
    "also when a first token's logits with raykv differ from recomputing, or",
    "the cached long prompt did not restore every page it could")))
@click.option("--engine", default="example", show_default=True,
              type=click.Choice(["example", "vllm"]),
              help="example: the example engine (nothing to install); vllm: real vLLM "
              "engines (vLLM installed next to raykv: docs/engines.md) on a random-weight "
              "Llama made locally.")
@click.option("--variant", default=None,
              type=click.Choice(["mha", "mla", "hybrid", "mha-draft", "mla-draft",
                                 "hybrid-draft"]),
              help="Example engine's model: attention kind, hybrid (Mamba-like layers), "
              "draft model.  [default: hybrid-draft]")
@click.option("--hidden", default=None, type=POSITIVE,
              help="Model width.  [default: 512 example, 384 vllm]")
@click.option("--layers", default=None, type=POSITIVE, help="[default: 8 example, 6 vllm]")
@click.option("--head-dim", default=None, type=POSITIVE, help="[default: 64]")
@click.option("--page-size", default=None, type=POSITIVE,
              help="Tokens per page (vllm: per block).  [default: 64 example, 128 vllm]")
@click.option("--sessions", default=4, show_default=True, type=POSITIVE)
@click.option("--turns", default=3, show_default=True, type=POSITIVE)
@click.option("--system-tokens", default=1024, show_default=True, type=POSITIVE,
              help="Shared system prompt length.")
@click.option("--user-tokens", default=64, show_default=True, type=POSITIVE,
              help="Per user message.")
@click.option("--reply-tokens", default=16, show_default=True, type=POSITIVE,
              help="Decoded per turn.")
@click.option("--long-prompt", default=4096, show_default=True, type=POSITIVE,
              help="Tokens of the prompt timed recomputed vs fully cached.")
@click.option("--load-guard", default=None, type=LOAD_GUARD,
              help="Example engine: load a hit only where it arrives sooner than "
              "computing it (auto), always (off), or when it is at least N tokens.  "
              "[default: auto]")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for demo.json and demo.png (vllm: demo_vllm.json, .png).")
def demo(engine: str, **options) -> None:
    """Multi-turn chat on a 2-node cluster: TTFT with raykv vs without, hit rates."""
    options = {k: v for k, v in options.items() if v is not None}
    _require_figures()
    if engine == "example":
        progress(f"raykv demo: starting a 2-node embedded cluster and the example engine "
                  f"({options.get('variant', 'hybrid-draft')}) on each node ...")
        from raykv_lab.demo.example_demo import run_demo

        sys.exit(0 if run_demo(**options) else 1)
    import importlib.util

    if "load_guard" in options:
        raise click.UsageError("--load-guard is an option of the example engine "
                               "(--engine example)")
    if "variant" in options:
        raise click.UsageError("--variant chooses the example engine's model; --engine vllm "
                               "runs a Llama (--hidden, --layers, --head-dim)")
    if importlib.util.find_spec("vllm") is None:
        from raykv_lab.install_hints import vllm_install_hint

        raise click.ClickException(f"--engine vllm needs vLLM: {vllm_install_hint()}")
    progress("raykv demo: starting a 2-node embedded cluster and a vLLM engine per node "
              "...")
    from raykv_lab.demo.vllm_demo import run_vllm_demo

    sys.exit(0 if run_vllm_demo(**options)["ok"] else 1)


def _given(*names: str) -> bool:
    """Whether the command line gave any of the options ``names`` (not their defaults)."""
    ctx = click.get_current_context()
    return any(ctx.get_parameter_source(n) is not ParameterSource.DEFAULT for n in names)


@lab.command("emulate-hosts", epilog=epilog(one=("also without root",)))
@click.argument("hosts", type=click.IntRange(1, 32))
@click.option("--link", default=None, help="Each host's link rate, as tc writes it (100mbit, "
              "10gbit; default: not shaped).")
@NAMESPACE_OPT
@node_options
def emulate_hosts(hosts: int, link: str | None, namespace: str, **options) -> None:
    """Start raykv on HOSTS emulated hosts on this machine (root only: a network namespace
    and address per host, a Ray node in each) and run in the foreground until Ctrl-C or
    SIGTERM, then remove it all (after a kill: `raykv clean-hosts`). A node actor on every
    host, unless a lifecycle option says more."""
    import signal
    import threading

    from raykv_lab.hosts import start_hosts

    settings, lifecycle = node_settings_of(options)
    try:  # Ctrl-C while it starts: start_hosts removes what it made
        with spinner(f"starting {hosts} emulated hosts ..."):
            cluster = start_hosts(hosts, settings, link=link, namespace=namespace,
                                  log_to_driver=False,
                                  lifecycle=lifecycle if _given(
                                      "keep_nodes", "retire_idle", "drain_timeout",
                                      "no_drain") else None)
    except (PermissionError, FileNotFoundError, ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        net = cluster.ray_nodes
        click.echo(f"raykv is up on {hosts} emulated hosts (links: {link or 'not shaped'}): "
                   f"Ray {net.gcs_address}, namespace {cluster.namespace!r}, master "
                   f"{cluster.master_address}, metadata {cluster.metadata_server}")
        for h in range(hosts):
            where = net.plan.netns(h) or "this machine's namespace (head)"
            click.echo(f"  host {h}: {net.address(h)}  {where}  node {net.node_ids[h][:12]}")
        click.echo("Ctrl-C stops it and removes every host", err=True)
        while not stop.wait(1.0):
            pass
    click.echo("raykv stopped: emulated hosts removed")


@lab.command("clean-hosts", epilog=epilog(zero="cleaned (or nothing to clean)", one=(
    "also without root",)))
@click.option("--force", is_flag=True, help="Also remove emulated clusters whose driver "
              "still runs.")
def clean_hosts(force: bool) -> None:
    """Remove what emulated hosts left behind after their driver was killed: processes,
    network namespaces, links, bridges, shared memory, their folder."""
    from raykv_lab.hosts import clean

    try:
        removed = clean(force=force)
    except (PermissionError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    for line in removed:
        click.echo(f"removed {line}")
    click.echo(f"clean: {len(removed)} thing(s) removed")


BENCH_EPILOG = epilog(
    zero="done: targets met or not (the tables and JSON say); with --check, every target "
         "met", one=("also with --check when a target is NOT met (each is named);",
                     "targets this run had no case for are not judged, never missed"))
CHECK = click.option("--check", is_flag=True, help="Exit 1 when a target is not met (for CI "
                     "or a release gate); targets this run has no case for do not count.")


def _check(results: list[dict], check: bool) -> None:
    """With ``--check``: one line naming every target ``results`` (benchmark results,
    each with its ``targets``) missed, and exit 1 (``ClickException``)."""
    if not check:
        return
    from raykv_lab.bench.verdict import check_message, missed_targets

    missed = missed_targets(r["targets"] for r in results)
    if missed:
        raise click.ClickException(check_message(missed))


@lab.command(epilog=BENCH_EPILOG)
@click.option("--engine", default="raykv", show_default=True,
              type=click.Choice(["raykv", "sglang"]),
              help="raykv: the data plane vs raw Mooncake and memcpy (bench_dataplane.*). "
                   "sglang: SGLang's write_storage / prefetch through RayKVStore vs SGLang's "
                   "built-in MooncakeStore (bench_sglang.*), run in SGLang's venv.")
@click.option("--page-sizes", default=None,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help=f"Comma-separated page sizes (K/M suffixes), multiples of "
                   f"{short_size(BENCH_PAGE_QUANTUM)}; sglang: of "
                   f"{short_size(SGLANG_PAGE_QUANTUM)} "
                   f"[default: 64K,1M,4M; sglang: 64K,256K,1M,4M].")
@click.option("--batch", default=128, show_default=True, type=POSITIVE,
              help="Pages per batch call.")
@click.option("--iters", default=5, show_default=True, type=POSITIVE,
              help="Timed iterations per size.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for the JSON and PNG.")
@click.option("--ranks", "with_ranks", is_flag=True,
              help="Also run `raykv bench-ranks` with its defaults afterwards.")
@click.option("--sglang-python", default=None, help="--engine sglang: SGLang's python "
              "[default: $RAYKV_SGLANG_PYTHON, else .venv-sglang/bin/python].")
@click.option("--standalone", is_flag=True, help="--engine sglang: nodes in standalone "
              "Mooncake mode (RayKVStore then stages SGLang's pages; bench_sglang_standalone.*).")
@CHECK
def bench(engine: str, page_sizes: tuple[int, ...] | None, batch: int, iters: int,
          out_dir: str, with_ranks: bool, sglang_python: str | None, standalone: bool,
          check: bool) -> None:
    """Data-plane GB/s: raykv's whole path vs raw Mooncake vs memcpy, in one run; or
    (--engine sglang) SGLang's HiCache L3 through raykv vs SGLang's MooncakeStore."""
    sizes = list(page_sizes) if page_sizes else None
    if engine == "sglang" and sizes and any(s % SGLANG_PAGE_QUANTUM for s in sizes):
        raise click.BadParameter(
            f"--engine sglang needs multiples of {short_size(SGLANG_PAGE_QUANTUM)} (K + V of one "
            f"layer of a 64-token page of 2 x 128 bf16)", param_hint="'--page-sizes'")
    if engine != "sglang" and (sglang_python or standalone):
        raise click.UsageError("--sglang-python and --standalone need --engine sglang")
    _require_figures()
    progress(f"raykv bench: starting a 2-node embedded cluster, then {iters} timed "
              f"iteration(s) of {batch}-page batches per page size ...")
    if engine == "sglang":
        from raykv_lab.bench.sglang import DEFAULT_PAGE_SIZES, run_sglang_bench

        try:
            results = [run_sglang_bench(page_sizes=sizes or DEFAULT_PAGE_SIZES, batch=batch,
                                        iters=iters, out_dir=out_dir, python=sglang_python,
                                        standalone=standalone)]
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    else:
        from raykv_lab.bench.dataplane import DEFAULT_PAGE_SIZES, run_dataplane_bench

        try:  # its checks run before anything starts (e.g. batch x page size too big)
            results = [run_dataplane_bench(page_sizes=sizes or DEFAULT_PAGE_SIZES,
                                           batch=batch, iters=iters, out_dir=out_dir)]
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    if with_ranks:
        progress("raykv bench: bench-ranks with its defaults ...")
        from raykv_lab.bench.ranks import run_ranks_bench

        results.append(run_ranks_bench(out_dir=out_dir))
    _check(results, check)


@lab.command("bench-ranks", epilog=BENCH_EPILOG)
@click.option("--page-sizes", default="64K,256K,1M", show_default=True,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help=f"Comma-separated page sizes (K/M suffixes, multiples of "
                   f"{short_size(BENCH_PAGE_QUANTUM)}).")
@click.option("--ranks", default="1,2,4,8", show_default=True, type=IntList(min=1),
              help="Comma-separated numbers of concurrent ranks on the node.")
@click.option("--batch", default=32, show_default=True, type=POSITIVE,
              help="Pages per batch call.")
@click.option("--seconds", default=3.0, show_default=True, type=SECONDS,
              help="Per phase (side, N, size).")
@click.option("--rounds", default=1, show_default=True, type=POSITIVE,
              help="Phase pairs (raykv, raw) per case; ratios are medians over rounds.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_ranks.json and .png.")
@CHECK
def bench_ranks(page_sizes: tuple[int, ...], ranks: tuple[int, ...], batch: int,
                seconds: float, rounds: int, out_dir: str, check: bool) -> None:
    """N ranks on a node through its one node actor vs N raw Mooncake clients: aggregate
    GB/s and CPU-s per GB, in one run."""
    _require_figures()
    timed = len(page_sizes) * len(ranks) * rounds * 2 * seconds
    progress(f"raykv bench-ranks: starting a 2-node embedded cluster, then "
              f"{len(page_sizes) * len(ranks)} case(s), {timed:.0f} s of timed phases ...")
    from raykv_lab.bench.ranks import run_ranks_bench

    try:
        result = run_ranks_bench(page_sizes=list(page_sizes), ranks=list(ranks), batch=batch,
                                 seconds=seconds, rounds=rounds, out_dir=out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _check([result], check)


@lab.command("bench-hosts", epilog=epilog(one=("also without root",)))
@click.option("--locality", is_flag=True,
              help="What locality is worth instead: a prefix written on host A loaded "
                   "from A's L2, from L3 on A's own segment and from L3 on host B across "
                   "the link (defaults then: --links 1gbit,10gbit,25gbit,unshaped "
                   "--page-sizes 256K,2M --batch 64).")
@click.option("--links", default=None,
              help="Comma-separated link rates, as tc writes them (--locality: also "
                   "'unshaped'); one cluster, the link re-shaped between rates. "
                   "[default: 1gbit,10gbit,25gbit]")
@click.option("--page-sizes", default=None,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help="Comma-separated page sizes (K/M suffixes). [default: 1M,4M]")
@click.option("--batch", default=None, type=POSITIVE,
              help="Pages per batch call (--locality: pages per prefix). [default: 32]")
@click.option("--iters", default=3, show_default=True, type=POSITIVE,
              help="Timed iterations per link and size (--locality: loads per source).")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_hosts.json (--locality: bench_hosts_locality.json).")
def bench_hosts(locality: bool, links: str | None, page_sizes: tuple[int, ...] | None,
                batch: int | None, iters: int, out_dir: str) -> None:
    """Cross-host L3 puts and gets on two emulated hosts (root only), raykv vs raw
    Mooncake on the same shaped link, in one run: GB/s and the fraction of the link.
    With --locality: a same-host L2 hit against L3 reads of the same prefix, on the
    host's own segment and across the link, at each link rate."""
    from raykv_lab.bench import host_locality, hosts
    from raykv_lab.host_plan import parse_rate

    mode = host_locality if locality else hosts
    rates = ([x.strip() for x in links.split(",") if x.strip()] if links
             else list(mode.DEFAULT_LINKS))
    sizes = list(page_sizes or mode.DEFAULT_PAGE_SIZES)
    try:
        for rate in rates:
            if not (locality and rate == host_locality.UNSHAPED):
                parse_rate(rate)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--links'") from None
    try:
        for size in sizes if locality else ():
            host_locality.geometry(size)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--page-sizes'") from None
    progress(f"raykv bench-hosts: starting 2 emulated hosts, then {len(rates)} link "
              f"rate(s) x {len(sizes)} page size(s) ...")
    try:
        if locality:
            host_locality.run_locality_bench(links=rates, page_sizes=sizes,
                                             pages=batch or host_locality.DEFAULT_PAGES,
                                             iters=iters, out_dir=out_dir)
        else:
            hosts.run_hosts_bench(links=rates, page_sizes=sizes, batch=batch or 32,
                                  iters=iters, out_dir=out_dir)
    except (PermissionError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@lab.command("bench-guard-links", epilog=epilog(one=("also without root or vLLM",)))
@click.option("--links", default="10mbit,100mbit,1gbit,10gbit", show_default=True,
              help="Comma-separated rates of host 1's link, as tc writes them, or "
                   "'unshaped'; one cluster, the link re-shaped between rates.")
@click.option("--lengths", default="256,1024,1920", show_default=True,
              type=IntList(min=129), help="Comma-separated prompt lengths in tokens "
                                         "(129 to 4000).")
@click.option("--repeats", default=3, show_default=True, type=POSITIVE,
              help="Fresh prompts per rate and length (figures: medians).")
@click.option("--settle", default=8, show_default=True, type=click.IntRange(min=0),
              help="Untimed loads after each re-shaping, so the guard's estimate of the "
                   "link follows the new rate.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_guard_links.json.")
def bench_guard_links(links: str, lengths: tuple[int, ...], repeats: int, settle: int,
                      out_dir: str) -> None:
    """The load guard vs link speed with real vLLM on two emulated hosts (root only):
    TTFT of a hit always loaded, of the guard's choice and of a cold prefill, per link
    rate and prompt length."""
    import importlib.util

    from raykv_lab.bench.guard_summary import check_lengths, check_links

    rates = [x.strip() for x in links.split(",") if x.strip()]
    try:
        check_links(rates)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--links'") from None
    try:
        check_lengths(lengths)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--lengths'") from None
    if importlib.util.find_spec("vllm") is None:
        from raykv_lab.install_hints import vllm_install_hint

        raise click.ClickException(f"bench-guard-links needs vLLM: {vllm_install_hint()}")
    progress(f"raykv bench-guard-links: starting 2 emulated hosts and 3 vLLM engines, "
              f"then {len(rates)} link rate(s) x {len(lengths)} length(s) x {repeats} "
              f"repeat(s) ...")
    from raykv_lab.bench.guard_links import run_guard_links_bench

    try:
        run_guard_links_bench(links=rates, lengths=lengths, repeats=repeats, settle=settle,
                              out_dir=out_dir)
    except (PermissionError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@lab.command("bench-scale-down", epilog=epilog(one=("also without root",)))
@click.option("--links", default="1gbit,10gbit", show_default=True,
              help="Comma-separated link rates, as tc writes them; a cluster per rate "
                   "and drain mode.")
@click.option("--modes", default="on,off", show_default=True,
              help="Comma-separated drain modes of the leaving host: on, off.")
@click.option("--requests", default=64, show_default=True, type=POSITIVE,
              help="Seeded requests before and after the scale-down.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for scale_down.json.")
def bench_scale_down(links: str, modes: str, requests: int, out_dir: str) -> None:
    """A scale-down mid-workload on three emulated hosts (root only): host 2 leaves,
    its drain on or off; the hit rate after vs before, and the drain's GB/s."""
    from raykv_lab.bench.scale_down import MODES, run_scale_down_bench
    from raykv_lab.host_plan import parse_rate

    rates = [x.strip() for x in links.split(",") if x.strip()]
    kinds = [x.strip() for x in modes.split(",") if x.strip()]
    try:
        for rate in rates or [""]:
            parse_rate(rate)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--links'") from None
    if not kinds or any(k not in MODES for k in kinds):
        raise click.BadParameter(f"modes are of {', '.join(MODES)}, got {modes!r}",
                                 param_hint="'--modes'")
    progress(f"raykv bench-scale-down: {len(rates) * len(kinds)} cluster(s) of 3 "
              f"emulated hosts, one per link rate and drain mode ...")
    try:
        run_scale_down_bench(links=rates, modes=kinds, requests=requests, out_dir=out_dir,
                             command=" ".join(["raykv", *sys.argv[1:]]))
    except (PermissionError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@lab.command("bench-gpu", epilog=epilog(
    zero="done: every page came back byte-exact (the tables and bench_gpu.json give the "
         "figures; this bench has no targets to check)",
    one=("also without a CUDA GPU, or when a page came back with other bytes",)))
@click.option("--page-sizes", default="256K,1M,4M", show_default=True,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help=f"Comma-separated page sizes (K/M suffixes, multiples of "
                   f"{short_size(BENCH_PAGE_QUANTUM)}).")
@click.option("--batch", default=64, show_default=True, type=POSITIVE,
              help="Pages per batch call.")
@click.option("--iters", default=5, show_default=True, type=POSITIVE,
              help="Timed iterations per page size.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_gpu.json.")
def bench_gpu(page_sizes: tuple[int, ...], batch: int, iters: int, out_dir: str) -> None:
    """KV pages from a CUDA GPU through raykv and back (needs a GPU): device <-> host
    pool copies vs torch's pinned and pageable buffers, the whole path vs raw Mooncake,
    vLLM's six KV cache layouts through the connector worker's L2 and store paths, and
    its saves behind the step; bytes compared on the device."""
    progress(f"raykv bench-gpu: starting a 2-node embedded cluster, then {iters} timed "
              f"iterations per page size ...")
    from raykv_lab.bench.gpu import run_gpu_bench

    try:
        run_gpu_bench(page_sizes=list(page_sizes), batch=batch, iters=iters, out_dir=out_dir)
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@lab.command("bench-group", epilog=BENCH_EPILOG)
@click.option("--tp-sizes", default="2,4", show_default=True, type=IntList(min=1),
              help="Comma-separated TP sizes: one group of that many ranks each, measured "
                   "one after the other.")
@click.option("--pages", default=128, show_default=True, type=POSITIVE,
              help="Pages per group query (a prompt's length).")
@click.option("--concurrency", default=32, show_default=True, type=POSITIVE,
              help="Queries in flight in the throughput runs.")
@click.option("--seconds", default=3.0, show_default=True, type=SECONDS,
              help="Per throughput run (4 per TP size: hits, misses, shared, raw).")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for bench_group.json.")
@CHECK
def bench_group(tp_sizes: tuple[int, ...], pages: int, concurrency: int, seconds: float,
                out_dir: str, check: bool) -> None:
    """Group-exists latency and throughput vs raw batch_is_exist, in one run."""
    progress(f"raykv bench-group: starting a 1-node embedded cluster, then per TP size "
              f"({', '.join(map(str, tp_sizes))}): latency runs and 4 throughput runs of "
              f"{seconds:g} s ...")
    from raykv_lab.bench.group import run_group_bench

    result = run_group_bench(list(tp_sizes), pages=pages, concurrency=concurrency,
                             seconds=seconds, out_dir=out_dir)
    _check([result], check)


class Tokens(click.ParamType):
    """A token count >= ``min`` with an optional K/M/G suffix (powers of 1000, as traces
    and papers count tokens): ``256K``, ``3M``, ``50000000``."""

    name = "tokens"

    def __init__(self, min: int = 1) -> None:
        self.min = min

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            n = value
        else:
            t = str(value).strip().upper()
            scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(t[-1:], 1)
            try:
                n = round(float(t[:-1] if scale > 1 else t) * scale)
            except ValueError:
                self.fail(f"{value!r} is not a token count like 256K or 3M", param, ctx)
        if n < self.min:
            self.fail(f"{value!r} is below {self.min} tokens", param, ctx)
        return n


class TokensList(click.ParamType):
    """Comma-separated token counts (as ``Tokens``); converts to a tuple."""

    name = "tokens"

    def __init__(self, min: int = 1) -> None:
        self.min = min

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        if isinstance(value, tuple | list):
            return tuple(value)
        return tuple(Tokens(self.min).convert(part, param, ctx) for part in value.split(","))


def _sim_options(command):
    """The options ``sim`` and ``sim-sweep`` share: the cluster, the costs, the trace."""
    options = [
        click.option("--nodes", default=16, show_default=True, type=POSITIVE,
                     help="Nodes."),
        click.option("--engines-per-node", default=8, show_default=True, type=POSITIVE,
                     help="Engines (replicas) per node."),
        click.option("--gpu-tokens", default="256K", show_default=True, type=Tokens(512),
                     help="Each engine's GPU prefix cache, tokens of KV."),
        click.option("--l2-tokens", default="1M", show_default=True, type=Tokens(512),
                     help="Each node's L2, tokens."),
        click.option("--l3-tokens", default="2M", show_default=True, type=Tokens(512),
                     help="Each node's L3 segment, tokens (the other runs get L2 + L3 per "
                          "node)."),
        click.option("--placement", default=DEFAULTS.placement, show_default=True,
                     type=click.Choice(PLACEMENTS), help="raykv's L3 placement."),
        click.option("--l2-eviction", default=DEFAULTS.l2_eviction, show_default=True,
                     type=click.Choice(L2_EVICTIONS),
                     help="raykv's L2 eviction policy."),
        click.option("--prefill-tokens-per-s", default=None, type=SECONDS,
                     help="An engine's prefill rate [default: the cost model's, 10000]."),
        click.option("--link-gbit", default=None, type=SECONDS,
                     help="Each node's link, Gbit/s each way [default: the cost model's, "
                          "25]."),
        click.option("--limit", default=None, type=POSITIVE,
                     help="Replay the first N requests."),
        click.option("--copies", default=1, show_default=True, type=POSITIVE,
                     help="Replay the trace this many times over, one copy after the other "
                          "(renamed blocks: the simulator's cost against the trace's "
                          "length)."),
        click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
                     help="Seeds every random choice (routing, placement)."),
    ]
    for option in reversed(options):
        command = option(command)
    return click.argument("trace", type=click.Path(dir_okay=False))(command)


def _sim_inputs(trace: str, nodes: int, engines_per_node: int, gpu_tokens: int,
                l2_tokens: int, l3_tokens: int, placement: str, l2_eviction: str,
                prefill_tokens_per_s: float | None, link_gbit: float | None,
                limit: int | None, copies: int, seed: int) -> tuple:
    """``(requests, setup, costs)`` of the shared options; ``ValueError`` or
    ``OSError`` for a trace that cannot be read or a bad line."""
    import dataclasses

    from raykv_lab.sim.compare import Setup
    from raykv_lab.sim.costs import Costs
    from raykv_lab.sim.trace import read_trace, shifted_copies

    changes = {k: v for k, v in (("prefill_tokens_per_s", prefill_tokens_per_s),
                                 ("link_gbit", link_gbit)) if v is not None}
    requests = read_trace(trace, limit)
    requests = shifted_copies(requests, copies) if copies > 1 else requests
    setup = Setup(nodes, engines_per_node, gpu_tokens, l2_tokens, l3_tokens, placement, seed,
                  l2_eviction=l2_eviction)
    return requests, setup, dataclasses.replace(Costs(), **changes)


SIM_EPILOG = epilog(zero="done: the comparison printed (and written with --out)",
                     one=("also when the trace cannot be read or a line of it is not a "
                          "request (the line is named)",))


@lab.command(epilog=SIM_EPILOG)
@_sim_options
@click.option("--runs", default="all", show_default=True,
              help="Comma-separated timed runs to make, of: gpu_only, local_host, pooled, "
                   "raykv, raykv_pow2 (raykv's tiers, power of two routing); all: each.")
@click.option("--out", "out_file", default=None, type=click.Path(dir_okay=False),
              help="Write the whole comparison as JSON to this file.")
@click.option("--disk-tokens", default="0", show_default=True, type=Tokens(0),
              help="Each node's disk tier (L4) under its L3 segment, tokens (the pooled "
                   "and raykv runs); 0: none.")
@click.option("--remove-node", "remove_at", default=None, type=click.FloatRange(min=0),
              help="At this simulated second one node leaves (--leaving-node, or the one "
                   "whose L3 segment holds the most objects then).")
@click.option("--leaving-node", default=None, type=click.IntRange(min=0),
              help="The node --remove-node removes.")
@click.option("--drain/--no-drain", default=True, show_default=True,
              help="Whether the leaving node drains its L3 segment before it goes.")
@click.option("--drain-deadline-s", default=None, type=SECONDS,
              help="The leaving node's drain deadline [default: the product's, 30].")
@click.option("--add-node", "add_at", default=None, type=click.FloatRange(min=0),
              help="At this simulated second one node joins.")
@click.option("--warm-pages", default=None, type=click.IntRange(min=0),
              help="The joining node's L2 warm-up, pages [default: the product's share, "
                   "a quarter of its L2]; 0: no warm-up.")
@click.option("--window-s", default=600.0, show_default=True, type=SECONDS,
              help="The window before and after a node change whose hit rates are "
                   "reported.")
@click.option("--window-at", default=None, type=click.FloatRange(min=0),
              help="Also report the hit rates in the windows around this simulated "
                   "second (without node changes: the trace's own drift there).")
@click.option("--disk-get-gbps", default=None, type=SECONDS,
              help="A get served from a disk tier, GB/s [default: the cost model's, "
                   "0.39].")
@click.option("--load-guard", default="auto", show_default=True,
              help="raykv's load guard on the raykv runs: auto (load a hit's leading "
                   "pages only while that is faster than computing them), off (load "
                   "every hit) or N (load a hit of at least N tokens, else none).")
def sim(runs: str, out_file: str | None, disk_tokens: int, remove_at: float | None,
        leaving_node: int | None, drain: bool, drain_deadline_s: float | None,
        add_at: float | None, warm_pages: int | None, window_s: float,
        window_at: float | None, disk_get_gbps: float | None, load_guard: str,
        **options) -> None:
    """Replay TRACE (Mooncake's JSONL) on a simulated cluster through raykv's own cache
    and routing policies, on simulated time (no Ray, no GPU), against GPU caches alone,
    a host tier per engine, one pooled store, and the global LRU, Belady and unbounded
    references: hit rates per tier, TTFT, network bytes, load per node; optionally with
    a disk tier, a node leaving (drained or not) and a node joining (warmed or not),
    and raykv's load guard (``--load-guard``)."""
    import dataclasses
    import json

    from raykv.controllers.load_guard import GuardSettings
    from raykv_lab.sim.compare import RUNS, compare
    from raykv_lab.sim.scaling import Scaling

    try:
        load_guard = GuardSettings.parse(load_guard).describe()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--load-guard'") from None

    chosen = RUNS if runs == "all" else tuple(r.strip() for r in runs.split(",") if r.strip())
    if not chosen or any(r not in RUNS for r in chosen):
        raise click.BadParameter(f"{runs!r}: give some of {', '.join(RUNS)}",
                                 param_hint="'--runs'")
    changes = {k: v for k, v in (("drain_deadline_s", drain_deadline_s),
                                 ("warm_pages", warm_pages)) if v is not None}
    scaling = None if remove_at is None and add_at is None and window_at is None else \
        Scaling(remove_at=remove_at, leaving=leaving_node, drain=drain, add_at=add_at,
                window_s=window_s, window_at=window_at, **changes)
    try:
        requests, setup, costs = _sim_inputs(**options)
        setup = dataclasses.replace(setup, disk_tokens=disk_tokens, load_guard=load_guard)
        if disk_get_gbps is not None:
            costs = dataclasses.replace(costs, disk_get_gbps=disk_get_gbps)
        result = compare(requests, setup, costs, chosen, scaling)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    for line in sim_table(result) + sim_changes(result):
        click.echo(line)
    if out_file:
        with open(out_file, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


@lab.command("sim-sweep", epilog=epilog(
    zero="done: raykv-out/sim_sweep.json and sim_sweep.png (in --out)",
    one=("also when the trace cannot be read or a line of it is not a request",)))
@_sim_options
@click.option("--host-tokens", default="250K,500K,1M,3M,10M", show_default=True,
              type=TokensList(2 * 512),
              help="Host memory per node to sweep (a third L2, the rest L3), at --nodes.")
@click.option("--node-counts", default="4,8,16,32", show_default=True, type=IntList(min=1),
              help="Node counts to sweep, at --l2-tokens + --l3-tokens per node.")
@click.option("--out", "out_dir", default="raykv-out", show_default=True,
              help="Folder for sim_sweep.json and sim_sweep.png.")
def sim_sweep(host_tokens: tuple[int, ...], node_counts: tuple[int, ...], out_dir: str,
              **options) -> None:
    """`raykv sim`'s comparison (host tier per engine, pooled store, raykv, and the
    references) at several host capacities per node and several node counts: hit rate
    and TTFT against each, as JSON and a figure (the bench extra's matplotlib)."""
    import json
    from pathlib import Path

    _require_figures()
    from raykv_lab.sim.sweep import sweep
    from raykv_lab.sim.sweep_figure import draw

    try:
        requests, setup, costs = _sim_inputs(**options)
        result = sweep(requests, setup, costs, host_tokens, node_counts)
    except (OSError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    draw(result, out / "sim_sweep.png")
    for key, x in (("capacity", "host_tokens"), ("nodes", "nodes")):
        for p in result[key]:
            click.echo(f"{x}={p[x]}: " + ", ".join(
                f"{n} {r['block_hit_rate']:.3f} ({r['ttft_p50_s']:.2f} s)"
                for n, r in p["runs"].items()) + f", belady {p['bounds']['belady']:.3f} (host only "
                f"{p['bounds']['belady_host']:.3f})")
    click.echo(f"wrote {out / 'sim_sweep.json'} and {out / 'sim_sweep.png'}")


TRACE_EPILOG = epilog(zero="the trace written to --out")


@lab.group("sim-trace", epilog=epilog(zero="the trace written where its kind's command says"))
def sim_trace() -> None:
    """Write a seeded synthetic trace in Mooncake's JSONL format, for `raykv sim`."""


def _write_trace(requests: list, out_file: str) -> None:
    from raykv_lab.sim.workloads import to_jsonl

    try:
        with open(out_file, "w", encoding="utf-8") as f:
            f.write(to_jsonl(requests))
    except OSError as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"wrote {len(requests)} requests to {out_file}")


OUT_TRACE = click.option("--out", "out_file", required=True,
                         type=click.Path(dir_okay=False), help="The JSONL file to write.")
RATE = click.option("--rate", default=1.0, show_default=True, type=SECONDS,
                    help="Requests per second (Poisson arrivals).")
SEED = click.option("--seed", default=0, show_default=True, type=click.IntRange(min=0),
                    help="Seeds the arrivals and the order.")


@sim_trace.command("multi-round-qa", epilog=TRACE_EPILOG)
@click.option("--users", default=40, show_default=True, type=POSITIVE, help="Users.")
@click.option("--rounds", default=10, show_default=True, type=POSITIVE,
              help="Rounds (questions) per user.")
@click.option("--system-tokens", default=1000, show_default=True, type=POSITIVE,
              help="The system prompt every user shares.")
@click.option("--context-tokens", default=20000, show_default=True, type=POSITIVE,
              help="Each user's own context before the first question.")
@click.option("--question-tokens", default=100, show_default=True, type=POSITIVE,
              help="Each question.")
@click.option("--answer-tokens", default=200, show_default=True, type=POSITIVE,
              help="Each answer (the request's output, appended to the next round).")
@RATE
@SEED
@OUT_TRACE
def multi_round_qa(out_file: str, **options) -> None:
    """Users who each hold a conversation (LMCache's multi-round QA): every round a
    user's prompt is the previous one with its answer and a new question."""
    from raykv_lab.sim.workloads import multi_round_qa as make

    _write_trace(make(**options), out_file)


@sim_trace.command("shared-prefix", epilog=TRACE_EPILOG)
@click.option("--groups", default=16, show_default=True, type=POSITIVE,
              help="Groups, each with a prefix of its own.")
@click.option("--prompts-per-group", default=64, show_default=True, type=POSITIVE,
              help="Prompts per group.")
@click.option("--prefix-tokens", default=2048, show_default=True, type=POSITIVE,
              help="The prefix a group's prompts share.")
@click.option("--question-tokens", default=256, show_default=True, type=POSITIVE,
              help="Each prompt's own question after the prefix.")
@click.option("--output-tokens", default=256, show_default=True, type=POSITIVE,
              help="Each request's output.")
@RATE
@SEED
@OUT_TRACE
def shared_prefix(out_file: str, **options) -> None:
    """Groups of prompts sharing a prefix (llm-d's shared-prefix workload), the groups'
    prompts interleaved at random."""
    from raykv_lab.sim.workloads import shared_prefix as make

    _write_trace(make(**options), out_file)


def sim_table(result: dict) -> list[str]:
    """The lines ``raykv sim`` prints of a comparison."""
    lines = [f"{result['requests']} requests, {result['setup']['nodes']} nodes x "
             f"{result['setup']['engines_per_node']} engines",
             f"{'run':<11} {'hit(blk)':>8} {'hit(tok)':>8} {'gpu':>6} {'host':>6} "
             f"{'l2':>6} {'l3 own':>6} {'l3 rem':>6} {'TTFT p50/p90/p99 s':>21} "
             f"{'net GB':>8} {'req/node':>9} {'sim s':>6}"]
    for name, r in result["runs"].items():
        tiers = r["tiers_block"]
        ttft = "/".join(f"{r['ttft_s'][q]:.2f}" for q in ("p50", "p90", "p99"))
        per = r["requests_per_node"]
        lines.append(f"{name:<11} {r['block_hit_rate']:>8.3f} {r['token_hit_rate']:>8.3f} "
                     + " ".join(f"{tiers[t]:>6.3f}" for t in
                                ("gpu", "host", "l2", "l3_own", "l3_remote"))
                     + f" {ttft:>21} {r['network_bytes'] / 1e9:>8.0f} "
                     f"{per['min']:>4}-{per['max']:<4} {r['simulator_s']:>6.1f}")
    b = result["bounds"]
    lines.append(f"references at {b['capacity_blocks']} blocks (GPU + host): " + ", ".join(
        f"{n} {b[n]['block_hit_rate']:.3f}" for n in ("global_lru", "belady", "unbounded")))
    lines.append(f"references at {b['host_blocks']} blocks (host only): " + ", ".join(
        f"{n} {b[n + '_host']['block_hit_rate']:.3f}" for n in ("global_lru", "belady")))
    if "ratios" in result:
        lines.append("raykv over: " + ", ".join(
            f"{k.removeprefix('raykv_over_')} {v:.2f}x" for k, v in result["ratios"].items()))
    return lines


def _around(w: dict, mark: str = "") -> str:
    """A hit-rate window pair of ``raykv sim``'s node changes, as printed."""
    return (f"hit rate {w['before']['hit_rate']:.3f} in the {w['window_s']:g} s before"
            f"{mark}, {w['after']['hit_rate']:.3f} after ({w['after_vs_before']:.2f}x)")


def sim_changes(result: dict) -> list[str]:
    """The lines ``raykv sim`` prints of its disk tier and node changes, per run."""
    lines = []
    for name, r in result["runs"].items():
        disk = r["counters"].get("l3", {}).get("disk")
        if disk is not None:
            lines.append(f"{name}: L3 disk {r['tiers_block']['l3_disk']:.3f} of blocks; "
                         f"{disk['offloaded']} blocks offloaded, {disk['deleted']} deleted "
                         f"(disk full)")
        guard = r["counters"].get("load_guard")
        if guard is not None:
            lines.append(f"{name}: load guard cut {guard['requests_cut']} hits, "
                         f"{guard['blocks_skipped']} blocks computed instead (L2 "
                         f"{guard['l2_skipped']}, L3 {guard['l3_skipped']}, disk "
                         f"{guard['l3_disk_skipped']})")
        sc = r["counters"].get("scaling", {})
        if "window" in sc:
            lines.append(f"{name}: {_around(sc['window'], ' --window-at')}")
        for event, what in (("removed", "left"), ("added", "joined")):
            if event in sc:
                e = sc[event]
                lines.append(f"{name}: node {e['node']} {what} at {e['at']:g} s; "
                             f"{_around(e)}")
        if "drain" in sc:
            d = sc["drain"]
            lines.append(f"{name}: drain moved {d['moved']} of {d['candidates']} candidate "
                         f"blocks ({d['held']} held) in {d['seconds']:g} s; dropped "
                         f"{d['dropped']} (no room), evicted {d['evicted']}, failed "
                         f"{d['failed']} (target full), left {d['left']}")
        if "lost" in sc:
            lost = sc["lost"]
            lines.append(f"{name}: gone at {sc['removed']['gone_at']:g} s, lost with it: "
                         f"{lost['memory']} L3 blocks, "
                         f"{lost['disk']} on its disk, {sc['removed']['l2_pages_lost']} L2 "
                         "pages")
        if "warm" in sc:
            w, after = sc["warm"], sc["added"]["node_after"]
            lines.append(f"{name}: warm-up read {w['read']} of {w['pages']} pages "
                         f"({w['stopped']}); the new node's L2 served {after['l2_blocks']} "
                         f"of {after['blocks']} blocks in its first {sc['added']['window_s']:g} s")
    return lines


COMMANDS = tuple(lab.commands.values())
"""The commands ``raykv`` adds from the lab (entry point ``raykv.commands``)."""
