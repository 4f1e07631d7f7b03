"""matplotlib is only in the extras that draw: without it, raykv imports, and the demo
and benchmark commands fail at once (before any cluster starts) naming the extra."""

import importlib.util
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from raykv.clusters import plotting
from raykv.clusters.cli import main


def test_figure_class_names_the_extra(monkeypatch):
    assert plotting.figure_class("bench").__name__ == "Figure"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    with pytest.raises(plotting.MissingExtraError, match=r"pip install -e '\.\[demo\]'"):
        plotting.figure_class("demo")


@pytest.mark.parametrize("extra", ["demo", "bench"])
def test_hint_installs_from_the_clone_as_the_readme_does(monkeypatch, extra):
    """raykv is not on the package index: the hint is the README's install from a clone
    (``pip install -e '.[extra]'`` in its root), never ``pip install 'raykv[extra]'``,
    which would look raykv up on the index."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    with pytest.raises(plotting.MissingExtraError) as e:
        plotting.require_matplotlib(extra)
    hint = str(e.value)
    assert f"pip install -e '.[{extra}]' in raykv's clone" in hint, hint
    assert "'raykv[" not in hint, hint
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert f"'.[{extra}]'" in readme or f"`.[{extra}]`" in readme


@pytest.mark.parametrize(("args", "extra"), [(["demo"], "demo"), (["bench"], "bench"),
                                             (["bench-ranks"], "bench")])
def test_commands_that_draw_fail_first_without_matplotlib(monkeypatch, args, extra):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and f"pip install -e '.[{extra}]'" in out.output, out.output
    assert "starting" not in out.output


def test_no_module_imports_matplotlib_until_it_draws(fresh_imports):
    assert "matplotlib" not in fresh_imports["drawing commands"], "matplotlib was imported"
