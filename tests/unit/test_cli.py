"""The installed ``raykv`` console script explains itself: user errors end in one line
and a non-zero exit, never a traceback (no Ray cluster at the address, a wrong address,
a bad option value), ``--version`` works; the option types and the narrow ``status``
layout on their own. No cluster: every address here is one where no Ray answers."""

import http.server
import io
import os
import socket
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import click
import pytest
from raykv.clusters.cli import IntList, Size, SizeList
from raykv.clusters.node_lifecycle import LifecycleSettings
from raykv.clusters.status_view import render_status
from raykv.controllers.node_records import (
    LinkView,
    LoadStats,
    PoolStats,
    RateView,
    ResidencyStats,
    StatsFailed,
    TenantUse,
    TierStats,
    Warmup,
    WarmupStats,
)
from raykv_lab.cli import BENCH_PAGE_QUANTUM, SGLANG_PAGE_QUANTUM, Tokens
from rich.console import Console

from tests.unit.fakes import node_stats

RAYKV = str(Path(sys.executable).parent / "raykv")


def closed_port() -> int:
    """A TCP port nothing listens on, on any interface (Ray turns 127.0.0.1 into the
    node's IP)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def raykv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([RAYKV, *args], capture_output=True, text=True, timeout=60,
                          env=base | (env or {}), cwd=Path(__file__).parent)


def assert_one_line_error(out: subprocess.CompletedProcess, code: int, *words: str) -> None:
    assert out.returncode == code, (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr + out.stdout, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, out.stderr
    for word in words:
        assert word in errors[0], out.stderr


@pytest.mark.parametrize("command", ["status", "down", "up"])
def test_no_ray_cluster_is_one_line_with_the_hint(command):
    out = raykv(command, env={"RAY_ADDRESS": f"127.0.0.1:{closed_port()}"})
    assert_one_line_error(out, 1, "no Ray cluster", "RAY_ADDRESS", "ray start --head")
    assert out.stderr.strip().count("\n") == 0, out.stderr


def test_wrong_address_is_one_line_with_the_hint():
    """--address names a port where some other service (an HTTP server) listens."""
    server = http.server.HTTPServer(("", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        out = raykv("status", f"--address=127.0.0.1:{server.server_port}",
                    env={"RAY_ADDRESS": f"127.0.0.1:{closed_port()}"})
    finally:
        server.shutdown()
    assert_one_line_error(out, 1, f":{server.server_port}", "ray start --head")


@pytest.mark.parametrize(("args", "words"), [
    (["bench", "--page-sizes", "100K"], ["--page-sizes", "100K", "32K"]),
    (["bench", "--batch", "0"], ["--batch"]),
    (["bench-group", "--tp-sizes", "2,a"], ["--tp-sizes", "'a'"]),
])
def test_bad_option_values_are_usage_errors(args, words):
    assert_one_line_error(raykv(*args), 2, "Invalid value", *words)


@pytest.mark.parametrize(("args", "words"), [
    (["bench", "--engine", "sglang", "--page-sizes", "96K"], ["--page-sizes", "64K"]),
    (["bench-ranks", "--ranks", "0"], ["--ranks"]),
    (["bench-group", "--seconds", "0"], ["--seconds"]),
    (["up", "--segment-size", "lots"], ["--segment-size", "lots"]),
    (["up", "--tenant-quota", "team-a"], ["--tenant-quota", "NAME=SIZE"]),
    (["up", "--tenant-quota", "team a=1G"], ["--tenant-quota", "tenant must be"]),
    (["up", "--tenant-quota", "team-a=0"], ["--tenant-quota", "> 0"]),
    (["up", "--tenant-quota", "team-a=1G", "--tenant-quota", "team-a=2G"],
     ["--tenant-quota", "named twice"]),
    (["demo", "--turns", "0"], ["--turns"]),
    (["sim", "t.jsonl", "--gpu-tokens", "100"], ["--gpu-tokens", "below 512"]),
    (["sim", "t.jsonl", "--l2-tokens", "lots"], ["--l2-tokens", "256K or 3M"]),
    (["sim", "t.jsonl", "--runs", "raykv,magic"], ["--runs", "gpu_only"]),
])
def test_more_bad_option_values_in_process(args, words):
    from click.testing import CliRunner
    from raykv.clusters.cli import main

    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2, out.output
    assert "Invalid value" in out.output and all(w in out.output for w in words), out.output


def test_tenant_digest_prints_what_up_binds_and_needs_the_secret():
    from click.testing import CliRunner
    from raykv.clusters.cli import main
    from raykv.controllers.owner_keys import OwnerKey

    secret = "s" * 32
    out = CliRunner().invoke(main, ["tenant-digest", "acme"],
                             env={"RAYKV_TENANT_SECRET": secret})
    assert out.exit_code == 0, out.output
    assert out.output.strip() == f"acme={OwnerKey.of_secret(secret.encode()).public}"
    assert secret not in out.output
    missing = CliRunner().invoke(main, ["tenant-digest", "acme"],
                                 env={"RAYKV_TENANT_SECRET": ""})
    assert missing.exit_code == 1 and "RAYKV_TENANT_SECRET" in missing.output


def test_version_is_the_package_metadata():
    from importlib.metadata import version

    import raykv as package

    out = raykv("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"raykv, version {version('raykv')}"
    assert package.__version__ == version("raykv")


def test_every_command_documents_its_exit_codes_and_options():
    from click.testing import CliRunner
    from raykv.clusters.cli import main

    def help_text(*command: str) -> str:
        out = CliRunner().invoke(main, [*command, "--help"], terminal_width=100)
        assert out.exit_code == 0, out.output
        return out.output

    assert "Exit codes:" in help_text()
    for command in main.commands:
        assert "Exit codes:" in help_text(command), command
    text = help_text("bench-group")
    for option in ("--tp-sizes", "--pages", "--concurrency", "--seconds", "--out"):
        line = next(ln for ln in text.splitlines() if ln.strip().startswith(option))
        assert len(line.split()) > 2, f"{option} has no help text"


def test_param_types():
    assert Size().convert("1GB", None, None) == 1 << 30
    assert SizeList(BENCH_PAGE_QUANTUM, "x").convert("64K,1M", None, None) == (64 << 10,
                                                                                1 << 20)
    assert IntList().convert("2, 4", None, None) == (2, 4)
    assert Tokens().convert("3M", None, None) == 3_000_000
    assert Tokens().convert("2.5K", None, None) == 2500
    for param_type, value in ((Size(), "-1K"), (SizeList(BENCH_PAGE_QUANTUM, "x"), "0"),
                              (SizeList(BENCH_PAGE_QUANTUM, "x"), "64K,,1M"),
                              (IntList(min=1), "0"), (IntList(), ""),
                              (Tokens(), "0"), (Tokens(), "3Q")):
        with pytest.raises(click.BadParameter):
            param_type.convert(value, None, None)


def test_page_quanta_are_the_benchmarks_own():
    from raykv_lab.bench import sglang, toolkit

    assert BENCH_PAGE_QUANTUM == toolkit.PAGE_TOKENS * toolkit.KV_CACHE_DIM
    assert SGLANG_PAGE_QUANTUM == sglang.LAYER_PAGE_BYTES


STATE = {
    "info": {"metadata_server": "http://10.1.2.3:38111/metadata", "mode": "embedded",
             "master_address": "10.1.2.3:45123"},
    "master": {"master_address": "10.1.2.3:45123", "restarts": 0},
    "deployments": {},
    "nodes": {
        "3b7474c5b7c6aa69e31103d0": node_stats(
            global_segment_size=16 << 30,
            pools={"p1a2b3c4d-kv": PoolStats("mha", 163840123, 163840, None, {
                "put_ok": 1638400, "put_present": 12, "get_ok": 1638406,
                "get_error_miss": 3})}),
        "ffff74c5b7c6aa69e31103d0": StatsFailed("ActorDiedError: the actor died"),
        "eeee74c5b7c6aa69e31103d0": node_stats(global_segment_size=0, own_segment=None),
        "dddd74c5b7c6aa69e31103d0": node_stats(
            global_segment_size=1 << 30, own_segment="10.1.2.4:15123",
            residency=ResidencyStats(7, 0, 0, 0, 0.0)),
    },
}
FIRST = STATE["nodes"]["3b7474c5b7c6aa69e31103d0"]


@pytest.mark.parametrize("width", [80, 40])
def test_status_shows_whole_values_when_narrow(width):
    out = io.StringIO()
    render_status(STATE, Console(file=out, width=width))
    text = out.getvalue()
    assert "…" not in text
    assert all(len(line) <= width for line in text.splitlines() if "pool " in line)
    for value in ("3b7474c5", "16384", "p1a2b3c4d-kv", "156.3", "163840", "1638400",
                  "1638406", "100%", "ActorDiedError", "ffff74c5", "eeee74c5"):
        assert value in text, (value, text)


def test_status_names_each_nodes_own_segment():
    out = io.StringIO()
    render_status(STATE, Console(file=out, width=200))
    text = out.getvalue()
    assert "node dddd74c5: puts prefer segment 10.1.2.4:15123; 7 residency queries" in text
    assert "node eeee74c5: puts prefer segment (none known: placed at random)" in text


def test_status_is_a_table_where_it_fits():
    out = io.StringIO()
    render_status(STATE, Console(file=out, width=200))
    assert "get hit rate" in out.getvalue() and "┃" in out.getvalue()


def test_status_warns_while_the_master_is_restarting():
    from raykv.clusters.status_view import master_line

    assert master_line(STATE["master"]) is None  # not supervised: no state
    assert master_line({"state": "running", "attempts": 0}) is None
    down = {"master_address": "10.1.2.3:45123", "restarts": 2, "state": "restarting",
            "attempts": 3, "last_error": "RuntimeError: mooncake_master did not restart"}
    out = io.StringIO()
    render_status(STATE | {"master": down}, Console(file=out, width=200))
    assert ("warning: mooncake_master is down, restarting: 3 failed attempt(s) in a row, "
            "last error: RuntimeError: mooncake_master did not restart") in out.getvalue()


def test_tenant_quota_values_convert_to_bytes():
    from raykv.clusters.cli import TenantQuota

    assert TenantQuota().convert("team-a=4GB", None, None) == ("team-a", 4 << 30)
    assert TenantQuota().convert(" t.1 = 512M", None, None) == ("t.1", 512 << 20)


def test_status_shows_pool_bytes_per_tenant_against_its_quota():
    from raykv.clusters.status_view import tenant_lines

    node = node_stats(tenants={"team-a": TenantUse(48 << 20, 3, 64 << 20),
                               "team-b": TenantUse(1 << 20, 1, None)},
                      untenanted=TenantUse(2 << 20, 2, None))
    text = "\n".join(tenant_lines("3b7474c5ffff", node, 80))
    for value in ("node 3b7474c5 tenants:", "team-a 48.0 MiB of 64.0 MiB quota (3 pools)",
                  "team-b 1.0 MiB, no quota (1 pools)", "no tenant 2.0 MiB (2 pools)"):
        assert value in text, (value, text)
    assert all(len(line) <= 80 for line in text.splitlines())
    node.untenanted.quota = 8 << 20  # their bound (NodeSettings.untenanted_pool_bytes)
    assert "no tenant 2.0 MiB of 8.0 MiB bound (2 pools)" in "\n".join(
        tenant_lines("3b7474c5ffff", node, 80))
    assert tenant_lines("n", node_stats(untenanted=TenantUse(0, 2)), 80) == []
    assert tenant_lines("n", StatsFailed("gone"), 80) == []


def test_bench_gpu_refuses_without_cuda(monkeypatch):
    import torch
    from click.testing import CliRunner
    from raykv.clusters.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(main, ["bench-gpu"])
    assert result.exit_code == 1 and "needs a CUDA GPU" in result.output


@pytest.mark.parametrize(("args", "words"), [
    (["up", "--link", "10gbit"], ["--link"]),
    (["up", "--emulate-hosts", "2"], ["--emulate-hosts"]),
    (["emulate-hosts", "2", "--address", "10.0.0.1:6379"], ["--address"]),
    (["emulate-hosts", "0"], ["HOSTS"]),
    (["bench-hosts", "--links", "fast"], ["--links", "fast"]),
    (["bench-hosts", "--links", "unshaped"], ["--links", "unshaped"]),
    (["bench-hosts", "--locality", "--page-sizes", "96K"], ["--page-sizes", "64 KiB"]),
    (["bench-scale-down", "--links", "fast"], ["--links", "fast"]),
    (["bench-guard-links", "--links", "1gbit,fast"], ["--links", "fast"]),
    (["bench-guard-links", "--lengths", "128"], ["--lengths", "128"]),
    (["bench-guard-links", "--lengths", "256,5000"], ["--lengths", "5000"]),
    (["bench-guard-links", "--repeats", "0"], ["--repeats"]),
    (["bench-scale-down", "--modes", "on,maybe"], ["--modes", "maybe"]),
])
def test_emulated_hosts_usage_errors(args, words):
    from click.testing import CliRunner
    from raykv.clusters.cli import main

    out = CliRunner().invoke(main, args)
    assert out.exit_code == 2, out.output
    assert all(w in out.output for w in words), out.output


def test_emulated_hosts_refuse_without_root(monkeypatch):
    """Nothing is built without root, and the message says why (control: as root the
    same check passes)."""
    from raykv_lab import hosts

    monkeypatch.setattr(hosts.os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="need root"):
        hosts.EmulatedHosts.create(2, "1gbit")
    monkeypatch.setattr(hosts.os, "geteuid", lambda: 0)
    monkeypatch.setattr(hosts.shutil, "which", lambda tool: f"/sbin/{tool}")
    hosts.check_root()


EMULATED = {
    # option: (its arguments, the NodeSettings field or start_hosts keyword it must
    # reach; None: not an option of emulate-hosts)
    "--address": (["--address", "10.0.0.1:6379"], None),
    "--master-address": (["--master-address", "10.0.0.1:50051"], None),
    "--metadata-server": (["--metadata-server", "http://10.0.0.1:8080/metadata"], None),
    "--master-port": (["--master-port", "50051"], None),
    "--metadata-port": (["--metadata-port", "8080"], None),
    "--mooncake-host": (["--mooncake-host", "10.0.0.1"], None),
    "--segment-size": (["--segment-size", "96MB"], ("global_segment_size", 96 << 20)),
    "--protocol": (["--protocol", "rdma"], ("protocol", "rdma")),
    "--rdma-devices": (["--protocol", "rdma", "--rdma-devices", "mlx5_0"],
                       ("rdma_devices", "mlx5_0")),
    "--local-buffer-size": (["--local-buffer-size", "48MB"], ("local_buffer_size", 48 << 20)),
    "--mooncake-log-level": (["--mooncake-log-level", "INFO"], ("mooncake_log_level", "INFO")),
    "--standalone": (["--standalone"], ("standalone", True)),
    "--host-pool-size": (["--host-pool-size", "3GB"], ("host_pool_bytes", 3 << 30)),
    "--untenanted-pool-size": (["--untenanted-pool-size", "2GB"],
                               ("untenanted_pool_bytes", 2 << 30)),
    "--l2-size": (["--l2-size", "200MB"], ("l2_bytes", 200 << 20)),
    "--l2-warm-size": (["--l2-warm-size", "64MB"], ("l2_warm_bytes", 64 << 20)),
    "--l2-warm-seconds": (["--l2-warm-seconds", "5"], ("l2_warm_s", 5.0)),
    "--l2-eviction": (["--l2-eviction", "slru"], ("l2_eviction", "slru")),
    "--placement": (["--placement", "any"], ("placement", "any")),
    "--confirm-ttl": (["--confirm-ttl", "0.5"], ("confirm_ttl_s", 0.5)),
    "--tenant-quota": (["--tenant-quota", "acme=1GB"], ("tenant_quotas", {"acme": 1 << 30})),
    "--tenant-digest": (["--tenant-digest", "acme=" + "ab" * 32],
                        ("tenant_digests", {"acme": "ab" * 32})),
    "--bound-tenants-only": (["--tenant-digest", "acme=" + "ab" * 32, "--bound-tenants-only"],
                             ("bound_tenants_only", True)),
    "--keep-nodes": (["--keep-nodes", "all"], ("lifecycle", LifecycleSettings(
        keep_nodes=("all",)))),
    "--retire-idle": (["--retire-idle", "7"], ("lifecycle", LifecycleSettings(
        retire_idle_s=7.0))),
    "--drain-timeout": (["--drain-timeout", "9"], ("lifecycle", LifecycleSettings(
        drain_timeout_s=9.0))),
    "--no-drain": (["--no-drain"], ("lifecycle", LifecycleSettings(drain=False))),
    "--disk-dir": (["--disk-dir", "/var/raykv", "--disk-size", "1GB"],
                   ("disk_dir", "/var/raykv")),
    "--disk-size": (["--disk-dir", "/var/raykv", "--disk-size", "2GB"],
                    ("disk_bytes", 2 << 30)),
}
"""Every option of ``raykv up`` but --namespace: what the lab's ``emulate-hosts`` (which
takes ``up``'s node options) does with it."""


def test_every_up_option_is_classified_for_emulated_hosts():
    """A new option of ``raykv up`` must say what emulate-hosts does with it (above), and
    emulate-hosts takes exactly the classified ones that reach it, plus its own."""
    from raykv.clusters.cli import main

    up = {p.opts[0] for p in main.commands["up"].params}
    emulate = {p.opts[0] for p in main.get_command(None, "emulate-hosts").params}
    assert up - {"--namespace"} == set(EMULATED)
    assert emulate - {"--link", "--namespace", "hosts"} == {
        o for o, (_, reaches) in EMULATED.items() if reaches is not None}


@pytest.mark.parametrize("option", sorted(EMULATED))
def test_emulate_hosts_passes_each_option_or_refuses_it(monkeypatch, option):
    """``raykv emulate-hosts 2 OPTION``: the option reaches ``start_hosts`` (in its
    settings, or as its lifecycle) with its value, or the command refuses it (exit 2,
    naming it) and starts nothing. Control: without the option, ``start_hosts`` gets
    another value (so it was passed)."""
    from dataclasses import asdict

    from click.testing import CliRunner
    from raykv.clusters.cli import main
    from raykv_lab import hosts

    started = []

    def fake_start_hosts(count, settings, **kwargs):
        started.append(asdict(settings) | kwargs | {"hosts": count})
        raise ValueError("a fake start_hosts starts nothing")

    monkeypatch.setattr(hosts, "start_hosts", fake_start_hosts)
    args, reaches = EMULATED[option]
    out = CliRunner().invoke(main, ["emulate-hosts", "2", *args])
    if reaches is None:
        assert out.exit_code == 2 and option in out.output, out.output
        assert started == []
        return
    assert out.exit_code == 1 and "a fake start_hosts" in out.output, out.output
    (kwargs,) = started
    name, value = reaches
    assert kwargs[name] == value and kwargs["hosts"] == 2
    CliRunner().invoke(main, ["emulate-hosts", "2"])
    assert started[1][name] != value   # CONTROL: the default differs, so it was passed


def test_every_option_a_help_names_is_one_its_command_takes():
    """Each ``--option`` a command's ``--help`` names (options, text, epilog) is one its
    parser takes (or ``--help``), and each one it names in another command's line
    (`raykv up --tenant-digest`) is one of that command: a help naming a flag the command
    lacks sends its reader to a usage error (exit 2). CONTROL: a help checked against
    another command's parser is caught."""
    import re

    from click.testing import CliRunner
    from raykv.clusters.cli import main

    def takes(command) -> set[str]:
        return {"--help"} | {o for p in command.params for o in (*p.opts, *p.secondary_opts)}

    def unknown(name: str, parser_of: str) -> set[str]:
        text = CliRunner().invoke(main, [name, "--help"], terminal_width=200).output
        text = " ".join(text.split())  # a quoted command line may wrap
        missing = set()
        for other, line in re.findall(r"`raykv ([a-z][a-z-]*)([^`]*)`", text):
            if other in main.commands and other != name:
                missing |= set(re.findall(OPTION, line)) - takes(main.commands[other])
        text = re.sub(r"`raykv ([a-z][a-z-]*)[^`]*`",
                      lambda m: "" if m.group(1) != name else m.group(0), text)
        return missing | set(re.findall(OPTION, text)) - takes(main.commands[parser_of])

    OPTION = r"(?<![\w-])--[a-z][a-z0-9-]*"
    assert "bench-gpu" in main.commands and len(main.commands) > 5
    for name in main.commands:
        assert not unknown(name, name), name
    assert {"--page-sizes", "--batch"} <= unknown("bench-gpu", "bench-group")  # CONTROL


def test_sim_compares_every_run_on_a_trace_and_writes_json(tmp_path):
    """``raykv sim`` on the first requests of Mooncake's conversation trace: every timed
    run and reference in the table and the JSON; a bad trace line is one error naming
    the line, exit 1."""
    import json

    from click.testing import CliRunner
    from raykv.clusters.cli import main

    trace = Path(__file__).parent.parent / "data" / "traces" / "conversation_trace.jsonl"
    out = tmp_path / "sim.json"
    res = CliRunner().invoke(main, ["sim", str(trace), "--limit", "200", "--nodes", "2",
                                    "--engines-per-node", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["gpu_only", "local_host", "pooled", "raykv", "raykv_pow2"]
    for name, run in result["runs"].items():
        assert name in res.output
        assert 0 <= run["block_hit_rate"] <= result["bounds"]["unbounded"]["block_hit_rate"]
        assert len(run["ttft_s"]) == 3 and run["requests_per_node"]["max"] > 0
    assert result["requests"] == 200 and "raykv_over_belady_host" in result["ratios"]
    b = result["bounds"]
    assert b["global_lru_host"]["block_hit_rate"] <= b["global_lru"]["block_hit_rate"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace.read_text().splitlines()[0] + "\n{\"timestamp\": 1}\n")
    res = CliRunner().invoke(main, ["sim", str(bad)])
    assert res.exit_code == 1 and "bad.jsonl:2" in res.output and "Traceback" not in res.output


def test_sim_with_a_disk_tier_and_node_changes(tmp_path):
    """``raykv sim --disk-tokens --remove-node --add-node``: the disk tier's share and
    both node changes in the table and the JSON. CONTROL: without them, neither."""
    import json

    from click.testing import CliRunner
    from raykv.clusters.cli import main

    trace = Path(__file__).parent.parent / "data" / "traces" / "conversation_trace.jsonl"
    out = tmp_path / "sim.json"
    small = ["sim", str(trace), "--limit", "300", "--nodes", "3", "--engines-per-node", "1",
             "--gpu-tokens", "8K", "--l2-tokens", "16K", "--l3-tokens", "32K",
             "--runs", "raykv", "--load-guard", "off"]  # the disk's hits loaded
    res = CliRunner().invoke(main, [*small, "--disk-tokens", "4M", "--remove-node", "30",
                                    "--no-drain", "--add-node", "60", "--window-s", "30",
                                    "--out", str(out)])
    assert res.exit_code == 0, res.output
    run = json.loads(out.read_text())["runs"]["raykv"]
    assert run["tiers_block"]["l3_disk"] > 0 and "L3 disk" in res.output
    scaling = run["counters"]["scaling"]
    assert {"removed", "added", "lost", "warm"} <= set(scaling) and "drain" not in scaling
    assert "left at 30 s" in res.output and "joined at 60 s" in res.output
    res = CliRunner().invoke(main, [*small, "--out", str(out)])
    run = json.loads(out.read_text())["runs"]["raykv"]
    assert run["tiers_block"]["l3_disk"] == 0 and "scaling" not in run["counters"]
    assert "L3 disk" not in res.output and "left at" not in res.output


def test_sim_sweep_writes_points_and_a_figure(tmp_path):
    """``raykv sim-sweep`` over two host capacities and two node counts on the first
    requests of the conversation trace: a point per value, each run and reference in
    it, the figure written; the pooled store hits more at the larger capacity."""
    import json

    from click.testing import CliRunner
    from raykv.clusters.cli import main

    trace = Path(__file__).parent.parent / "data" / "traces" / "conversation_trace.jsonl"
    res = CliRunner().invoke(main, ["sim-sweep", str(trace), "--limit", "150",
                                    "--nodes", "2", "--engines-per-node", "2",
                                    "--gpu-tokens", "1K", "--host-tokens", "3K,300K",
                                    "--node-counts", "1,2", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    result = json.loads((tmp_path / "sim_sweep.json").read_text())
    assert [p["host_tokens"] for p in result["capacity"]] == [3000, 300000]
    assert [p["nodes"] for p in result["nodes"]] == [1, 2]
    for p in result["capacity"] + result["nodes"]:
        assert set(p["runs"]) == {"local_host", "pooled", "raykv"}
        assert set(p["bounds"]) == {"global_lru", "belady", "global_lru_host",
                                    "belady_host", "unbounded"}
    small, big = result["capacity"]
    assert small["runs"]["pooled"]["block_hit_rate"] < big["runs"]["pooled"]["block_hit_rate"]
    assert (tmp_path / "sim_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sim_trace_writes_workloads_sim_replays(tmp_path):
    from click.testing import CliRunner
    from raykv.clusters.cli import main

    for kind, args, n in (("shared-prefix", ["--groups", "3", "--prompts-per-group", "4"], 12),
                          ("multi-round-qa", ["--users", "3", "--rounds", "2"], 6)):
        path = tmp_path / f"{kind}.jsonl"
        res = CliRunner().invoke(main, ["sim-trace", kind, *args, "--out", str(path)])
        assert res.exit_code == 0, res.output
        res = CliRunner().invoke(main, ["sim", str(path), "--nodes", "2",
                                        "--engines-per-node", "1", "--runs", "pooled"])
        assert res.exit_code == 0 and f"{n} requests," in res.output, res.output


def test_status_shows_each_nodes_warm_ups():
    """``raykv status``: the warm-ups of a node's new L2 pools, the running one and the
    latest done, with what they read and why they ended, then the node's totals; a
    node without warm-ups (or whose stats failed) shows none."""
    from raykv.clusters.status_view import SHOWN_WARMUPS, warmup_lines

    def up(state: str, stopped: str | None, pages: int) -> Warmup:
        return Warmup(deployment="org-m_", rank=[1, 0], state=state, pages=pages,
                      bytes=pages << 20, chosen=40, stopped=stopped, seconds=1.5)

    warmup = WarmupStats(warm_bytes=256 << 20, warm_s=30.0, pages=52, bytes=52 << 20,
                         running=1, warmups={
                             **{f"l2-{i}": up("done", "time", 10) for i in range(4)},
                             "l2-new": up("running", None, 12)})
    lines = warmup_lines("3b7474c5ffff", node_stats(warmup=warmup))
    assert lines[0] == ("node 3b7474c5: L2 warm-up of org-m_ rank 1,0: running, 12 of 40 "
                        "pages read (12.0 MiB)")
    assert lines[1] == ("node 3b7474c5: L2 warm-up of org-m_ rank 1,0: done (time), 10 of "
                        "40 pages read (10.0 MiB)")
    assert len(lines) == 1 + SHOWN_WARMUPS + 1
    assert lines[-1] == ("node 3b7474c5: L2 warm-ups read 52 pages (52.0 MiB), 1 running; "
                         "budget 256.0 MiB and 30 s each")
    out = io.StringIO()
    render_status(STATE | {"nodes": {"3b7474c5ffff": replace(FIRST, warmup=warmup)}},
                  Console(file=out, width=200))
    assert lines[0] in out.getvalue()
    assert warmup_lines("n", node_stats()) == []
    assert warmup_lines("n", StatsFailed("gone")) == []


def test_drain_prints_the_report_and_fails_on_an_error_or_a_refusal(monkeypatch):
    """``raykv drain NODE``: the reconciler's report as JSON, exit 0; a report with an
    error, or a refusal (no node actor, the head node), exits 1 naming why."""
    import json

    from click.testing import CliRunner
    from raykv.clusters import deploy
    from raykv.clusters.cli import main

    answers = iter([{"reason": "operator", "outcome": "stopped", "objects_moved": 3},
                    {"reason": "operator", "error": "actor died"},
                    ValueError("node abc is the head node: it keeps its node actor")])

    def fake_drain(address, node_id, namespace):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(deploy, "drain", fake_drain)
    ok = CliRunner().invoke(main, ["drain", "abc"])
    assert ok.exit_code == 0 and json.loads(ok.output)["objects_moved"] == 3, ok.output
    failed = CliRunner().invoke(main, ["drain", "abc"])
    assert failed.exit_code == 1 and "actor died" in failed.output
    refused = CliRunner().invoke(main, ["drain", "abc"])
    assert refused.exit_code == 1 and "head node" in refused.output


def test_status_shows_each_nodes_load_estimates():
    """``raykv status``: a node's estimated read rate per source segment with the age
    of its last probe, its disk's and its queue's wait; a node without estimates shows
    its queue's wait alone, one whose stats failed nothing (controls)."""
    from raykv.clusters.status_view import link_lines

    loads = LoadStats(
        links={"10.0.0.1:1000": LinkView(mb_per_s=1191.8, fixed_ms=0.2, samples=3,
                                         probe_age_s=12.4),
               "10.0.0.2:1000": LinkView(mb_per_s=None, fixed_ms=0.0, samples=0,
                                         probe_age_s=None)},
        l3_disk=RateView(mb_per_s=80.0, fixed_ms=0.0, samples=1),
        overall=RateView(mb_per_s=900.0, fixed_ms=0.0, samples=4),
        queue_wait_s=0.0015, located_keys=16)
    lines = link_lines("3b7474c5ffff", node_stats(loads=loads), 200)
    assert lines == ["node 3b7474c5 load estimates: 10.0.0.1:1000 1191.8 MB/s (probed 12 s "
                     "ago), 10.0.0.2:1000 ? (never probed), disk 80.0 MB/s, queue wait "
                     "1.5 ms"]
    out = io.StringIO()
    render_status(STATE | {"nodes": {"3b7474c5ffff": replace(FIRST, loads=loads)}},
                  Console(file=out, width=200))
    assert lines[0] in out.getvalue()
    assert link_lines("n", node_stats(), 80) == [  # CONTROL: no estimate, only the queue
        "node n load estimates: queue wait 0.0 ms"]
    assert link_lines("n", StatsFailed("gone"), 80) == []


def test_status_shows_each_nodes_disk_tier():
    """``raykv status``: a node with seals shows its disk slot's use against its bound,
    the objects served from memory and from disk, and those refused; a node without
    seals shows no such line (control)."""
    from raykv.clusters.status_view import disk_line

    tiers = TierStats(served={"l3_memory": 7, "l3_disk": 5}, served_bytes={},
                      refused={"mac": 2}, path="/var/raykv/node-0",
                      limit_bytes=4 << 30, used_bytes=48 << 20)
    line = disk_line("3b7474c5ffff", node_stats(tiers=tiers))
    assert line == ("node 3b7474c5: disk 48.0 MiB of 4096.0 MiB in /var/raykv/node-0; gets "
                    "served 7 objects from memory, 5 from disk; 2 refused (seal not "
                    "verified, or unreadable)")
    out = io.StringIO()
    render_status(STATE | {"nodes": {"3b7474c5ffff": replace(FIRST, tiers=tiers)}},
                  Console(file=out, width=200))
    assert line in out.getvalue()
    assert disk_line("n", node_stats()) is None


def test_installed_packages_add_commands_but_never_replace_raykvs(monkeypatch):
    """The lab's commands reach ``raykv`` through the ``raykv.commands`` entry points;
    a command of the same name as one of raykv's own never replaces it. CONTROL: the
    entry point's new command is added."""
    import importlib.metadata

    from raykv.clusters.cli import COMMAND_GROUP, RaykvGroup, main

    assert {"demo", "bench", "sim", "emulate-hosts", "clean-hosts"} <= set(
        main.list_commands(click.Context(main)))  # the lab, installed by the set-up

    @click.command("up")
    def fake_up() -> None:
        """Not raykv's."""

    @click.command("extra")
    def extra() -> None:
        """Another package's."""

    class Point:
        def load(self):
            return (fake_up, extra)

    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group: [Point()] if group == COMMAND_GROUP else [])

    @click.group(cls=RaykvGroup)
    def cli() -> None:
        """A raykv-like group."""

    @cli.command("up")
    def own_up() -> None:
        """raykv's own."""

    ctx = click.Context(cli)
    assert cli.get_command(ctx, "up") is own_up
    assert cli.get_command(ctx, "extra") is extra
