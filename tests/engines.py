"""Which inference engines this environment has, for the tests that need one.

A test that needs an engine says so with ``@pytest.mark.engine(NAME)`` (``tests/conftest.py``
checks it before the test runs) or calls ``require(NAME)``. Where the engine is missing:
with ``RAYKV_NO_ENGINES=1`` in the environment (an environment ``scripts/setup.sh
--no-engines`` made) the test is skipped, saying what it needs; otherwise it fails,
saying how to install it, so a full environment whose engine install broke fails
instead of skipping. Where the engine is there, the test runs either way."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import pytest

NO_ENGINES = "RAYKV_NO_ENGINES"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG_PY = os.environ.get("RAYKV_SGLANG_PYTHON") or os.path.join(REPO, ".venv-sglang", "bin",
                                                                  "python")
"""The SGLang venv's python (``scripts/sglang-venv.sh``), which the SGLang tests drive."""

INSTALL = {
    "vllm": "vLLM: raykv_lab.install_hints.vllm_install_hint says how",
    "transformers": "transformers, which vLLM brings (scripts/setup.sh)",
    "ray.serve": "Ray Serve, ray[serve] of the cluster's Ray version (scripts/setup.sh)",
    "sglang": f"the SGLang venv at {SGLANG_PY} (scripts/sglang-venv.sh, or point "
              "RAYKV_SGLANG_PYTHON at a python with sglang==0.5.23 and raykv installed)",
}
"""Every engine a test may name, and what installs it."""


def present(engine: str) -> bool:
    """Whether ``engine`` (a key of ``INSTALL``) can be used here. Ray Serve ships inside
    Ray's wheel without the packages it imports, so it is imported (in a child process,
    once per process) rather than looked up."""
    if engine == "sglang":
        return os.path.exists(SGLANG_PY)
    if engine == "ray.serve":
        return _imports("ray.serve")
    if engine not in INSTALL:
        raise ValueError(f"unknown engine {engine!r}: one of {sorted(INSTALL)}")
    return importlib.util.find_spec(engine) is not None


@functools.cache
def _imports(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"],
                          capture_output=True, timeout=300).returncode == 0


def require(engine: str) -> None:
    """Return if ``engine`` is here; else skip the test under ``RAYKV_NO_ENGINES=1`` and
    fail it otherwise, naming what installs it."""
    if present(engine):
        return
    if os.environ.get(NO_ENGINES) == "1":
        pytest.skip(f"needs {engine}, which {NO_ENGINES}=1 says this environment lacks")
    how = INSTALL[engine]
    if engine == "vllm":
        from raykv_lab.install_hints import vllm_install_hint

        how = vllm_install_hint()
    pytest.fail(f"{engine} is missing: install {how}, or set {NO_ENGINES}=1 to skip the tests "
                "that need it", pytrace=False)
