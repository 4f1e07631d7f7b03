"""The ``raykv`` command line.

User errors end in one line on stderr and a non-zero exit, never a traceback: a bad
option value is click's usage error (exit 2), anything else a ``click.ClickException``
(exit 1), e.g. when no Ray cluster answers at ``--address`` (found out in seconds, see
``clusters.ray_address``). Each command's help lists its exit codes.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import sys
from collections.abc import Iterator

import click
from click.core import ParameterSource
from raykv.clusters.node_lifecycle import DRAIN_TIMEOUT_S, RETIRE_IDLE_S, LifecycleSettings
from raykv.controllers.node_settings import (
    DEFAULTS,
    L2_EVICTIONS,
    PLACEMENTS,
    STANDALONE_POOL_BYTES,
    NodeSettings,
    pool_budget,
)
from raykv.controllers.pool_layout import KiB

# The benchmarks' page quanta (a test keeps them equal to the benchmarks' own): raykv's
# bench and bench-ranks build MLA pages of 64 tokens x 512 one-byte elements per layer;
# the SGLang bench pages of 64 tokens x K + V of 128 bf16 per layer.
BENCH_PAGE_QUANTUM = 32 * KiB
SGLANG_PAGE_QUANTUM = 64 * KiB



def _epilog(zero: str = "done", one: tuple[str, ...] = ()) -> str:
    """A command's exit codes as its help's last lines, kept as written (``\b``):
    ``zero`` says when it exits 0, ``one`` the lines of what else than a failure exits
    1."""
    lines = ["\b", "Exit codes:", f"  0  {zero}",
             "  1  failed (the message says why)" + (";" if one else ""),
             *(f"     {line}" for line in one), "  2  bad usage or option value"]
    return "\n".join(lines)


@click.group(epilog=_epilog())
@click.version_option(package_name="raykv", prog_name="raykv")
def main() -> None:
    """raykv: a Ray-native distributed KV cache for LLM inference."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def parse_size(text: str) -> int:
    """``"512M"``, ``"1GB"``, ``"64KiB"`` or ``"4096"`` -> bytes (powers of 1024)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        return int(t[:-1]) * units[t[-1]] if t and t[-1] in units else int(t)
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a size like 512M or 1GB") from None


def _short(n: int) -> str:
    """``32768`` -> ``"32K"``: bytes as an option value would give them."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


class Size(click.ParamType):
    """A byte count >= 0 with an optional K/M/G/T suffix (powers of 1024; ``B`` and
    ``iB`` allowed after it): ``512M``, ``1GB``, ``64KiB``, ``4096``."""

    name = "size"

    def convert(self, value, param, ctx) -> int:
        if isinstance(value, int):
            return value
        try:
            size = parse_size(value)
        except click.BadParameter as e:
            self.fail(e.message, param, ctx)
        if size < 0:
            self.fail(f"{value!r} is negative", param, ctx)
        return size


class SizeList(click.ParamType):
    """Comma-separated sizes (as ``Size``), each a positive multiple of ``quantum`` bytes
    (``what`` says why, for the message); converts to a tuple of byte counts."""

    name = "sizes"

    def __init__(self, quantum: int, what: str) -> None:
        self.quantum, self.what = quantum, what

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        if isinstance(value, tuple | list):
            return tuple(value)
        sizes = []
        for part in value.split(","):
            size = Size().convert(part, param, ctx)
            if size <= 0 or size % self.quantum:
                self.fail(f"{part.strip()} ({size} bytes) is not a positive multiple of "
                          f"{_short(self.quantum)} ({self.what})", param, ctx)
            sizes.append(size)
        return tuple(sizes)


class IntList(click.ParamType):
    """Comma-separated integers, each at least ``min``; converts to a tuple."""

    name = "ints"

    def __init__(self, min: int = 1) -> None:
        self.min = min

    def convert(self, value, param, ctx) -> tuple[int, ...]:
        if isinstance(value, tuple | list):
            return tuple(value)
        numbers = []
        for part in value.split(","):
            try:
                n = int(part)
            except ValueError:
                self.fail(f"{part.strip()!r} is not an integer (give a comma-separated list "
                          f"like 2,4)", param, ctx)
            if n < self.min:
                self.fail(f"{n} is below {self.min}", param, ctx)
            numbers.append(n)
        return tuple(numbers)


class TenantQuota(click.ParamType):
    """``NAME=SIZE``: a tenant name and its quota (a ``Size`` > 0); converts to
    ``(name, bytes)``."""

    name = "tenant=size"

    def convert(self, value, param, ctx) -> tuple[str, int]:
        if isinstance(value, tuple):
            return value
        tenant, sep, size = str(value).partition("=")
        if not sep:
            self.fail(f"{value!r} is not NAME=SIZE (e.g. team-a=4GB)", param, ctx)
        from raykv.controllers.tenancy import check_tenant

        try:
            check_tenant(tenant.strip())
        except ValueError as e:
            self.fail(str(e), param, ctx)
        nbytes = Size().convert(size, param, ctx)
        if nbytes <= 0:
            self.fail(f"the quota of tenant {tenant.strip()!r} must be > 0", param, ctx)
        return tenant.strip(), nbytes


class TenantDigest(click.ParamType):
    """``NAME=DIGEST``: a tenant name and the digest of its owner proof (what ``raykv
    tenant-digest`` prints); converts to ``(name, digest)``."""

    name = "tenant=digest"

    def convert(self, value, param, ctx) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        from raykv.controllers.ownership import check_tenant_digests

        tenant, sep, digest = str(value).strip().partition("=")
        if not sep:
            self.fail(f"{value!r} is not NAME=DIGEST (`raykv tenant-digest NAME` prints "
                      "it)", param, ctx)
        try:
            check_tenant_digests({tenant: digest})
        except ValueError as e:
            self.fail(str(e), param, ctx)
        return tenant, digest


POSITIVE = click.IntRange(min=1)
SECONDS = click.FloatRange(min=0, min_open=True)


class LoadGuard(click.ParamType):
    """A load guard setting: ``auto``, ``off`` or a threshold in tokens, checked by
    ``GuardSettings.parse`` and handed on as written (lower case)."""

    name = "auto|off|TOKENS"

    def convert(self, value, param, ctx):
        from raykv.controllers.load_guard import GuardSettings

        try:
            return GuardSettings.parse(str(value)).describe()
        except ValueError as e:
            self.fail(str(e), param, ctx)


LOAD_GUARD = LoadGuard()


def _progress(line: str) -> None:
    """A line on stderr before a command's long phase (stdout keeps its results)."""
    click.echo(line, err=True)


@contextlib.contextmanager
def _spinner(text: str) -> Iterator[None]:
    """A spinner on stderr while a cluster command waits (on a terminal only: nothing is
    written when stderr is a pipe or a file)."""
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


def _require_figures(extra: str) -> None:
    """Fail before a long run, rather than at its figure, if matplotlib is missing."""
    from raykv.clusters.plotting import MissingExtraError, require_matplotlib

    try:
        require_matplotlib(extra)
    except MissingExtraError as e:
        raise click.ClickException(str(e)) from None


@main.command(epilog=_epilog(one=(
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
    _require_figures("demo")
    if engine == "example":
        _progress(f"raykv demo: starting a 2-node embedded cluster and the example engine "
                  f"({options.get('variant', 'hybrid-draft')}) on each node ...")
        from raykv.clusters.demo.example_demo import run_demo

        sys.exit(0 if run_demo(**options) else 1)
    import importlib.util

    if "load_guard" in options:
        raise click.UsageError("--load-guard is an option of the example engine "
                               "(--engine example)")
    if "variant" in options:
        raise click.UsageError("--variant chooses the example engine's model; --engine vllm "
                               "runs a Llama (--hidden, --layers, --head-dim)")
    if importlib.util.find_spec("vllm") is None:
        from raykv.clusters.install_hints import vllm_install_hint

        raise click.ClickException(f"--engine vllm needs vLLM: {vllm_install_hint()}")
    _progress("raykv demo: starting a 2-node embedded cluster and a vLLM engine per node "
              "...")
    from raykv.clusters.demo.vllm_demo import run_vllm_demo

    sys.exit(0 if run_vllm_demo(**options)["ok"] else 1)


ADDRESS = click.option("--address", default="auto", show_default=True,
                       help="Ray cluster address (as for `ray.init`: host:port of the head's "
                       "GCS; auto: RAY_ADDRESS, else the cluster `ray start` made here).")
NAMESPACE_OPT = click.option("--namespace", default="raykv", show_default=True,
                             help="Ray namespace of raykv's actors.")


@contextlib.contextmanager
def _until_ctrl_c():
    """An event that Ctrl-C (SIGINT) sets, for a loop that ends cleanly once it is set; a
    second Ctrl-C raises ``KeyboardInterrupt`` as usual (to leave a call that hangs). The
    handler only sets the event, so no exception unwinds through whatever the main thread
    runs at that moment (Ray's or rich's code): a watch once ignored its Ctrl-C in a test
    run (not reproduced since; the cause not found) while relying on ``KeyboardInterrupt``
    alone. The previous handler is back on exit."""
    import signal
    import threading

    stop = threading.Event()

    def on_sigint(signum, frame) -> None:
        stop.set()
        signal.signal(signal.SIGINT, signal.default_int_handler)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def _connected(call, *args, **kwargs):
    """``call(*args, **kwargs)`` of ``clusters.deploy``, its user errors (no Ray cluster
    at the address, raykv not running or already up) as one-line ``ClickException``."""
    from raykv.clusters.ray_address import RayUnreachableError

    try:
        return call(*args, **kwargs)
    except (RayUnreachableError, ValueError) as e:
        raise click.ClickException(str(e)) from None


@main.command(epilog=_epilog(one=(
    "also when no Ray cluster answers at --address (checked within seconds),",
    "or raykv already runs in the namespace")))
@ADDRESS
@NAMESPACE_OPT
@click.option("--master-address", default=None, help="host:port of an existing Mooncake "
              "master (with --metadata-server); default: run one on the head node.")
@click.option("--metadata-server", default=None, help="Metadata URL of that master.")
@click.option("--master-port", default=0, type=click.IntRange(0, 65535),
              help="RPC port of the master raykv runs on the head node (default: a free "
              "port; fix it for a firewall).")
@click.option("--metadata-port", default=0, type=click.IntRange(0, 65535),
              help="Port of the HTTP metadata server raykv runs beside that master "
              "(default: a free port).")
@click.option("--segment-size", default=_short(DEFAULTS.global_segment_size),
              show_default=True, type=Size(),
              help="Memory each node contributes to the store (K/M/G suffixes).")
@click.option("--protocol", default=DEFAULTS.protocol, show_default=True,
              type=click.Choice(["tcp", "rdma"]),
              help="Mooncake's transport between nodes.")
@click.option("--rdma-devices", default=DEFAULTS.rdma_devices,
              help="--protocol rdma: comma-separated RDMA devices every node's Mooncake "
              "uses, e.g. mlx5_0,mlx5_1 (default: every device Mooncake finds).")
@click.option("--mooncake-host", "--local-hostname", "local_hostname", default=None,
              help="Address Mooncake binds and advertises on every node; the master raykv "
              "runs and its metadata server bind it too, its metrics only 127.0.0.1 "
              "(default: each node's IP, the head's for the master; 127.0.0.1 when all "
              "nodes share one machine).")
@click.option("--local-buffer-size", default=_short(DEFAULTS.local_buffer_size),
              show_default=True, type=Size(),
              help="Each node's Mooncake client transfer buffer.")
@click.option("--mooncake-log-level", default=DEFAULTS.mooncake_log_level, show_default=True,
              type=click.Choice(["INFO", "WARNING", "ERROR"]),
              help="MC_LOG_LEVEL of every node's Mooncake client.")
@click.option("--standalone", is_flag=True, help="Each node's segment lives in a "
              "mooncake_client process its node actor supervises, so it survives a crash "
              "of the actor (default: embedded in the actor).")
@click.option("--host-pool-size", default=None, type=Size(), help="Per node budget for host "
              f"pools (default: no limit; {_short(STANDALONE_POOL_BYTES)} with --standalone, "
              "where it is requested from mooncake_client).")
@click.option("--untenanted-pool-size", default=None, type=Size(), help="Per node: the most "
              "bytes of host pools without a tenant together, which anyone may make "
              "(default: half the node's memory, embedded mode; none beyond "
              "--host-pool-size with --standalone; 0: no bound).")
@click.option("--l2-size", default=_short(DEFAULTS.l2_bytes), show_default=True, type=Size(),
              help="Per node: the most bytes vLLM engines' node-local cache (L2) holds, "
              "counted in --host-pool-size and the tenants' quotas (0: no L2).")
@click.option("--l2-warm-size", default=_short(DEFAULTS.l2_warm_bytes), show_default=True,
              type=Size(), help="Per L2 pool new on a node (a node that joined, a deployment "
              "new there): the most bytes of its deployment's hottest pages read into it "
              "from the store in the background (0: no warm-up).")
@click.option("--l2-warm-seconds", default=DEFAULTS.l2_warm_s, show_default=True,
              type=click.FloatRange(min=0, min_open=True),
              help="The most seconds one such warm-up runs.")
@click.option("--l2-eviction", default=DEFAULTS.l2_eviction, show_default=True,
              type=click.Choice(L2_EVICTIONS),
              help="Which ready page an L2 pool evicts first: s3fifo (pages not used "
              "since they came in before used ones), lru (the least recently used), slru "
              "(pages used once before pages used again).")
@click.option("--placement", default=DEFAULTS.placement, show_default=True,
              type=click.Choice(PLACEMENTS),
              help="Where each node's puts go: own (the node's own segment while it has "
              "room, then any other; embedded mode) or any (Mooncake's random choice).")
@click.option("--confirm-ttl", default=DEFAULTS.confirm_ttl_s, show_default=True,
              type=click.FloatRange(min=0),
              help="Seconds group queries trust a page the store confirmed present (below "
              "the master's object lease, -default_kv_lease_ttl; 0: always ask the store).")
@click.option("--tenant-quota", "tenant_quotas", multiple=True, type=TenantQuota(),
              help="NAME=SIZE: the host pool bytes tenant NAME's deployments may hold on "
              "each node (repeat per tenant; default: no quota).")
@click.option("--tenant-digest", "tenant_digests", multiple=True, type=TenantDigest(),
              help="NAME=DIGEST: bind tenant NAME to its secret on every node from the start "
              "(DIGEST from `raykv tenant-digest NAME`), so no process can claim the name "
              "first (repeat per tenant; default: bound on first use).")
@click.option("--bound-tenants-only", is_flag=True, help="Serve only the tenants bound "
              "with --tenant-digest: nodes and the controller bind no tenant on first use, "
              "so nobody can fill their tenant tables.")
@click.option("--keep-nodes", "keep_nodes", multiple=True, metavar="NODE_ID|all",
              help="A node that always has a node actor, like the head node (repeat per "
              "node; 'all': every node, a fixed cluster). Default: only nodes where "
              "engines run, so the autoscaler can remove idle nodes.")
@click.option("--retire-idle", default=RETIRE_IDLE_S, show_default=True,
              type=click.FloatRange(min=0),
              help="Seconds a node actor stays on a node without engines before it drains "
              "its cache and stops (0: never).")
@click.option("--drain-timeout", default=DRAIN_TIMEOUT_S, show_default=True, type=SECONDS,
              help="Seconds a retiring node actor (or `raykv drain`) moves its cache for; "
              "a node Ray drains has Ray's deadline instead.")
@click.option("--no-drain", is_flag=True, help="A leaving node actor stops at once: its "
              "node's cache is lost (default: moved to other nodes first).")
@click.option("--disk-dir", default=DEFAULTS.disk_dir, metavar="DIR",
              help="A disk tier on every node: the directory (the same path on each node, "
              "one slot per node actor under it) that objects evicted from memory go to, "
              "found again after a restart on the same directory; with --disk-size "
              "(default: no disk tier).")
@click.option("--disk-size", default=None, type=Size(),
              help="Per node: the most bytes its disk tier holds (K/M/G/T suffixes).")
@click.option("--emulate-hosts", default=0, type=click.IntRange(0, 32),
              help="Instead of joining a Ray cluster: start one of N emulated hosts on this "
              "machine (root only: a network namespace and address per host, a Ray node "
              "in each) and run in the foreground until Ctrl-C or SIGTERM, then remove it "
              "all (after a kill: `raykv clean-hosts`).")
@click.option("--link", default=None, help="--emulate-hosts: each host's link rate, as tc "
              "writes it (100mbit, 10gbit; default: not shaped).")
def up(address: str, namespace: str, master_address: str | None, metadata_server: str | None,
       master_port: int, metadata_port: int, segment_size: int, protocol: str,
       rdma_devices: str, local_hostname: str | None, local_buffer_size: int,
       mooncake_log_level: str, standalone: bool, host_pool_size: int | None,
       untenanted_pool_size: int | None, l2_size: int, l2_warm_size: int,
       l2_warm_seconds: float, l2_eviction: str, placement: str, confirm_ttl: float,
       tenant_quotas: tuple[tuple[str, int], ...],
       tenant_digests: tuple[tuple[str, str], ...], bound_tenants_only: bool,
       keep_nodes: tuple[str, ...], retire_idle: float, drain_timeout: float,
       no_drain: bool, disk_dir: str, disk_size: int | None, emulate_hosts: int,
       link: str | None) -> None:
    """Start raykv on a running Ray cluster (master, controller, and a node actor on the
    head node and wherever engines run)."""
    from raykv.clusters import deploy

    if link is not None and not emulate_hosts:
        raise click.UsageError("--link shapes emulated hosts: give --emulate-hosts")
    if emulate_hosts:
        given = [name for name, value in (
            ("--address", address != "auto"), ("--master-address", master_address),
            ("--metadata-server", metadata_server), ("--master-port", master_port),
            ("--metadata-port", metadata_port), ("--mooncake-host", local_hostname))
            if value]
        if given:
            raise click.UsageError("--emulate-hosts starts its own Ray, master and "
                                   f"addresses: no {', '.join(given)}")
    if rdma_devices and protocol != "rdma":
        raise click.UsageError("--rdma-devices needs --protocol rdma")
    if master_address and (master_port or metadata_port):
        raise click.UsageError("--master-port and --metadata-port are for the master raykv "
                               "runs; --master-address names one that runs already")
    quotas, digests = dict(tenant_quotas), dict(tenant_digests)
    if len(quotas) != len(tenant_quotas):
        raise click.BadParameter("a tenant is named twice", param_hint="'--tenant-quota'")
    if len(digests) != len(tenant_digests):
        raise click.BadParameter("a tenant is named twice", param_hint="'--tenant-digest'")
    try:
        settings = NodeSettings(
            global_segment_size=segment_size, local_buffer_size=local_buffer_size,
            protocol=protocol, rdma_devices=rdma_devices, local_hostname=local_hostname,
            mooncake_log_level=mooncake_log_level, standalone=standalone,
            host_pool_bytes=pool_budget(host_pool_size, standalone),
            untenanted_pool_bytes=untenanted_pool_size, confirm_ttl_s=confirm_ttl,
            tenant_quotas=quotas, tenant_digests=digests,
            bound_tenants_only=bound_tenants_only, l2_bytes=l2_size,
            l2_warm_bytes=l2_warm_size, l2_warm_s=l2_warm_seconds, l2_eviction=l2_eviction,
            placement=placement, disk_dir=disk_dir, disk_bytes=disk_size or 0)
        lifecycle = LifecycleSettings(keep_nodes=keep_nodes, retire_idle_s=retire_idle,
                                      drain=not no_drain, drain_timeout_s=drain_timeout)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if emulate_hosts:
        _emulated(emulate_hosts, link, namespace=namespace, global_segment_size=segment_size,
                  local_buffer_size=local_buffer_size, protocol=protocol,
                  rdma_devices=rdma_devices, mooncake_log_level=mooncake_log_level,
                  standalone=standalone, host_pool_bytes=host_pool_size,
                  untenanted_pool_bytes=untenanted_pool_size,
                  confirm_ttl_s=confirm_ttl, tenant_quotas=quotas, tenant_digests=digests,
                  bound_tenants_only=bound_tenants_only, l2_bytes=l2_size,
                  l2_warm_bytes=l2_warm_size, l2_warm_s=l2_warm_seconds,
                  l2_eviction=l2_eviction, placement=placement,
                  disk_dir=disk_dir, disk_bytes=disk_size or 0,
                  lifecycle=lifecycle if _given("keep_nodes", "retire_idle", "drain_timeout",
                                                "no_drain") else None)
        return
    with _spinner("starting raykv: master, controller, node actors ..."):
        info = _connected(deploy.up, address, settings, namespace=namespace,
                          master_address=master_address, metadata_server=metadata_server,
                          master_ports=(master_port, metadata_port), lifecycle=lifecycle)
    click.echo(f"raykv is up in namespace {namespace!r} ({info['mode']} mode): master "
               f"{info['master_address']}, metadata {info['metadata_server']}, "
               f"{len(info['node_ids'])} node actor(s)")


@main.command(epilog=_epilog(zero="done; --watch: stopped with Ctrl-C (or after --count)",
                             one=(
    "also when no Ray cluster answers at --address (checked within seconds),",
    "or raykv does not run in the namespace (--watch: stops running)")))
@ADDRESS
@NAMESPACE_OPT
@click.option("--json", "as_json", is_flag=True, help="Print the raw status as JSON.")
@click.option("--watch", is_flag=True, help="Live view, per node: L3 hits, misses and "
              "their rates, bytes per second put and got since the last refresh, pool use. "
              "Redrawn in place on a terminal; piped, one block of lines per refresh.")
@click.option("--interval", default=None, type=SECONDS,
              help="--watch: seconds between refreshes.  [default: 1]")
@click.option("--count", default=None, type=POSITIVE,
              help="--watch: stop after this many refreshes (default: at Ctrl-C).")
def status(address: str, namespace: str, as_json: bool, watch: bool, interval: float | None,
           count: int | None) -> None:
    """Per node: pools, bytes, pages, objects moved and hit rates per pool. A table where
    it fits the terminal; narrower (and when piped), the same figures as lines. With
    --watch, a live view of rates until Ctrl-C."""
    import json

    from raykv.clusters import deploy

    if not watch and (interval is not None or count is not None):
        raise click.UsageError("--interval and --count need --watch")
    if watch and as_json:
        raise click.UsageError("--watch and --json exclude each other (for a log of "
                               "frames, pipe --watch: it prints lines)")
    if watch:
        from raykv.clusters.status_watch import watch as watch_status
        from rich.console import Console

        with _spinner("connecting to the Ray cluster ..."):
            _connected(deploy.connect, address, namespace)
        with _until_ctrl_c() as stop, contextlib.suppress(KeyboardInterrupt):
            _connected(watch_status, lambda: deploy.status(address, namespace),
                       1.0 if interval is None else interval, Console(), count, stop)
        return
    from raykv.clusters.status_view import render_status

    with _spinner("asking the controller and every node actor ..."):
        state = _connected(deploy.status, address, namespace)
    if as_json:  # the nodes' records as the dicts they are in JSON
        from raykv.controllers.node_records import as_dict

        nodes = {node: as_dict(s) for node, s in state["nodes"].items()}
        click.echo(json.dumps(state | {"nodes": nodes}, indent=2, default=str))
    else:
        render_status(state)


@main.command(epilog=_epilog(zero="drained: its node actor stopped", one=(
    "also when no Ray cluster answers at --address (checked within seconds),",
    "raykv does not run in the namespace, or the node has no node actor")))
@ADDRESS
@NAMESPACE_OPT
@click.argument("node_id")
def drain(address: str, namespace: str, node_id: str) -> None:
    """Before taking NODE_ID away: its node actor writes its L2's unsaved pages to L3,
    moves the objects only its segment holds to other nodes (hottest first, for the
    seconds `raykv up --drain-timeout` gave) and stops; none starts there again while the
    node lives. Prints what moved and what was left."""
    import json

    from raykv.clusters import deploy

    with _spinner(f"draining node {node_id[:12]} ..."):
        report = _connected(deploy.drain, address, node_id, namespace)
    click.echo(json.dumps(report, indent=2, default=str))
    if "error" in report:
        raise click.ClickException(f"node {node_id[:12]}: {report['error']}")


@main.command(epilog=_epilog(zero="reported", one=(
    "also when no Ray cluster answers at --address (checked within seconds), raykv",
    "does not run in the namespace, the deployment is not registered (the registered",
    "ones are listed) or a tenant's secret is missing")))
@ADDRESS
@NAMESPACE_OPT
@click.option("--deployment", default=None, help="Its id, key prefix or model name "
              "(default: the only one registered; else they are listed).")
@click.option("--tokens", default=None, help="The prompt's token ids, comma-separated.")
@click.option("--tokens-file", default=None, type=click.Path(exists=True, dir_okay=False),
              help="A file of the prompt's token ids (commas or whitespace between).")
@click.option("--text", default=None, help="The prompt as text (needs --tokenizer).")
@click.option("--tokenizer", default=None, help="Hugging Face tokenizer (name or path) "
              "that turns --text into token ids (transformers' AutoTokenizer).")
@click.option("--hashes", default=None, type=click.Choice(["vllm", "example"]),
              help="Page-hash scheme (default: the deployment's engine's: vllm for a "
              "vLLM KV pool, else the example engine's).")
@click.option("--prefill-tokens-per-s", default=None, type=SECONDS,
              help="The engine's prefill rate: report whether the load guard would "
              "skip the held blocks now.")
@click.option("--load-guard", "guard", default="auto", show_default=True,
              help="The guard's setting to apply: auto, off or a threshold in tokens.")
@click.option("--node", default=None, help="The engine's node (id or its head) for the "
              "guard (default: the deployment's lookup home).")
@click.option("--timeout", "deadline_s", default=10.0, show_default=True, type=SECONDS,
              help="Seconds every call to the cluster may take.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def why(address: str, namespace: str, deployment: str | None, tokens: str | None,
        tokens_file: str | None, text: str | None, tokenizer: str | None,
        hashes: str | None, prefill_tokens_per_s: float | None, guard: str,
        node: str | None, deadline_s: float, as_json: bool) -> None:
    """For a prompt, which tier holds each of its blocks (node L2 on which node, L3
    memory on which segment, L3 disk) and, for each block not served, why: never
    saved, evicted from L2 or L3, held under another identity (the fields that
    differ), skipped by the load guard. At most 2048 blocks are looked at."""
    import json

    from raykv.clusters import deploy
    from raykv.clusters.why import render
    from raykv.clusters.why import why as explain

    ids = _prompt_ids(tokens, tokens_file, text, tokenizer)
    with _spinner("asking the controller and every node actor ..."):
        _connected(deploy.connect, address, namespace)
        report = _connected(explain, ids, deployment, namespace=namespace, hashes=hashes,
                            prefill_tokens_per_s=prefill_tokens_per_s, guard=guard,
                            node=node, deadline_s=deadline_s)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
    else:
        click.echo("\n".join(render(report)))


def _prompt_ids(tokens: str | None, tokens_file: str | None, text: str | None,
                tokenizer: str | None) -> list[int]:
    """The prompt's token ids from exactly one of the inputs; ``UsageError`` else."""
    if sum(x is not None for x in (tokens, tokens_file, text)) != 1:
        raise click.UsageError("give exactly one of --tokens, --tokens-file, --text")
    if text is not None:
        if not tokenizer:
            raise click.UsageError("--text needs --tokenizer")
        from transformers import AutoTokenizer

        return list(AutoTokenizer.from_pretrained(tokenizer).encode(text))
    raw = tokens if tokens is not None else pathlib.Path(tokens_file).read_text()
    try:
        return [int(t) for t in raw.replace(",", " ").split()]
    except ValueError:
        raise click.UsageError("token ids are integers separated by commas or "
                               "whitespace") from None


@main.command(epilog=_epilog(zero="raykv stopped", one=(
    "also when no Ray cluster answers at --address (checked within seconds),",
    "or nothing of raykv ran in the namespace: nothing to stop (so a",
    "mistyped --namespace shows)")))
@ADDRESS
@NAMESPACE_OPT
def down(address: str, namespace: str) -> None:
    """Stop raykv on the cluster: reconciler, node actors (pools removed), controller,
    master."""
    from raykv.clusters import deploy

    with _spinner("stopping raykv ..."):
        stopped = _connected(deploy.down, address, namespace)
    if not stopped:
        raise click.ClickException(f"nothing to stop: raykv is not running in namespace "
                                   f"{namespace!r}")
    actors = len([name for name in stopped if name != "checkpoint"])
    click.echo(f"raykv is down in namespace {namespace!r}: stopped {actors} actor(s)")


def _given(*names: str) -> bool:
    """Whether the command line gave any of the options ``names`` (not their defaults)."""
    ctx = click.get_current_context()
    return any(ctx.get_parameter_source(n) is not ParameterSource.DEFAULT for n in names)


def _emulated(hosts: int, link: str | None, **options) -> None:
    """``raykv up --emulate-hosts``: the cluster in the foreground until a signal (a node
    actor on every host, as ``start_local``'s, unless a lifecycle option says more)."""
    import signal
    import threading

    from raykv.clusters.local import start_local

    try:  # Ctrl-C while it starts: start_local removes what it made
        with _spinner(f"starting {hosts} emulated hosts ..."):
            cluster = start_local(hosts=hosts, link=link, log_to_driver=False, **options)
    except (PermissionError, FileNotFoundError, ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets its own
        signal.signal(sig, lambda *_: stop.set())
    with cluster:
        net = cluster.hosts
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


@main.command("clean-hosts", epilog=_epilog(zero="cleaned (or nothing to clean)", one=(
    "also without root",)))
@click.option("--force", is_flag=True, help="Also remove emulated clusters whose driver "
              "still runs.")
def clean_hosts(force: bool) -> None:
    """Remove what emulated hosts left behind after their driver was killed: processes,
    network namespaces, links, bridges, shared memory, their folder."""
    from raykv.clusters.hosts import clean

    try:
        removed = clean(force=force)
    except (PermissionError, FileNotFoundError) as e:
        raise click.ClickException(str(e)) from None
    for line in removed:
        click.echo(f"removed {line}")
    click.echo(f"clean: {len(removed)} thing(s) removed")


@main.command("tenant-digest", epilog=_epilog(
    zero="printed NAME=DIGEST", one=("also when $RAYKV_TENANT_SECRET is missing or short",)))
@click.argument("tenant")
def tenant_digest(tenant: str) -> None:
    """Print TENANT=DIGEST for `raykv up --tenant-digest`: the public owner key of
    TENANT's secret in $RAYKV_TENANT_SECRET (run it where the secret is; the digest
    reveals nothing of the secret)."""
    from raykv.controllers.ownership import tenant_digest as digest_of

    try:
        click.echo(f"{tenant}={digest_of(tenant)}")
    except ValueError as e:
        raise click.ClickException(str(e)) from None


BENCH_EPILOG = _epilog(
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
    from raykv.clusters.bench.verdict import check_message, missed_targets

    missed = missed_targets(r["targets"] for r in results)
    if missed:
        raise click.ClickException(check_message(missed))


@main.command(epilog=BENCH_EPILOG)
@click.option("--engine", default="raykv", show_default=True,
              type=click.Choice(["raykv", "sglang"]),
              help="raykv: the data plane vs raw Mooncake and memcpy (bench_dataplane.*). "
                   "sglang: SGLang's write_storage / prefetch through RayKVStore vs SGLang's "
                   "built-in MooncakeStore (bench_sglang.*), run in SGLang's venv.")
@click.option("--page-sizes", default=None,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help=f"Comma-separated page sizes (K/M suffixes), multiples of "
                   f"{_short(BENCH_PAGE_QUANTUM)}; sglang: of {_short(SGLANG_PAGE_QUANTUM)} "
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
            f"--engine sglang needs multiples of {_short(SGLANG_PAGE_QUANTUM)} (K + V of one "
            f"layer of a 64-token page of 2 x 128 bf16)", param_hint="'--page-sizes'")
    if engine != "sglang" and (sglang_python or standalone):
        raise click.UsageError("--sglang-python and --standalone need --engine sglang")
    _require_figures("bench")
    _progress(f"raykv bench: starting a 2-node embedded cluster, then {iters} timed "
              f"iteration(s) of {batch}-page batches per page size ...")
    if engine == "sglang":
        from raykv.clusters.bench.sglang import DEFAULT_PAGE_SIZES, run_sglang_bench

        try:
            results = [run_sglang_bench(page_sizes=sizes or DEFAULT_PAGE_SIZES, batch=batch,
                                        iters=iters, out_dir=out_dir, python=sglang_python,
                                        standalone=standalone)]
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    else:
        from raykv.clusters.bench.dataplane import DEFAULT_PAGE_SIZES, run_dataplane_bench

        try:  # its checks run before anything starts (e.g. batch x page size too big)
            results = [run_dataplane_bench(page_sizes=sizes or DEFAULT_PAGE_SIZES,
                                           batch=batch, iters=iters, out_dir=out_dir)]
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    if with_ranks:
        _progress("raykv bench: bench-ranks with its defaults ...")
        from raykv.clusters.bench.ranks import run_ranks_bench

        results.append(run_ranks_bench(out_dir=out_dir))
    _check(results, check)


@main.command("bench-ranks", epilog=BENCH_EPILOG)
@click.option("--page-sizes", default="64K,256K,1M", show_default=True,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help=f"Comma-separated page sizes (K/M suffixes, multiples of "
                   f"{_short(BENCH_PAGE_QUANTUM)}).")
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
    _require_figures("bench")
    timed = len(page_sizes) * len(ranks) * rounds * 2 * seconds
    _progress(f"raykv bench-ranks: starting a 2-node embedded cluster, then "
              f"{len(page_sizes) * len(ranks)} case(s), {timed:.0f} s of timed phases ...")
    from raykv.clusters.bench.ranks import run_ranks_bench

    try:
        result = run_ranks_bench(page_sizes=list(page_sizes), ranks=list(ranks), batch=batch,
                                 seconds=seconds, rounds=rounds, out_dir=out_dir)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _check([result], check)


@main.command("bench-hosts", epilog=_epilog(one=("also without root",)))
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
    from raykv.clusters.bench import host_locality, hosts
    from raykv.clusters.host_plan import parse_rate

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
    _progress(f"raykv bench-hosts: starting 2 emulated hosts, then {len(rates)} link "
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


@main.command("bench-guard-links", epilog=_epilog(one=("also without root or vLLM",)))
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

    from raykv.clusters.bench.guard_summary import check_lengths, check_links

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
        from raykv.clusters.install_hints import vllm_install_hint

        raise click.ClickException(f"bench-guard-links needs vLLM: {vllm_install_hint()}")
    _progress(f"raykv bench-guard-links: starting 2 emulated hosts and 3 vLLM engines, "
              f"then {len(rates)} link rate(s) x {len(lengths)} length(s) x {repeats} "
              f"repeat(s) ...")
    from raykv.clusters.bench.guard_links import run_guard_links_bench

    try:
        run_guard_links_bench(links=rates, lengths=lengths, repeats=repeats, settle=settle,
                              out_dir=out_dir)
    except (PermissionError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@main.command("bench-scale-down", epilog=_epilog(one=("also without root",)))
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
    from raykv.clusters.bench.scale_down import MODES, run_scale_down_bench
    from raykv.clusters.host_plan import parse_rate

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
    _progress(f"raykv bench-scale-down: {len(rates) * len(kinds)} cluster(s) of 3 "
              f"emulated hosts, one per link rate and drain mode ...")
    try:
        run_scale_down_bench(links=rates, modes=kinds, requests=requests, out_dir=out_dir,
                             command=" ".join(["raykv", *sys.argv[1:]]))
    except (PermissionError, FileNotFoundError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@main.command("bench-gpu", epilog=_epilog(
    zero="done: every page came back byte-exact (the tables and bench_gpu.json give the "
         "figures; this bench has no targets to check)",
    one=("also without a CUDA GPU, or when a page came back with other bytes",)))
@click.option("--page-sizes", default="256K,1M,4M", show_default=True,
              type=SizeList(BENCH_PAGE_QUANTUM, "64 tokens x 512 bytes per layer"),
              help=f"Comma-separated page sizes (K/M suffixes, multiples of "
                   f"{_short(BENCH_PAGE_QUANTUM)}).")
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
    _progress(f"raykv bench-gpu: starting a 2-node embedded cluster, then {iters} timed "
              f"iterations per page size ...")
    from raykv.clusters.bench.gpu import run_gpu_bench

    try:
        run_gpu_bench(page_sizes=list(page_sizes), batch=batch, iters=iters, out_dir=out_dir)
    except (ValueError, RuntimeError) as e:
        raise click.ClickException(str(e)) from None


@main.command("bench-group", epilog=BENCH_EPILOG)
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
    _progress(f"raykv bench-group: starting a 1-node embedded cluster, then per TP size "
              f"({', '.join(map(str, tp_sizes))}): latency runs and 4 throughput runs of "
              f"{seconds:g} s ...")
    from raykv.clusters.bench.group import run_group_bench

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

    from raykv.clusters.sim.compare import Setup
    from raykv.clusters.sim.costs import Costs
    from raykv.clusters.sim.trace import read_trace, shifted_copies

    changes = {k: v for k, v in (("prefill_tokens_per_s", prefill_tokens_per_s),
                                 ("link_gbit", link_gbit)) if v is not None}
    requests = read_trace(trace, limit)
    requests = shifted_copies(requests, copies) if copies > 1 else requests
    setup = Setup(nodes, engines_per_node, gpu_tokens, l2_tokens, l3_tokens, placement, seed,
                  l2_eviction=l2_eviction)
    return requests, setup, dataclasses.replace(Costs(), **changes)


SIM_EPILOG = _epilog(zero="done: the comparison printed (and written with --out)",
                     one=("also when the trace cannot be read or a line of it is not a "
                          "request (the line is named)",))


@main.command(epilog=SIM_EPILOG)
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

    from raykv.clusters.sim.compare import RUNS, compare
    from raykv.clusters.sim.scaling import Scaling
    from raykv.controllers.load_guard import GuardSettings

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


@main.command("sim-sweep", epilog=_epilog(
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

    _require_figures("bench")
    from raykv.clusters.sim.sweep import sweep
    from raykv.clusters.sim.sweep_figure import draw

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


TRACE_EPILOG = _epilog(zero="the trace written to --out")


@main.group("sim-trace", epilog=_epilog(zero="the trace written where its kind's command says"))
def sim_trace() -> None:
    """Write a seeded synthetic trace in Mooncake's JSONL format, for `raykv sim`."""


def _write_trace(requests: list, out_file: str) -> None:
    from raykv.clusters.sim.workloads import to_jsonl

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
    from raykv.clusters.sim.workloads import multi_round_qa as make

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
    from raykv.clusters.sim.workloads import shared_prefix as make

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


if __name__ == "__main__":
    main()
