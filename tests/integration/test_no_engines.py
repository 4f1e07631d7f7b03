"""The README's test commands for an environment ``scripts/setup.sh --no-engines`` made
(no vLLM, transformers, Ray Serve or SGLang venv), run in this one with the engines made
unimportable (``tests/no_engines/sitecustomize.py`` on ``PYTHONPATH``, for this process's
children too, and no SGLang venv): under ``RAYKV_NO_ENGINES=1`` every unit test module
imports (all are collected), every unit test of a module that names an engine or the
integrations passes or is skipped saying which engine it needs (the other modules,
``other_modules``, are deselected: an engine's absence cannot change their outcome), and
every integration test marked with an engine is skipped before it starts anything.
Control: without ``RAYKV_NO_ENGINES`` a test that needs a missing engine fails, naming
what installs it (a full environment whose engine install broke never skips)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE_WORDS = re.compile(r"vllm|sglang|transformers|ray\.serve|from ray import serve|"
                          r"integrations|mark\.engine|require\(")
"""What a unit test module that needs an engine, or code that imports one, names."""


def other_modules() -> list[str]:
    """The unit test modules that name no engine nor the integrations: they run the same
    with or without engines (their imports are checked by collecting them)."""
    return sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests" / "unit").glob("test_*.py")
                  if not ENGINE_WORDS.search(p.read_text()))


def pytest_without_engines(*args: str, no_engines: bool = True,
                           timeout: int = 1200) -> subprocess.CompletedProcess:
    """``python -m pytest -q ARGS`` in a child whose Python finds no engine."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAYKV_NO_ENGINES", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "tests" / "no_engines"), *filter(None, [env.get("PYTHONPATH")])])
    env["RAYKV_SGLANG_PYTHON"] = str(ROOT / "no-sglang-venv" / "python")
    if no_engines:
        env["RAYKV_NO_ENGINES"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                           "no:cacheprovider", "-rs", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def counts(out: str) -> dict[str, int]:
    """pytest's last summary line as counts: ``{"passed": 964, "skipped": 32}``."""
    last = out.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|"
                                                   r"deselected)", last)}


def test_the_unit_tests_pass_or_skip_without_engines():
    others = other_modules()
    assert "tests/unit/test_vllm_kv_events.py" not in others and len(others) > 50, others
    run = pytest_without_engines("tests/unit", *(f"--deselect={m}" for m in others))
    found = counts(run.stdout)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "failed" not in found and "error" not in found and "errors" not in found, found
    assert found["passed"] > 250 and found["skipped"] > 0 and found["deselected"] > 500, found
    assert "needs vllm" in run.stdout and "needs transformers" in run.stdout


def test_the_integration_tests_that_need_an_engine_skip_without_one():
    run = pytest_without_engines("tests/integration", "tests/peers", "-m", "engine")
    found = counts(run.stdout)
    assert run.returncode == 0, run.stdout[-6000:]
    assert set(found) == {"skipped", "deselected"}, found
    for engine in ("vllm", "sglang", "ray.serve"):
        assert f"needs {engine}" in run.stdout, engine


def test_control_without_raykv_no_engines_a_missing_engine_fails():
    run = pytest_without_engines("tests/unit/test_vllm_kv_events.py", "-m", "engine",
                                 no_engines=False)
    found = counts(run.stdout)
    assert run.returncode == 1 and found.get("errors", 0) == 3 and "skipped" not in found, \
        run.stdout[-4000:]
    assert "vllm is missing: install" in run.stdout
