"""Fixtures shared by the unit tests."""

from __future__ import annotations

import sys
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
