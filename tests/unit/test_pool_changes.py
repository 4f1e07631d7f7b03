"""No lock is held across a pool's allocation, registration or drain (fake store and
memory, one pool's allocation or registration held open at a gate): while one pool is
being made or drained, the table is read, ``settled`` answers, other pools are made,
attached and destroyed; a second create of the pool being made waits for it and attaches
it; a tenant's pools being made count against its quota. Each test failed on the old
``NodePools``, which held its lock across all of that (the readers below never returned
before the gate opened)."""

from __future__ import annotations

import threading
import uuid

import pytest
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.node.node_pools import NodePools
from raykv.controllers.ownership import Owner
from raykv.controllers.pool_layout import PoolLayout

from tests.unit.fakes import FakeBackend, FakeMemory, FakePool
from tests.unit.test_node_pools import LAYOUT, FakeStore, batch_of

ANSWER_S = 10.0  # "returns at all": far above any healthy call, only against hangs


class GatedMemory(FakeMemory):
    """``create`` of the pools named in ``held`` waits at ``gate`` (after setting
    ``creating``); every other pool is made at once."""

    def __init__(self, *held: str) -> None:
        super().__init__()
        self.held = set(held)
        self.gate.clear()

    def create(self, name: str, layout: PoolLayout) -> FakePool:
        if name in self.held:
            return super().create(name, layout)
        self.budget.reserve(name, layout.nbytes)
        return FakePool(PoolHandle(name, f"fake-{name}", layout, self.epoch),
                        next(self._addresses))


class GatedBackend(FakeBackend):
    """``register`` of a pool of ``nbytes`` waits at ``gate``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.registering = threading.Event()
        self.held_nbytes = -1

    def register(self, ptr: int, nbytes: int) -> None:
        if nbytes == self.held_nbytes:
            self.registering.set()
            self.gate.wait()
        super().register(ptr, nbytes)


def start(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the assertion
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def done(fn, *args) -> list:
    """What ``fn(*args)`` returned, called in a thread that must end (``ANSWER_S``)."""
    t, out = start(fn, *args)
    t.join(ANSWER_S)
    assert not t.is_alive(), f"{fn.__name__} did not return"
    return out


@pytest.fixture
def gated():
    memory = GatedMemory("big")
    store = FakeStore(memory, FakeBackend())
    node = NodePools(f"raykv.test-{uuid.uuid4().hex[:8]}.", store, lambda *_: None,
                     quotas={"t": 3 * LAYOUT.nbytes})
    yield node, memory
    memory.gate.set()
    node.close(remove=True)


def test_a_pool_being_allocated_blocks_no_other_change_and_no_read(gated):
    node, memory = gated
    node.create("old", LAYOUT)
    making, made = start(node.create, "big", LAYOUT)
    assert memory.creating.wait(ANSWER_S)  # "big" is inside its allocation, held there
    assert set(done(node.settled)[0].pools) == {"old"}
    assert done(node.create, "other", LAYOUT)[0].name == "other"
    assert done(node.handle, "old", "n")[0].name == "old"
    assert done(node.destroy, "old") == [True]
    assert done(node.tenants)[0][None].pools == 1  # "other"
    again, attached = start(node.create, "big", LAYOUT)  # waits for the first "big"
    assert making.is_alive() and again.is_alive() and not made and not attached
    memory.gate.set()
    making.join(ANSWER_S)
    again.join(ANSWER_S)
    assert made[0] == attached[0] == node.table.pools["big"].handle


def test_a_pool_being_registered_blocks_no_other_change():
    backend = GatedBackend()
    store = FakeStore(FakeMemory(), backend)
    node = NodePools(f"raykv.test-{uuid.uuid4().hex[:8]}.", store, lambda *_: None)
    big = PoolLayout.mla(page_size=1, size=8, layer_num=1, kv_cache_dim=8, dtype="uint8",
                         itemsize=1)
    backend.held_nbytes = big.nbytes
    making, made = start(node.create, "big", big)
    assert backend.registering.wait(ANSWER_S)
    assert done(node.create, "small", LAYOUT)[0].name == "small"
    assert set(done(node.settled)[0].pools) == {"small"}
    assert making.is_alive() and not made
    backend.gate.set()
    making.join(ANSWER_S)
    assert made[0] == node.table.pools["big"].handle
    node.close(remove=True)


def test_a_drain_blocks_no_other_change_and_no_read(gated):
    """A destroy waits for the call in flight on its pool (up to ``DRAIN_S``); other
    pools are made and read meanwhile, and the destroy ends when the call leaves."""
    node, _ = gated
    handle = node.create("a", LAYOUT)
    table = node.table
    _, used = table.resolve(batch_of(handle))
    node.enter(table, used)  # a data call in flight on "a"
    destroying, destroyed = start(node.destroy, "a")
    destroying.join(0.2)
    assert destroying.is_alive()  # draining
    assert "a" not in node.table.pools  # out of the table: new calls refused
    assert done(node.create, "b", LAYOUT)[0].name == "b"
    assert set(done(node.settled)[0].pools) == {"b"}
    assert destroying.is_alive() and not destroyed  # still draining meanwhile
    node.leave(used)
    destroying.join(ANSWER_S)
    assert destroyed == [True]


def test_pools_being_made_count_against_their_tenant_s_quota(gated):
    """The quota holds three pools; one is held in its allocation: a fourth create of
    the tenant is refused even though the table shows only two."""
    node, memory = gated
    owner = Owner("dep", "t")
    node.create("x1", LAYOUT, owner=owner)
    node.create("x2", LAYOUT, owner=owner)
    memory.held.add("x3")
    making, _ = start(node.create, "x3", LAYOUT, None, owner)
    assert memory.creating.wait(ANSWER_S)
    refused = done(node.create, "x4", LAYOUT, None, owner)[0]
    assert isinstance(refused, ValueError) and "over its quota" in str(refused)
    memory.gate.set()
    making.join(ANSWER_S)
    assert node.tenants()["t"].pools == 3
