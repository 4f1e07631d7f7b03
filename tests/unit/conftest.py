"""Fixtures shared by the unit tests."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import uuid
from types import SimpleNamespace

import pytest

from tests.unit.fakes import FakeDistributedStore, FakeReplicateConfig


@pytest.fixture
def fake_mooncake(monkeypatch):
    """``mooncake.store`` replaced by ``FakeDistributedStore`` and
    ``FakeReplicateConfig`` (answers reset), ``MC_TCP_BIND_ADDRESS`` unset; returns the
    fake store class (``made``: every store made)."""
    monkeypatch.setitem(sys.modules, "mooncake.store",
                        SimpleNamespace(MooncakeDistributedStore=FakeDistributedStore,
                                        ReplicateConfig=FakeReplicateConfig,
                                        ReplicaStatus=SimpleNamespace(COMPLETE="done")))
    monkeypatch.delenv("MC_TCP_BIND_ADDRESS", raising=False)
    FakeDistributedStore.made, FakeDistributedStore.rc = [], 0
    FakeDistributedStore.dummy_rcs = []
    return FakeDistributedStore


@pytest.fixture
def shm_prefix():
    """A fresh ``/dev/shm`` name prefix of a node's pools; every file under it is removed
    after the test."""
    prefix = f"raykv.test-{uuid.uuid4().hex[:8]}."
    yield prefix
    for path in glob.glob(os.path.join("/dev/shm", glob.escape(prefix) + "*")):
        os.unlink(path)


FRESH_IMPORTS = {
    "control plane": ["raykv", "raykv.clusters.cli", "raykv.clusters.control_plane",
                      "raykv.controllers.controller", "raykv.clusters.master_supervisor",
                      "raykv.cache_actors.node.node_actor"],
    "integrations": ["raykv.integrations"],
    "sglang benchmarks": ["raykv_lab.bench.sglang", "raykv_lab.bench.sglang_runner"],
    "sglang package": ["raykv.integrations.sglang", "raykv.integrations.sglang.config",
                       "raykv.integrations.sglang.pools", "raykv.integrations.sglang.transfers",
                       "raykv.integrations.sglang.serving"],
    "drawing commands": ["raykv_lab.demo.example_demo", "raykv_lab.demo.chat",
                         "raykv_lab.bench.dataplane", "raykv_lab.bench.ranks"],
}
"""Groups of modules, imported in this order by ``fresh_imports``."""
WATCHED = ("torch", "sglang", "matplotlib")

_IMPORT_GROUPS = """
import importlib, json, sys
seen = {}
for group, modules in json.loads(sys.argv[1]).items():
    for module in modules:
        importlib.import_module(module)
    seen[group] = [m for m in json.loads(sys.argv[2]) if m in sys.modules]
print(json.dumps(seen))
"""


@pytest.fixture(scope="session")
def fresh_imports() -> dict[str, set[str]]:
    """For each group of ``FRESH_IMPORTS``, imported in turn in one fresh interpreter:
    which ``WATCHED`` modules were imported by then (cumulative: a module a group
    imports shows in every later group too). One interpreter for every import check of
    the suite: each costs seconds on a small machine."""
    out = subprocess.run([sys.executable, "-c", _IMPORT_GROUPS, json.dumps(FRESH_IMPORTS),
                          json.dumps(WATCHED)], check=True, capture_output=True, text=True,
                         timeout=180)
    return {k: set(v) for k, v in json.loads(out.stdout.splitlines()[-1]).items()}
