"""``raykv bench* --check``: exit 1 naming every target a run missed, 0 when each was met
or could not be judged; without ``--check`` the exit is 0 either way. The decision on
its own, then the commands over stand-in benchmark results (no cluster)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from raykv.clusters.cli import main
from raykv_lab.bench.verdict import check_message, missed_targets

MET = {">= 0.9x raw": True, "< 1 ms p50": True, "small pages": None}
MISSED = {">= 0.9x raw": False, "< 1 ms p50": True, "small pages": None}


def test_missed_targets():
    assert missed_targets([MET]) == []
    assert missed_targets([MISSED]) == [">= 0.9x raw"]
    assert missed_targets([MET, {"8 ranks": False, "CPU": False}]) == ["8 ranks", "CPU"]
    assert missed_targets([{"not judged": None}, {}]) == []
    assert check_message(["a", "b"]) == "2 target(s) not met: a; b"


def stand_in(monkeypatch, module: str, function: str, targets: dict) -> list[dict]:
    """Replace the benchmark ``module.function`` by one returning ``targets``; returns
    the list its calls' keyword arguments are appended to."""
    import importlib

    calls: list[dict] = []

    def run(*args, **kwargs):
        calls.append(kwargs)
        return {"targets": targets}

    monkeypatch.setattr(importlib.import_module(f"raykv_lab.bench.{module}"), function,
                        run)
    return calls


@pytest.mark.parametrize(("command", "module", "function"), [
    (["bench-group", "--tp-sizes=2"], "group", "run_group_bench"),
    (["bench-ranks", "--ranks=1"], "ranks", "run_ranks_bench"),
    (["bench", "--page-sizes=64K"], "dataplane", "run_dataplane_bench"),
])
def test_check_exits_1_naming_the_missed_target(monkeypatch, command, module, function):
    calls = stand_in(monkeypatch, module, function, MISSED)
    missed = CliRunner().invoke(main, [*command, "--check"])
    assert missed.exit_code == 1, missed.output
    assert "Error: 1 target(s) not met: >= 0.9x raw" in missed.output
    assert "Traceback" not in missed.output and len(calls) == 1
    # Controls: the same run without --check exits 0; a run that met every target it
    # could judge passes --check.
    assert CliRunner().invoke(main, command).exit_code == 0
    stand_in(monkeypatch, module, function, MET)
    assert CliRunner().invoke(main, [*command, "--check"]).exit_code == 0


def test_bench_with_ranks_checks_both_runs(monkeypatch):
    stand_in(monkeypatch, "dataplane", "run_dataplane_bench", MET)
    stand_in(monkeypatch, "ranks", "run_ranks_bench", {"8 ranks >= 2x": False})
    out = CliRunner().invoke(main, ["bench", "--ranks", "--check"])
    assert out.exit_code == 1 and "not met: 8 ranks >= 2x" in out.output, out.output
