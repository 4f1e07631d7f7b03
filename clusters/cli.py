"""The ``raykv`` command line.

User errors end in one line on stderr and a non-zero exit, never a traceback: a bad
option value is click's usage error (exit 2), anything else a ``click.ClickException``
(exit 1), e.g. when no Ray cluster answers at ``--address`` (found out in seconds, see
``clusters.ray_address``). Each command's help lists its exit codes.

These are the operator's commands. Other installed packages add theirs through the entry
point group ``raykv.commands`` (each entry a sequence of click commands): raykv's lab
(``raykv_lab.cli``: ``demo``, ``bench*``, ``sim*``, ``emulate-hosts``, ``clean-hosts``).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Iterator

import click
from raykv.clusters.node_lifecycle import DRAIN_TIMEOUT_S, RETIRE_IDLE_S, LifecycleSettings
from raykv.controllers.node_settings import (
    DEFAULTS,
    L2_EVICTIONS,
    PLACEMENTS,
    STANDALONE_POOL_BYTES,
    NodeSettings,
    pool_budget,
)


def epilog(zero: str = "done", one: tuple[str, ...] = ()) -> str:
    """A command's exit codes as its help's last lines, kept as written (``\b``):
    ``zero`` says when it exits 0, ``one`` the lines of what else than a failure exits
    1."""
    lines = ["\b", "Exit codes:", f"  0  {zero}",
             "  1  failed (the message says why)" + (";" if one else ""),
             *(f"     {line}" for line in one), "  2  bad usage or option value"]
    return "\n".join(lines)


COMMAND_GROUP = "raykv.commands"
"""The entry point group of the commands other packages add to ``raykv``."""


class RaykvGroup(click.Group):
    """raykv's commands and those of ``COMMAND_GROUP``'s entry points, loaded the first
    time click lists or looks up a command. A name of raykv's own is never replaced."""

    def _add_installed(self) -> None:
        if getattr(self, "_installed", False):
            return
        self._installed = True
        from importlib.metadata import entry_points

        for point in entry_points(group=COMMAND_GROUP):
            for command in point.load():
                self.commands.setdefault(command.name, command)

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._add_installed()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._add_installed()
        return super().get_command(ctx, cmd_name)


@click.group(cls=RaykvGroup, epilog=epilog())
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


def short_size(n: int) -> str:
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
                          f"{short_size(self.quantum)} ({self.what})", param, ctx)
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


def progress(line: str) -> None:
    """A line on stderr before a command's long phase (stdout keeps its results)."""
    click.echo(line, err=True)


@contextlib.contextmanager
def spinner(text: str) -> Iterator[None]:
    """A spinner on stderr while a cluster command waits (on a terminal only: nothing is
    written when stderr is a pipe or a file)."""
    from rich.console import Console

    with Console(stderr=True).status(text):
        yield


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


NODE_OPTIONS = (
    click.option("--segment-size", default=short_size(DEFAULTS.global_segment_size),
                  show_default=True, type=Size(),
                  help="Memory each node contributes to the store (K/M/G suffixes)."),
    click.option("--protocol", default=DEFAULTS.protocol, show_default=True,
                  type=click.Choice(["tcp", "rdma"]),
                  help="Mooncake's transport between nodes."),
    click.option("--rdma-devices", default=DEFAULTS.rdma_devices,
                  help="--protocol rdma: comma-separated RDMA devices every node's Mooncake "
                  "uses, e.g. mlx5_0,mlx5_1 (default: every device Mooncake finds)."),
    click.option("--local-buffer-size", default=short_size(DEFAULTS.local_buffer_size),
                  show_default=True, type=Size(),
                  help="Each node's Mooncake client transfer buffer."),
    click.option("--mooncake-log-level", default=DEFAULTS.mooncake_log_level, show_default=True,
                  type=click.Choice(["INFO", "WARNING", "ERROR"]),
                  help="MC_LOG_LEVEL of every node's Mooncake client."),
    click.option("--standalone", is_flag=True, help="Each node's segment lives in a "
                  "mooncake_client process its node actor supervises, so it survives a crash "
                  "of the actor (default: embedded in the actor)."),
    click.option("--host-pool-size", default=None, type=Size(), help="Per node budget for host "
                  "pools (default: no limit; "
                  f"{short_size(STANDALONE_POOL_BYTES)} with --standalone, "
                  "where it is requested from mooncake_client)."),
    click.option("--untenanted-pool-size", default=None, type=Size(), help="Per node: the most "
                  "bytes of host pools without a tenant together, which anyone may make "
                  "(default: half the node's memory, embedded mode; none beyond "
                  "--host-pool-size with --standalone; 0: no bound)."),
    click.option("--l2-size", default=short_size(DEFAULTS.l2_bytes), show_default=True, type=Size(),
                  help="Per node: the most bytes vLLM engines' node-local cache (L2 pools) holds, "
                  "counted in --host-pool-size and the tenants' quotas (0: no L2)."),
    click.option("--l2-warm-size", default=short_size(DEFAULTS.l2_warm_bytes), show_default=True,
                  type=Size(), help="Per L2 pool new on a node (a node that joined, a deployment "
                  "new there): the most bytes of its deployment's hottest pages read into it "
                  "from the store in the background (0: no warm-up)."),
    click.option("--l2-warm-seconds", default=DEFAULTS.l2_warm_s, show_default=True,
                  type=click.FloatRange(min=0, min_open=True),
                  help="The most seconds one such warm-up runs."),
    click.option("--l2-eviction", default=DEFAULTS.l2_eviction, show_default=True,
                  type=click.Choice(L2_EVICTIONS),
                  help="Which ready page an L2 pool evicts first: s3fifo (pages not used "
                  "since they came in before used ones), lru (the least recently used), slru "
                  "(pages used once before pages used again)."),
    click.option("--placement", default=DEFAULTS.placement, show_default=True,
                  type=click.Choice(PLACEMENTS),
                  help="Where each node's puts go: own (the node's own segment while it has "
                  "room, then any other; embedded mode) or any (Mooncake's random choice)."),
    click.option("--confirm-ttl", default=DEFAULTS.confirm_ttl_s, show_default=True,
                  type=click.FloatRange(min=0),
                  help="Seconds group queries trust a page the store confirmed present (below "
                  "the master's object lease, -default_kv_lease_ttl; 0: always ask the store)."),
    click.option("--tenant-quota", "tenant_quotas", multiple=True, type=TenantQuota(),
                  help="NAME=SIZE: the host pool bytes tenant NAME's deployments may hold on "
                  "each node (repeat per tenant; default: no quota)."),
    click.option("--tenant-digest", "tenant_digests", multiple=True, type=TenantDigest(),
                  help="NAME=DIGEST: bind tenant NAME to its secret on every node from the start "
                  "(DIGEST from `raykv tenant-digest NAME`), so no process can claim the name "
                  "first (repeat per tenant; default: bound on first use)."),
    click.option("--bound-tenants-only", is_flag=True, help="Serve only the tenants bound "
                  "with --tenant-digest: nodes and the controller bind no tenant on first use, "
                  "so nobody can fill their tenant tables."),
    click.option("--keep-nodes", "keep_nodes", multiple=True, metavar="NODE_ID|all",
                  help="A node that always has a node actor, like the head node (repeat per "
                  "node; 'all': every node, a fixed cluster). Default: only nodes where "
                  "engines run, so the autoscaler can remove idle nodes."),
    click.option("--retire-idle", default=RETIRE_IDLE_S, show_default=True,
                  type=click.FloatRange(min=0),
                  help="Seconds a node actor stays on a node without engines before it drains "
                  "its cache and stops (0: never)."),
    click.option("--drain-timeout", default=DRAIN_TIMEOUT_S, show_default=True, type=SECONDS,
                  help="Seconds a retiring node actor (or `raykv drain`) moves its cache for; "
                  "a node Ray drains has Ray's deadline instead."),
    click.option("--no-drain", is_flag=True, help="A leaving node actor stops at once: its "
                  "node's cache is lost (default: moved to other nodes first)."),
    click.option("--disk-dir", default=DEFAULTS.disk_dir, metavar="DIR",
                  help="A disk tier on every node: the directory (the same path on each node, "
                  "one slot per node actor under it) that objects evicted from memory go to, "
                  "found again after a restart on the same directory; with --disk-size "
                  "(default: no disk tier)."),
    click.option("--disk-size", default=None, type=Size(),
                  help="Per node: the most bytes its disk tier holds (K/M/G/T suffixes)."),
)
"""Every node setting and lifecycle option of ``up`` (``node_settings_of`` reads them),
also the options of the lab's commands that start a cluster of their own."""


def node_options(command):
    """``command`` with ``NODE_OPTIONS``, in their order in its help."""
    for option in reversed(NODE_OPTIONS):
        command = option(command)
    return command


def node_settings_of(options: dict) -> tuple[NodeSettings, LifecycleSettings]:
    """The ``NodeSettings`` and ``LifecycleSettings`` of ``NODE_OPTIONS``' values (and
    ``local_hostname``, if given); ``click.UsageError`` for values they refuse."""
    o = options
    if o["rdma_devices"] and o["protocol"] != "rdma":
        raise click.UsageError("--rdma-devices needs --protocol rdma")
    quotas, digests = dict(o["tenant_quotas"]), dict(o["tenant_digests"])
    if len(quotas) != len(o["tenant_quotas"]):
        raise click.BadParameter("a tenant is named twice", param_hint="'--tenant-quota'")
    if len(digests) != len(o["tenant_digests"]):
        raise click.BadParameter("a tenant is named twice", param_hint="'--tenant-digest'")
    try:
        settings = NodeSettings(
            global_segment_size=o["segment_size"], local_buffer_size=o["local_buffer_size"],
            protocol=o["protocol"], rdma_devices=o["rdma_devices"],
            local_hostname=o.get("local_hostname"),
            mooncake_log_level=o["mooncake_log_level"], standalone=o["standalone"],
            host_pool_bytes=pool_budget(o["host_pool_size"], o["standalone"]),
            untenanted_pool_bytes=o["untenanted_pool_size"], confirm_ttl_s=o["confirm_ttl"],
            tenant_quotas=quotas, tenant_digests=digests,
            bound_tenants_only=o["bound_tenants_only"], l2_bytes=o["l2_size"],
            l2_warm_bytes=o["l2_warm_size"], l2_warm_s=o["l2_warm_seconds"],
            l2_eviction=o["l2_eviction"], placement=o["placement"], disk_dir=o["disk_dir"],
            disk_bytes=o["disk_size"] or 0)
        lifecycle = LifecycleSettings(keep_nodes=o["keep_nodes"],
                                      retire_idle_s=o["retire_idle"],
                                      drain=not o["no_drain"],
                                      drain_timeout_s=o["drain_timeout"])
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    return settings, lifecycle


@main.command(epilog=epilog(one=(
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
@click.option("--mooncake-host", "--local-hostname", "local_hostname", default=None,
              help="Address Mooncake binds and advertises on every node; the master raykv "
              "runs and its metadata server bind it too, its metrics only 127.0.0.1 "
              "(default: each node's IP, the head's for the master; 127.0.0.1 when all "
              "nodes share one machine).")
@node_options
def up(address: str, namespace: str, master_address: str | None, metadata_server: str | None,
       master_port: int, metadata_port: int, local_hostname: str | None, **options) -> None:
    """Start raykv on a running Ray cluster (master, controller, and a node actor on the
    head node and wherever engines run)."""
    from raykv.clusters import deploy

    if master_address and (master_port or metadata_port):
        raise click.UsageError("--master-port and --metadata-port are for the master raykv "
                               "runs; --master-address names one that runs already")
    settings, lifecycle = node_settings_of(options | {"local_hostname": local_hostname})
    with spinner("starting raykv: master, controller, node actors ..."):
        info = _connected(deploy.up, address, settings, namespace=namespace,
                          master_address=master_address, metadata_server=metadata_server,
                          master_ports=(master_port, metadata_port), lifecycle=lifecycle)
    click.echo(f"raykv is up in namespace {namespace!r} ({info['mode']} mode): master "
               f"{info['master_address']}, metadata {info['metadata_server']}, "
               f"{len(info['node_ids'])} node actor(s)")


@main.command(epilog=epilog(zero="done; --watch: stopped with Ctrl-C (or after --count)",
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

        with spinner("connecting to the Ray cluster ..."):
            _connected(deploy.connect, address, namespace)
        with _until_ctrl_c() as stop, contextlib.suppress(KeyboardInterrupt):
            _connected(watch_status, lambda: deploy.status(address, namespace),
                       1.0 if interval is None else interval, Console(), count, stop)
        return
    from raykv.clusters.status_view import render_status

    with spinner("asking the controller and every node actor ..."):
        state = _connected(deploy.status, address, namespace)
    if as_json:  # the nodes' records as the dicts they are in JSON
        from raykv.controllers.node_records import as_dict

        nodes = {node: as_dict(s) for node, s in state["nodes"].items()}
        click.echo(json.dumps(state | {"nodes": nodes}, indent=2, default=str))
    else:
        render_status(state)


@main.command(epilog=epilog(zero="drained: its node actor stopped", one=(
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

    with spinner(f"draining node {node_id[:12]} ..."):
        report = _connected(deploy.drain, address, node_id, namespace)
    click.echo(json.dumps(report, indent=2, default=str))
    if "error" in report:
        raise click.ClickException(f"node {node_id[:12]}: {report['error']}")


@main.command(epilog=epilog(zero="reported", one=(
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
    with spinner("asking the controller and every node actor ..."):
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


@main.command(epilog=epilog(zero="raykv stopped", one=(
    "also when no Ray cluster answers at --address (checked within seconds),",
    "or nothing of raykv ran in the namespace: nothing to stop (so a",
    "mistyped --namespace shows)")))
@ADDRESS
@NAMESPACE_OPT
def down(address: str, namespace: str) -> None:
    """Stop raykv on the cluster: reconciler, node actors (pools removed), controller,
    master."""
    from raykv.clusters import deploy

    with spinner("stopping raykv ..."):
        stopped = _connected(deploy.down, address, namespace)
    if not stopped:
        raise click.ClickException(f"nothing to stop: raykv is not running in namespace "
                                   f"{namespace!r}")
    actors = len([name for name in stopped if name != "checkpoint"])
    click.echo(f"raykv is down in namespace {namespace!r}: stopped {actors} actor(s)")


@main.command("tenant-digest", epilog=epilog(
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


if __name__ == "__main__":
    main()
