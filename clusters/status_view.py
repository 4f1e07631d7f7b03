"""Renders ``raykv status`` for a terminal of any width, or a pipe (80 columns): a
status's ``nodes`` map each node id to its ``NodeStats`` (``StatsFailed`` where its stats
failed)."""

from __future__ import annotations

from collections.abc import Iterator

from raykv.controllers.node_records import LinkView, NodeStats, RateView, StatsFailed
from raykv.controllers.pool_layout import MiB
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


def _rate(ok: int, total: int) -> str:
    return f"{100 * ok / total:.0f}%" if total else "-"


COLUMNS = ("node", "store MiB", "pool", "kind", "pool MiB", "pages", "put", "present",
           "put err", "got", "get miss", "get hit rate")


Nodes = dict[str, NodeStats | StatsFailed]
"""A status's ``nodes``: node id -> its stats, or why they failed."""


def _pool_rows(nodes: Nodes) -> Iterator[tuple[str, ...]]:
    """One row of ``COLUMNS`` per node and pool (a node without pools: one row with
    pool ``-``; a node whose stats failed: its error under ``pool``, in red)."""
    for node_id, s in nodes.items():
        if isinstance(s, StatsFailed):
            yield (node_id[:8], "", "[red]" + s.error, *[""] * 9)
            continue
        seg = f"{s.global_segment_size / MiB:.0f}"
        if not s.pools:
            yield (node_id[:8], seg, "-", *[""] * 9)
        for name, p in s.pools.items():
            c = p.counters
            put_err = sum(v for k, v in c.items() if k.startswith("put_error"))
            miss = sum(v for k, v in c.items() if k.startswith("get_error"))
            got = c.get("get_ok", 0)
            yield (node_id[:8], seg, name, p.kind, f"{p.bytes / MiB:.1f}",
                   str(p.pages), str(c.get("put_ok", 0)), str(c.get("put_present", 0)),
                   str(put_err), str(got), str(miss), _rate(got, got + miss))


def _packed(head: str, pairs: list[str], width: int, indent: str = "    ") -> list[str]:
    """``head`` then ``pairs`` joined by ", ", packed into lines of at most ``width``
    characters where possible; a line breaks between pairs only."""
    lines, line = [], head
    for i, pair in enumerate(pairs):
        piece = pair + ("," if i < len(pairs) - 1 else "")
        if line.strip() and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = indent + piece
        else:
            line = f"{line} {piece}" if line.strip() else indent + piece
    return [*lines, line]


def _print_narrow(rows: list[tuple[str, ...]], console: Console) -> None:
    """The table's rows where it does not fit the console (a pipe is 80 columns): per
    node its store, then one line per pool of ``name value`` pairs, wrapped between
    pairs, never inside a value."""
    console.print("[bold]nodes and pools[/]")
    node = None
    for row in rows:
        if row[0] != node:
            node = row[0]
            console.print(f"node {node}" + (f": store {row[1]} MiB" if row[1] else ""))
        if row[2] == "-":
            console.print("  no pools")
        elif not row[3]:  # the node's stats failed: the error
            console.print(f"  {row[2]}")
        else:
            pairs = [f"{name} {value}" for name, value in zip(COLUMNS[4:], row[4:],
                                                               strict=True)]
            for line in _packed(f"  pool {row[2]} ({row[3]}):", pairs, console.width):
                console.print(Text(line), soft_wrap=True)


def _size(n: int) -> str:
    """Bytes as MiB, KiB or B (one decimal), whichever is the largest under ``n``."""
    for unit, scale in (("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def tenant_lines(node_id: str, s: NodeStats | StatsFailed, width: int) -> list[str]:
    """The pool bytes of each tenant on a node against its quota, and of the pools
    without a tenant against their bound (their ``quota``), as lines of at most
    ``width`` characters where possible; none for a node without tenants (or whose
    stats failed)."""
    if isinstance(s, StatsFailed) or not s.tenants:
        return []
    pairs = []
    for tenant, t in sorted(s.tenants.items()):
        quota = f" of {_size(t.quota)} quota" if t.quota is not None else ", no quota"
        pairs.append(f"{tenant} {_size(t.pool_bytes)}{quota} ({t.pools} pools)")
    rest = s.untenanted
    if rest.pools:
        bound = f" of {_size(rest.quota)} bound" if rest.quota is not None else ""
        pairs.append(f"no tenant {_size(rest.pool_bytes)}{bound} ({rest.pools} pools)")
    return _packed(f"node {node_id[:8]} tenants:", pairs, width)


SHOWN_WARMUPS = 3
"""Warm-ups ``raykv status`` shows per node besides those still running: the latest."""


def warmup_lines(node_id: str, s: NodeStats | StatsFailed) -> list[str]:
    """The warm-ups of the L2 pools new on a node (its stats' ``warmup``:
    ``L2Warmup.stats``): each one queued or running and the latest ``SHOWN_WARMUPS``
    done, with the pages and bytes read and why it ended; then the node's totals. None
    for a node without warm-ups (or whose stats failed)."""
    if isinstance(s, StatsFailed) or not s.warmup.warmups:
        return []
    w = s.warmup
    ups = list(w.warmups.values())
    done = [u for u in ups if u.state == "done"][-SHOWN_WARMUPS:]
    lines = []
    for u in [u for u in ups if u.state != "done"] + done:
        state = u.state if u.state != "done" else f"done ({u.stopped})"
        lines.append(f"node {node_id[:8]}: L2 warm-up of {u.deployment} rank "
                     f"{','.join(map(str, u.rank))}: {state}, {u.pages} of "
                     f"{u.chosen} pages read ({_size(u.bytes)})")
    lines.append(f"node {node_id[:8]}: L2 warm-ups read {w.pages} pages "
                 f"({_size(w.bytes)}), {w.running} running; budget "
                 f"{_size(w.warm_bytes)} and {w.warm_s:g} s each")
    return lines


def disk_line(node_id: str, s: NodeStats | StatsFailed) -> str | None:
    """A node's tiers with seals (its stats' ``tiers``: ``MooncakeBackend.tier_stats``):
    its disk slot's use against its bound, the objects gets served from memory and from
    disk, and those refused for a seal that did not verify. None without seals."""
    t = None if isinstance(s, StatsFailed) else s.tiers
    if t is None:
        return None
    served, refused = t.served, sum(t.refused.values())
    disk = (f"disk {_size(t.used_bytes or 0)} of {_size(t.limit_bytes or 0)} in {t.path}; "
            if t.path is not None else "")
    return (f"node {node_id[:8]}: {disk}gets served {served.get('l3_memory', 0)} objects "
            f"from memory, {served.get('l3_disk', 0)} from disk; {refused} refused "
            "(seal not verified, or unreadable)")


def evictions_line(node_id: str, s: NodeStats | StatsFailed) -> str | None:
    """A node's L2 evictions since start and the keys it remembers of them for ``raykv
    why`` (its stats' ``l2_evictions``: ``L2Evictions.stats``); None before any."""
    if isinstance(s, StatsFailed) or not s.l2_evictions.evictions:
        return None
    e = s.l2_evictions
    return (f"node {node_id[:8]}: L2 evicted {e.evictions} objects since start; the "
            f"last {e.kept} remembered (raykv why names them)")


def link_lines(node_id: str, s: NodeStats | StatsFailed, width: int) -> list[str]:
    """A node's load estimates (its stats' ``loads``: ``LoadCosts.view``): per source
    segment the read rate it estimates (MB/s, ``?`` while unknown) and the age of its
    last probe, then disk and the queue's wait; packed into lines of at most ``width``
    characters where possible; none for a node whose stats failed."""
    if isinstance(s, StatsFailed):
        return []
    loads = s.loads

    def rate(v: RateView) -> str:
        return "?" if v.mb_per_s is None else f"{v.mb_per_s:.1f} MB/s"

    def probed(v: LinkView) -> str:
        age = v.probe_age_s
        return "never probed" if age is None else f"probed {age:.0f} s ago"

    pairs = [f"{seg} {rate(v)} ({probed(v)})" for seg, v in loads.links.items()]
    if loads.l3_disk.mb_per_s is not None:
        pairs.append(f"disk {rate(loads.l3_disk)}")
    pairs.append(f"queue wait {loads.queue_wait_s * 1e3:.1f} ms")
    return _packed(f"node {node_id[:8]} load estimates:", pairs, width)


def master_line(master: dict) -> str | None:
    """A warning line while the master supervisor is restarting the master (its
    ``state``), with its failed attempts in a row and the last one's error; None while
    it runs (or for a master raykv does not supervise)."""
    if master.get("state", "running") == "running":
        return None
    line = (f"warning: mooncake_master is down, {master['state']}: "
            f"{master.get('attempts', 0)} failed attempt(s) in a row")
    if master.get("last_error"):
        line += f", last error: {master['last_error']}"
    return line


def drain_progress(lifecycle: dict, node_id: str) -> str:
    """``, moved X MiB (N objects), left N, dropped N, Ts to its deadline`` of a drain
    running on ``node_id`` (its ``drain_status``), or "" if none is known."""
    d = (lifecycle.get("draining") or {}).get(node_id)
    if not d:
        return ""
    return (f", moved {d.get('bytes_moved', 0) / (1 << 20):.1f} MiB "
            f"({d.get('objects_moved', 0)} objects), left {d.get('objects_left', 0)}, "
            f"dropped {d.get('objects_dropped', 0)}, "
            f"{d.get('deadline_in_s', 0):.0f} s to its deadline")


def lifecycle_lines(lifecycle: dict) -> list[str]:
    """One line per node leaving now (retiring without engines, or draining for Ray or
    an operator) and per node whose last leaving has a report: its reason, outcome, and
    what the drain moved, dropped and left."""
    if "error" in lifecycle:
        return [f"node lifecycle: unknown ({lifecycle['error']})"]
    names = {"idle": "retiring (no engines)", "preemption": "draining (Ray drain)",
             "operator": "draining (raykv drain)"}
    lines = [f"node {n[:8]}: {names.get(r, r)}{drain_progress(lifecycle, n)}"
             for n, r in lifecycle.get("leaving", {}).items()]
    for node_id, report in lifecycle.get("reports", {}).items():
        figures = ", ".join(f"{k} {v}" for k, v in report.items() if k not in ("reason",))
        lines.append(f"node {node_id[:8]} left ({report.get('reason')}): {figures}")
    return lines


def render_status(state: dict, console: Console | None = None) -> None:
    """Print the master (a warning line while its supervisor restarts it:
    ``master_line``), each node's warnings (its stats' ``warnings``), the deployments,
    one row per node and pool (a table where it fits the console's width, else the same
    figures as lines: ``_print_narrow``), the pool bytes per tenant and node against
    each tenant's quota, each node's own segment (where its puts go first) and the
    routers' residency queries it answered, its disk tier (``disk_line``), its L2
    evictions (``evictions_line``), its load estimates per link (``link_lines``), and
    the warm-ups of its new L2 pools
    (``warmup_lines``)."""
    console = console or Console()
    info, master = state["info"], state["master"]
    console.print(f"[bold]raykv[/] master {master['master_address']} "
                  f"(restarts: {master.get('restarts', 'not supervised')}), "
                  f"metadata {info['metadata_server']}, {len(state['nodes'])} node(s), "
                  f"{info.get('mode', 'embedded')} mode")
    if (line := master_line(master)) is not None:
        console.print(Text(line, style="yellow"))
    nodes: Nodes = state["nodes"]
    for node_id, s in nodes.items():
        for warning in () if isinstance(s, StatsFailed) else s.warnings:
            console.print(Text(f"warning: node {node_id[:8]}: {warning}", style="yellow"))
    for line in lifecycle_lines(state.get("lifecycle", {})):
        console.print(line)
    for dep_id, dep in state["deployments"].items():
        pools = ", ".join(f"{p['role']}:{p['kind']}" for p in dep["pools"])
        home = (dep.get("home_node") or "-")[:8]
        console.print(f"deployment [bold]{dep_id}[/]: TP {dep['tp_size']} x PP "
                      f"{dep['pp_size']}, {'MLA' if dep['is_mla_model'] else 'MHA'}, pools "
                      f"{pools}, {len(dep['ranks'])} rank(s) registered, group queries on "
                      f"node {home}")
    rows = list(_pool_rows(nodes))
    table = Table(title="nodes and pools")
    for col in COLUMNS:
        table.add_column(col)
    for row in rows:
        table.add_row(*row)
    natural = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    if natural <= console.width:
        console.print(table)
    else:
        _print_narrow(rows, console)
    for node_id, s in nodes.items():
        for line in tenant_lines(node_id, s, console.width):
            console.print(Text(line), soft_wrap=True)
    for node_id, s in nodes.items():
        if isinstance(s, NodeStats):
            console.print(f"node {node_id[:8]}: puts prefer segment "
                          f"{s.own_segment or '(none known: placed at random)'}; "
                          f"{s.residency.queries} residency queries from routers")
    for node_id, s in nodes.items():
        if (line := disk_line(node_id, s)) is not None:
            refused = isinstance(s, NodeStats) and s.tiers is not None and s.tiers.refused
            console.print(Text(line, style="yellow" if refused else ""), soft_wrap=True)
    for node_id, s in nodes.items():
        if (line := evictions_line(node_id, s)) is not None:
            console.print(Text(line), soft_wrap=True)
        for line in link_lines(node_id, s, console.width):
            console.print(Text(line), soft_wrap=True)
    for node_id, s in nodes.items():
        for line in warmup_lines(node_id, s):
            console.print(Text(line), soft_wrap=True)
    for node_id, s in nodes.items():
        if isinstance(s, StatsFailed):
            continue
        g = s.group_queries
        if g.looked_up or g.recent or g.inflight or g.confirmed:
            shared = g.recent + g.inflight
            console.print(f"node {node_id[:8]}: {g.looked_up + g.confirmed + shared} group "
                          f"queries, {shared} shared by ranks of a group, {g.confirmed} "
                          f"answered from confirmed pages, {g.store_calls} store lookups")
