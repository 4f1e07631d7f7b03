"""``raykv status --watch``: ``status_rates`` rows, fetched and shown again every
``interval`` seconds until Ctrl-C (or ``count`` refreshes). On a terminal, a rich
``Live`` table redrawn in place; anywhere else (a pipe, a file) one block of plain lines
per refresh, each block a time stamp line then one line per node, so a log keeps every
frame. While the master supervisor restarts the master, each frame says so under its
header (``status_view.master_line``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from raykv.clusters.status_rates import NodeRow, node_rows
from raykv.clusters.status_view import master_line
from raykv.controllers.pool_layout import MiB
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

COLUMNS = ("node", "L3 hits", "hits/s", "misses", "misses/s", "errors", "hit rate", "put",
           "get", "pools", "pool use")
LEGEND = ("L3 hits: objects read from the store into the node's pools; misses: objects "
          "the store did not hold; put / get: bytes per second out of / into the node's "
          "pools since the last refresh. Pages an engine finds in its own pool (L2 hits) "
          "never reach the node actor and are not counted.")


def _per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def bandwidth(gbps: float | None) -> str:
    """GB/s (1e9 bytes/s) in the largest unit that keeps it >= 1: ``"1.23 GB/s"``,
    ``"45.6 MB/s"``, ``"7.8 kB/s"``, ``"12 B/s"``; ``"-"`` for None."""
    if gbps is None:
        return "-"
    for unit, scale in (("GB/s", 1.0), ("MB/s", 1e-3), ("kB/s", 1e-6)):
        if gbps >= scale:
            return f"{gbps / scale:.{2 if unit == 'GB/s' else 1}f} {unit}"
    return f"{gbps * 1e9:.0f} B/s"


def pool_use(row: NodeRow) -> str:
    """Bytes of the node's live pools against its budget, in MiB."""
    used = f"{row.pool_used / MiB:.1f}"
    return (f"{used} / {row.pool_budget / MiB:.0f} MiB" if row.pool_budget
            else f"{used} MiB, no limit")


def cells(row: NodeRow) -> tuple[str, ...]:
    """``row`` as one string per ``COLUMNS`` entry (a failed node: its error)."""
    if row.error is not None:
        return (row.node, f"error: {row.error}", *[""] * (len(COLUMNS) - 2))
    rate = "-" if row.hit_rate is None else f"{100 * row.hit_rate:.0f}%"
    return (row.node, str(row.l3_hits), _per_s(row.hits_per_s), str(row.misses),
            _per_s(row.misses_per_s), str(row.errors), rate, bandwidth(row.put_gbps),
            bandwidth(row.get_gbps), str(row.pools), pool_use(row))


def header(rows: list[NodeRow], interval: float) -> str:
    return (f"raykv status --watch: {len(rows)} node(s), every {interval:g} s, "
            f"{time.strftime('%H:%M:%S')} (Ctrl-C to stop)")


def frame(rows: list[NodeRow], interval: float, warning: str | None = None) -> Group:
    """The terminal view: the header, ``warning`` (if any), a table of ``rows``, the
    legend."""
    table = Table(*COLUMNS)
    for row in rows:
        table.add_row(*cells(row))
    said = [Text(warning, style="yellow")] if warning else []
    return Group(Text(header(rows, interval)), *said, table, Text(LEGEND, style="dim"))


def lines(rows: list[NodeRow], interval: float, warning: str | None = None) -> list[str]:
    """The plain view: the header, ``warning`` (if any), then per node ``name value``
    pairs."""
    out = [header(rows, interval), *([warning] if warning else [])]
    for row in rows:
        values = cells(row)
        if row.error is not None:
            out.append(f"node {row.node}: {values[1]}")
        else:
            out.append(f"node {row.node}: " + ", ".join(
                f"{name} {value}" for name, value in zip(COLUMNS[1:], values[1:],
                                                         strict=True)))
    return out


def watch(fetch: Callable[[], dict], interval: float, console: Console,
          count: int | None = None, stop: threading.Event | None = None) -> None:
    """Show ``fetch()`` (a status snapshot) as rows every ``interval`` seconds, rates
    over the time between two fetches' returns, ``count`` times (None: until ``stop`` is
    set, or ``KeyboardInterrupt``, which the caller turns into exit 0). ``stop`` set
    (from a signal handler, say) ends the view before its next fetch: within one
    ``interval`` plus the fetch under way. Errors of ``fetch`` propagate. Main thread
    (a terminal's ``Live`` view is redrawn from the calling thread only)."""
    live = Live(console=console, auto_refresh=False) if console.is_terminal else None
    before, before_t = None, 0.0
    shown = 0
    stopped = stop.is_set if stop is not None else lambda: False
    if live is not None:
        live.start()
    try:
        while (count is None or shown < count) and not stopped():
            started = time.monotonic()
            state = fetch()
            now = time.monotonic()
            rows = node_rows(before, state, now - before_t)
            warning = master_line(state.get("master") or {})
            if live is not None:
                live.update(frame(rows, interval, warning), refresh=True)
            else:
                for line in lines(rows, interval, warning):
                    console.print(line, markup=False, highlight=False, soft_wrap=True)
            before, before_t = state, now
            shown += 1
            if (count is None or shown < count) and not stopped():
                time.sleep(max(0.0, interval - (time.monotonic() - started)))
    finally:
        if live is not None:
            live.stop()
