"""``raykv status --watch``: rows from two status snapshots (counts, rates over the
interval, pool use), a restarted or new node without rates, and the command itself over
stand-in snapshots (no cluster): plain lines when not on a terminal, Ctrl-C exits 0."""

from __future__ import annotations

import itertools
import os
import signal

import pytest
from click.testing import CliRunner
from raykv.clusters.cli import main
from raykv.clusters.status_rates import NodeRow, node_rows
from raykv.clusters.status_watch import bandwidth, cells, lines
from raykv.controllers.node_records import NodeStats, PoolStats, StatsFailed

from tests.unit.fakes import node_stats

A, B = "aaaa1111" + "0" * 48, "bbbb2222" + "0" * 48


def node(hits=0, misses=0, other=0, put=0, got=0, pools=1, used=3 << 20,
         budget=0) -> NodeStats:
    counters = {"get_objects": hits, "put_objects": hits, "put_bytes": put, "get_bytes": got}
    if misses:
        counters["get_error_-704"] = misses
    if other:
        counters["get_error_-800"] = other
    return node_stats(counters=counters, host_pool_used=used, host_pool_bytes=budget,
                      pools={f"p{i}": PoolStats("mha", 0, 0, None, {}) for i in range(pools)})


def snapshot(**nodes: NodeStats | StatsFailed) -> dict:
    return {"nodes": {{"a": A, "b": B}[k]: v for k, v in nodes.items()}}


def test_first_snapshot_has_counts_and_no_rates():
    (row,) = node_rows(None, snapshot(a=node(hits=6, misses=2, other=1)), 0.0)
    assert row == NodeRow("aaaa1111", l3_hits=6, misses=2, errors=1, pools=1,
                          pool_used=3 << 20)
    assert row.hit_rate == 0.75


def test_rates_are_differences_over_the_interval():
    before = snapshot(a=node(hits=10, misses=1, put=1_000_000_000, got=0), b=StatsFailed("x"))
    after = snapshot(a=node(hits=30, misses=5, other=3, put=5_000_000_000, got=2_000_000),
                     b=StatsFailed("ActorDiedError"))
    a, b = node_rows(before, after, 2.0)
    assert (a.hits_per_s, a.misses_per_s, a.put_gbps, a.get_gbps) == (10.0, 2.0, 2.0, 0.001)
    assert (a.l3_hits, a.misses, a.errors) == (30, 5, 3)  # -800 is an error, not a miss
    assert b == NodeRow("bbbb2222", error="ActorDiedError")


def test_the_same_counts_again_are_zero_rates():
    """Control for the rates above: nothing moved, every rate 0."""
    state = snapshot(a=node(hits=30, misses=5, put=7, got=9))
    (row,) = node_rows(state, state, 0.5)
    assert (row.hits_per_s, row.misses_per_s, row.put_gbps, row.get_gbps) == (0, 0, 0, 0)


def test_new_or_restarted_node_has_no_rates_yet():
    before = snapshot(a=node(hits=30, put=100))
    after = snapshot(a=node(hits=2, put=10), b=node(hits=1))
    for row in node_rows(before, after, 1.0):
        assert (row.hits_per_s, row.misses_per_s, row.put_gbps, row.get_gbps) == (None,) * 4
    with pytest.raises(ValueError, match="dt must be > 0"):
        node_rows(before, after, 0.0)


def test_cells():
    assert bandwidth(None) == "-" and bandwidth(0.0) == "0 B/s"
    assert bandwidth(2.5) == "2.50 GB/s" and bandwidth(0.0123) == "12.3 MB/s"
    assert bandwidth(4.5e-6) == "4.5 kB/s" and bandwidth(3e-8) == "30 B/s"
    row = NodeRow("aaaa1111", l3_hits=3, misses=1, hits_per_s=1.5, misses_per_s=0.0,
                  put_gbps=0.0, get_gbps=1e-3, pools=2, pool_used=3 << 20,
                  pool_budget=1 << 30)
    assert cells(row) == ("aaaa1111", "3", "1.5", "1", "0.0", "0", "75%", "0 B/s",
                          "1.0 MB/s", "2", "3.0 / 1024 MiB")
    assert cells(NodeRow("b", pool_used=0))[-1] == "0.0 MiB, no limit"
    assert lines([NodeRow("b", error="gone")], 1.0)[1] == "node b: error: gone"


def stand_in(monkeypatch, states) -> list[float]:
    """``deploy.connect`` a no-op, ``deploy.status`` answering ``states`` (any iterable,
    a generator included) in turn (an exception instance is raised); ``time.sleep``
    recorded, not slept."""
    from raykv.clusters import deploy, status_watch

    answers = iter(states)

    def status(address, namespace):
        answer = next(answers)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    slept: list[float] = []
    monkeypatch.setattr(deploy, "connect", lambda address, namespace: None)
    monkeypatch.setattr(deploy, "status", status)
    monkeypatch.setattr(status_watch.time, "sleep", slept.append)
    return slept


def test_watch_piped_prints_one_block_per_refresh(monkeypatch):
    slept = stand_in(monkeypatch, [snapshot(a=node(hits=1)), snapshot(a=node(hits=1)),
                                   snapshot(a=node(hits=9, put=4000))])
    out = CliRunner().invoke(main, ["status", "--watch", "--interval=0.5", "--count=3"])
    assert out.exit_code == 0, out.output
    blocks = [line for line in out.output.splitlines() if line.startswith("node ")]
    assert len(blocks) == 3 and out.output.count("raykv status --watch: 1 node(s)") == 3
    assert "L3 hits 1, hits/s -," in blocks[0]
    assert "L3 hits 1, hits/s 0.0," in blocks[1] and "put 0 B/s," in blocks[1]
    assert "L3 hits 9, hits/s " in blocks[2] and "hits/s 0.0," not in blocks[2]
    assert len(slept) == 2 and all(0 <= s <= 0.5 for s in slept)


def test_watch_says_when_the_master_is_being_restarted(monkeypatch):
    down = {"master_address": "10.1.2.3:1", "state": "restarting", "attempts": 2,
            "last_error": "RuntimeError: mooncake_master did not restart"}
    stand_in(monkeypatch, [snapshot(a=node()) | {"master": down}, snapshot(a=node())])
    out = CliRunner().invoke(main, ["status", "--watch", "--count=2"])
    assert out.exit_code == 0, out.output
    said = "warning: mooncake_master is down, restarting: 2 failed attempt(s) in a row"
    assert out.output.count(said) == 1, out.output  # in the first frame only


def test_watch_ends_at_ctrl_c_with_exit_0(monkeypatch):
    stand_in(monkeypatch, itertools.chain([snapshot(a=node())], [KeyboardInterrupt()]))
    out = CliRunner().invoke(main, ["status", "--watch"])
    assert out.exit_code == 0, out.output
    assert "node aaaa1111: L3 hits 0" in out.output


def test_watch_ends_cleanly_after_the_refresh_a_sigint_came_in(monkeypatch):
    """The handler only flags the stop: the refresh under way is shown, none follows, and
    SIGINT's handler is the previous one again afterwards."""
    def refreshes():
        yield snapshot(a=node(hits=1))
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C during the second refresh
        yield snapshot(a=node(hits=2))
        yield snapshot(a=node(hits=3))

    stand_in(monkeypatch, refreshes())
    before = signal.getsignal(signal.SIGINT)
    out = CliRunner().invoke(main, ["status", "--watch"])
    assert out.exit_code == 0, out.output
    assert "L3 hits 2," in out.output and "L3 hits 3," not in out.output
    assert signal.getsignal(signal.SIGINT) is before


def test_a_second_sigint_interrupts_a_refresh_that_hangs(monkeypatch):
    def refreshes():
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, and the refresh hangs: again
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the second SIGINT did not interrupt the refresh")
        yield

    stand_in(monkeypatch, refreshes())
    out = CliRunner().invoke(main, ["status", "--watch"])
    assert out.exit_code == 0, out.output


def test_watch_stops_with_one_line_when_raykv_goes_away(monkeypatch):
    stand_in(monkeypatch, [snapshot(a=node()),
                           ValueError("raykv is not running in namespace 'raykv'")])
    out = CliRunner().invoke(main, ["status", "--watch"])
    assert out.exit_code == 1 and "Error: raykv is not running" in out.output, out.output


@pytest.mark.parametrize("args", [["--interval=2"], ["--count=2"], ["--watch", "--json"],
                                  ["--watch", "--interval=0"]])
def test_watch_options_misused_are_usage_errors(args):
    out = CliRunner().invoke(main, ["status", *args])
    assert out.exit_code == 2, out.output
