"""matplotlib is a dependency of the lab only: without it, raykv imports, and the demo
and benchmark commands fail at once (before any cluster starts) saying what installs it."""

import importlib.util
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from raykv.clusters.cli import main
from raykv_lab import plotting

HINT = "pip install -e ./lab in raykv's clone"


def test_figure_class_says_what_installs_matplotlib(monkeypatch):
    assert plotting.figure_class().__name__ == "Figure"  # CONTROL: found when installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    with pytest.raises(plotting.MissingMatplotlibError, match=r"pip install -e \./lab"):
        plotting.figure_class()


def test_hint_installs_the_lab_from_the_clone_as_the_setup_does(monkeypatch):
    """raykv is not on the package index: the hint is the set-up's install of the lab
    from a clone, never ``pip install raykv-lab``, which would look it up on the index."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(plotting.MissingMatplotlibError) as e:
        plotting.require_matplotlib()
    hint = str(e.value)
    assert HINT in hint and "install raykv-lab" not in hint, hint
    setup = (Path(__file__).parents[2] / "scripts" / "setup.sh").read_text()
    assert "-e ./lab" in setup


@pytest.mark.parametrize("args", [["demo"], ["bench"], ["bench-ranks"]])
def test_commands_that_draw_fail_first_without_matplotlib(monkeypatch, args):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and HINT in out.output, out.output
    assert "starting" not in out.output


def test_no_module_imports_matplotlib_until_it_draws(fresh_imports):
    assert "matplotlib" not in fresh_imports["drawing commands"], "matplotlib was imported"
