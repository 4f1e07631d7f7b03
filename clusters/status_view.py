"""Renders ``raykv status`` as rich tables."""

from __future__ import annotations

from raykv.controllers.pool_layout import MiB
from rich.console import Console
from rich.table import Table


def _rate(ok: int, total: int) -> str:
    return f"{100 * ok / total:.0f}%" if total else "-"


def render_status(state: dict, console: Console | None = None) -> None:
    """Print the master, the deployments and one row per node and pool."""
    console = console or Console()
    info, master = state["info"], state["master"]
    console.print(f"[bold]raykv[/] master {master['master_address']} "
                  f"(restarts: {master.get('restarts', 'not supervised')}), "
                  f"metadata {info['metadata_server']}, {len(state['nodes'])} node(s), "
                  f"{info.get('mode', 'embedded')} mode")
    for dep_id, dep in state["deployments"].items():
        pools = ", ".join(f"{p['role']}:{p['kind']}" for p in dep["pools"])
        home = (dep.get("home_node") or "-")[:8]
        console.print(f"deployment [bold]{dep_id}[/]: TP {dep['tp_size']} x PP "
                      f"{dep['pp_size']}, {'MLA' if dep['is_mla_model'] else 'MHA'}, pools "
                      f"{pools}, {len(dep['ranks'])} rank(s) registered, group queries on "
                      f"node {home}")
    table = Table(title="nodes and pools")
    for col in ("node", "store MiB", "pool", "kind", "pool MiB", "pages", "put", "present",
                "put err", "got", "get miss", "get hit rate"):
        table.add_column(col)
    for node_id, s in state["nodes"].items():
        if "error" in s:
            table.add_row(node_id[:8], "", "[red]" + s["error"], *[""] * 9)
            continue
        seg = f"{s['global_segment_size'] / MiB:.0f}"
        if not s["pools"]:
            table.add_row(node_id[:8], seg, "-", *[""] * 9)
        for name, p in s["pools"].items():
            c = p["counters"]
            put_err = sum(v for k, v in c.items() if k.startswith("put_error"))
            miss = sum(v for k, v in c.items() if k.startswith("get_error"))
            got = c.get("get_ok", 0)
            table.add_row(node_id[:8], seg, name, p["kind"], f"{p['bytes'] / MiB:.1f}",
                          str(p["pages"]), str(c.get("put_ok", 0)), str(c.get("put_present", 0)),
                          str(put_err), str(got), str(miss), _rate(got, got + miss))
    console.print(table)
    for node_id, s in state["nodes"].items():
        g = s.get("group_queries")
        if g and (g["checked"] or g["recent"] or g["inflight"] or g.get("confirmed")):
            shared = g["recent"] + g["inflight"]
            confirmed = g.get("confirmed", 0)
            console.print(f"node {node_id[:8]}: {g['checked'] + confirmed + shared} group "
                          f"queries, {shared} shared by ranks of a group, {confirmed} "
                          f"answered from confirmed pages, {g['store_calls']} store checks")
