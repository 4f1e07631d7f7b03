"""Running an engine's own tests in a pytest of their own (the engine's python, the
engine's test folder as root, one of this folder's plugins loaded) and reading back
each test's outcome from pytest's JUnit XML report."""

from __future__ import annotations

import os
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parent


@dataclass
class Outcome:
    """One test case of the engine's run: ``nodeid`` (module::name[params]), ``status``
    (``passed``, ``failed``, ``error`` or ``skipped``), ``message`` (why not passed)."""

    nodeid: str
    status: str
    message: str = ""


def run_pytest(python: str, root: Path, targets: list[str], plugin: str, env: dict,
               tmp: Path, timeout_s: int) -> tuple[list[Outcome], str]:
    """Run ``python -m pytest`` in ``root`` on ``targets`` (node ids or files) with
    ``-p plugin`` (a module of this folder), ``env`` added to this process's environment;
    each case's outcome and the run's output tail."""
    report = tmp / "junit.xml"
    ini = tmp / "pytest.ini"
    ini.write_text("[pytest]\n")  # none of the engine's own pytest options
    full = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    full |= env | {"PYTHONPATH": str(PEERS)}
    cmd = [python, "-m", "pytest", "-c", str(ini), "--rootdir", str(root), "-p", plugin,
           "-p", "no:cacheprovider", "-q", "-rfEs", f"--junitxml={report}",
           "--confcutdir", str(root / "tests" / "v1") if (root / "tests").is_dir() else str(root),
           *targets]
    try:
        proc = subprocess.run(cmd, cwd=root, env=full, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the engine's tests ran over {timeout_s} s:\n"
                    f"{(e.stdout or b'')[-4000:]!r}", pytrace=False)
    tail = (proc.stdout + proc.stderr)[-6000:]
    if not report.exists():
        pytest.fail(f"the engine's pytest wrote no report (rc {proc.returncode}):\n{tail}",
                    pytrace=False)
    return parse_junit(report), tail


def parse_junit(report: Path) -> list[Outcome]:
    """The outcomes in a JUnit XML ``report``."""
    out = []
    for case in ET.parse(report).getroot().iter("testcase"):
        nodeid = f"{case.get('classname')}::{case.get('name')}"
        status, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                status = {"failure": "failed"}.get(kind, kind)
                message = (el.get("message") or "") + "\n" + (el.text or "")[-3000:]
                break
        out.append(Outcome(nodeid, status, message.strip()))
    return out


def outcomes_of(outcomes: list[Outcome], selector: str) -> list[Outcome]:
    """The cases of ``selector``: ``file::function`` (every parametrization of it) or
    ``file::function[id]`` (that case)."""
    path, _, name = selector.partition("::")
    want = path.removesuffix(".py").replace("/", ".") + "::" + name
    if "[" in name:
        return [o for o in outcomes if o.nodeid == want]
    return [o for o in outcomes if o.nodeid.split("[")[0] == want]


def assert_all_passed(outcomes: list[Outcome], selector: str, tail: str) -> None:
    """Every case of ``selector`` ran and passed (a skip is a failure here)."""
    cases = outcomes_of(outcomes, selector)
    if not cases:
        pytest.fail(f"{selector}: not collected in the engine's run:\n{tail}", pytrace=False)
    bad = [c for c in cases if c.status != "passed"]
    if bad:
        pytest.fail("\n\n".join(f"{c.nodeid}: {c.status}\n{c.message}" for c in bad),
                    pytrace=False)
