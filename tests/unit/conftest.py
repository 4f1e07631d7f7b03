"""Fixtures shared by the unit tests."""

from __future__ import annotations

import glob
import os
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
                                        ReplicateConfig=FakeReplicateConfig))
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
