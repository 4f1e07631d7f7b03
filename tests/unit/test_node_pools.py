"""The node's pool table under re-allocation: a data call resolving its batch while the
pools are being replaced gets ``StalePoolsError``, never a ``ValueError`` (fake store and
memory; the real race is in tests/integration/test_standalone.py)."""

import threading
import uuid
from dataclasses import dataclass
from itertools import count

import pytest
from raykv.cache_actors.errors import StalePoolsError
from raykv.cache_actors.host_pools import PoolHandle
from raykv.cache_actors.node_pools import NodePools
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.pool_layout import PoolLayout

LAYOUT = PoolLayout.mla(page_size=1, size=4, layer_num=1, kv_cache_dim=8, dtype="uint8",
                        itemsize=1)


@dataclass
class FakePool:
    handle: PoolHandle
    base_ptr: int

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def nbytes(self) -> int:
        return self.handle.layout.nbytes

    def check(self) -> None:
        """Fake memory never shrinks."""


class FakeMemory:
    """Standalone-like: a new epoch per ``renew``; ``create`` may be held at ``gate``."""

    def __init__(self) -> None:
        self.epoch = 1
        self.gate = threading.Event()
        self.gate.set()
        self.creating = threading.Event()
        self._addresses = count(1 << 20, 1 << 12)

    def renew(self) -> None:
        self.epoch += 1

    def create(self, name: str, layout: PoolLayout) -> FakePool:
        self.creating.set()
        self.gate.wait()
        return FakePool(PoolHandle(name, f"fake-{name}", layout, self.epoch),
                        next(self._addresses))

    def release(self, pool: FakePool, remove: bool = True) -> None:
        pass


class FakeBackend:
    def register(self, ptr: int, nbytes: int) -> None:
        pass

    def unregister(self, ptr: int) -> None:
        pass


@dataclass
class FakeStore:
    memory: FakeMemory
    backend: FakeBackend

    def check(self) -> int:
        return self.memory.epoch


@pytest.fixture
def pools():
    store = FakeStore(FakeMemory(), FakeBackend())
    node = NodePools(f"raykv.test-{uuid.uuid4().hex[:8]}.", store, lambda name, n: None)
    yield node, store.memory
    store.memory.gate.set()
    node.close(remove=True)


def batch_of(handle: PoolHandle) -> ObjectBatch:
    batch = ObjectBatch(epoch=handle.epoch)
    batch.add("k", handle.name, 8, 8)
    return batch


def test_a_call_during_reallocation_sees_a_stale_generation_not_a_missing_pool(pools):
    node, memory = pools
    old = node.create("kv", LAYOUT)
    assert node.table.pointers(batch_of(old)) == [node.table.pools["kv"].base_ptr + 8]

    memory.gate.clear()
    memory.creating.clear()
    realloc = threading.Thread(target=node.reallocate)
    realloc.start()
    assert memory.creating.wait(5)  # old pool released, new one not yet made
    with pytest.raises(StalePoolsError, match="allocated anew"):
        node.table.pointers(batch_of(old))
    settled = []
    reader = threading.Thread(target=lambda: settled.append(node.settled()))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # control reads wait for the full table
    memory.gate.set()
    realloc.join(5)
    reader.join(5)

    new = node.handle("kv", "test")
    assert new.epoch == old.epoch + 1 and settled[0] is node.table
    with pytest.raises(StalePoolsError):
        node.table.pointers(batch_of(old))
    assert node.table.pointers(batch_of(new)) == [node.table.pools["kv"].base_ptr + 8]


def test_a_table_once_read_never_changes(pools):
    node, _ = pools
    node.create("kv", LAYOUT)
    snapshot = node.table
    node.create("draft", LAYOUT)
    node.destroy("kv")
    assert set(snapshot.pools) == {"kv"} and set(node.table.pools) == {"draft"}
    with pytest.raises(TypeError):
        snapshot.pools["x"] = None
