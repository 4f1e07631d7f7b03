"""matplotlib is only in the extras that draw: without it, raykv imports, and the demo
and benchmark commands fail at once (before any cluster starts) naming the extra."""

import importlib.util
import sys

import pytest
from click.testing import CliRunner
from raykv.clusters import plotting
from raykv.clusters.cli import main


def test_figure_class_names_the_extra(monkeypatch):
    assert plotting.figure_class("bench").__name__ == "Figure"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "matplotlib.figure", raising=False)
    with pytest.raises(plotting.MissingExtraError, match=r"raykv\[demo\]"):
        plotting.figure_class("demo")


@pytest.mark.parametrize(("args", "extra"), [(["demo"], "demo"), (["bench"], "bench"),
                                             (["bench-ranks"], "bench")])
def test_commands_that_draw_fail_first_without_matplotlib(monkeypatch, args, extra):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 1 and f"pip install 'raykv[{extra}]'" in out.output, out.output
    assert "starting" not in out.output


def test_no_module_imports_matplotlib_until_it_draws():
    import subprocess

    code = ("import sys, raykv.clusters.cli, raykv.clusters.demo.example_demo, "
            "raykv.clusters.demo.chat, raykv.clusters.bench.dataplane, "
            "raykv.clusters.bench.ranks, raykv.clusters.bench.sglang; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
