"""Both Mooncake wheels in one environment (they ship the same ``mooncake`` module) are
detected from package metadata and named, with the fix, by every node actor's stats and
``raykv status``; one wheel alone says nothing."""

import io
from pathlib import Path

import pytest
from raykv.cache_actors.mooncake_wheels import (
    CPU_WHEEL,
    CUDA_WHEEL,
    conflict_warning,
    environment_warning,
    installed_wheels,
)
from raykv.clusters.status_view import render_status
from raykv.controllers.node_records import StatsFailed
from rich.console import Console

from tests.unit.fakes import node_stats


def test_both_wheels_are_named_with_the_fix():
    warning = conflict_warning({CPU_WHEEL, CUDA_WHEEL, "numpy"})
    assert warning is not None
    assert CPU_WHEEL in warning and CUDA_WHEEL in warning
    assert f"pip uninstall -y {CUDA_WHEEL} {CPU_WHEEL}" in warning


@pytest.mark.parametrize("installed", [set(), {CPU_WHEEL}, {CUDA_WHEEL}, {"numpy"}])
def test_one_wheel_or_none_is_no_conflict(installed):
    assert conflict_warning(installed) is None


def fake_distribution(root: Path, name: str) -> None:
    """An installed distribution as importlib.metadata finds it: a dist-info folder."""
    info = root / f"{name.replace('-', '_')}-0.3.13.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.3.13\n")


def test_the_environment_is_read_from_package_metadata(monkeypatch, tmp_path):
    # This venv has the CPU wheel only (the `cpu` extra): no warning ...
    assert installed_wheels() == {CPU_WHEEL}
    assert environment_warning() is None
    # ... until the CUDA wheel is installed beside it.
    fake_distribution(tmp_path, CUDA_WHEEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed_wheels() == {CPU_WHEEL, CUDA_WHEEL}
    assert environment_warning() == conflict_warning({CPU_WHEEL, CUDA_WHEEL})


def test_status_shows_each_nodes_warning():
    warning = conflict_warning({CPU_WHEEL, CUDA_WHEEL})
    state = {"info": {"metadata_server": "http://10.1.2.3:1/metadata", "mode": "embedded"},
             "master": {"master_address": "10.1.2.3:2", "restarts": 0}, "deployments": {},
             "nodes": {"aaaa1111bbbb": node_stats(warnings=[warning]),
                       "cccc2222dddd": node_stats(), "eeee3333ffff": StatsFailed("gone")}}
    out = io.StringIO()
    render_status(state, Console(file=out, width=400))
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("warning:")]
    assert lines == [f"warning: node aaaa1111: {warning}"], out.getvalue()

