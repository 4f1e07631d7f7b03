"""A data call that ran while the node's pools were allocated anew (standalone mode,
``mooncake_client`` restarted) never ends as a success: its bytes may have come from
released, zero-filled memory, so a put's stored objects are removed and the call raises
the retryable ``StalePoolsError`` (fake store and memory; the real race with a killed
``mooncake_client`` is in tests/integration/test_standalone.py)."""

import logging
import threading
import uuid

import pytest
from raykv.cache_actors.errors import StalePoolsError
from raykv.cache_actors.node.node_service import NodeService
from raykv.controllers.object_batch import ObjectBatch
from raykv.controllers.result_codes import ALREADY_PRESENT

from tests.unit.fakes import FakeBackend, FakeMemory, NoMetrics, ServiceStore
from tests.unit.test_node_pools import LAYOUT


class FakeStore(ServiceStore):
    def __init__(self) -> None:
        self.memory = FakeMemory()
        self.backend = FakeBackend({"present": 1})
        self.mode = "standalone"


class FakeMetrics(NoMetrics):
    """Records the moves a ``NodeService`` counts."""

    def __init__(self) -> None:
        self.moves: list[str] = []

    def record_move(self, op, batch, codes, seconds) -> None:
        self.moves.append(op)


@pytest.fixture
def node():
    store, metrics = FakeStore(), FakeMetrics()
    service = NodeService("fake-node-id", f"raykv.test-{uuid.uuid4().hex[:8]}.", store,
                          metrics, lambda _: None, segment_size=0, group_window_s=0.0,
                          confirm_ttl_s=0.0)
    handle = service.create_pool("kv", LAYOUT)
    batch = ObjectBatch(epoch=handle.epoch)
    batch.extend(["a", "present", "b"], "kv", [0, 8, 16], [8, 8, 8])
    watcher: list[threading.Thread] = []

    def reallocate_now() -> None:
        """The watcher re-allocating on its own thread while the store call runs: the
        call returns once the new epoch is published (the old pools are released only
        after it left them)."""
        epoch = service._pools.table.epoch
        t = threading.Thread(target=store.reallocate)
        t.start()
        watcher.append(t)
        while service._pools.table.epoch == epoch:
            t.join(0.001)

    store.backend.reallocate_now = reallocate_now
    yield service, store, metrics, batch
    for t in watcher:
        t.join(10)
        assert not t.is_alive()
    service.shutdown(remove_pools=True)


def test_a_put_that_ran_across_a_reallocation_is_not_kept(node):
    service, store, metrics, batch = node
    store.backend.during = store.backend.reallocate_now  # mid-transfer
    with pytest.raises(StalePoolsError, match="allocated anew during the put"):
        service.put(batch)
    # What this call stored is gone; what was there before it is left alone.
    assert store.backend.removed == ["a", "b"]
    assert set(store.backend.objects) == {"present"}
    assert metrics.moves == []  # not counted as moved


def test_a_get_that_ran_across_a_reallocation_fails(node):
    service, store, metrics, batch = node
    store.backend.during = store.backend.reallocate_now
    with pytest.raises(StalePoolsError, match="allocated anew during the get"):
        service.get(batch)
    assert store.backend.removed == []


def test_control_without_a_reallocation_the_same_calls_succeed(node):
    service, store, metrics, batch = node
    assert service.put(batch) == [0, ALREADY_PRESENT, 0]
    assert service.get(batch) == [8, 8, 8]
    assert store.backend.removed == [] and metrics.moves == ["put", "get"]
    # After a re-allocation between calls (not during one), the old batch is stale
    # before any byte moves.
    store.reallocate()
    with pytest.raises(StalePoolsError):
        service.put(batch)
    assert store.backend.removed == []


def test_objects_that_could_not_be_removed_are_logged_without_their_keys(node, caplog):
    """A tenant's keys name its objects: the warning counts them, never names one
    (CONTROL: the warning is there)."""
    service, store, _, batch = node
    keyed = ObjectBatch(epoch=batch.epoch)
    keyed.extend(["m_keyed-hash-1", "m_keyed-hash-2"], "kv", [0, 8], [8, 8])
    store.backend.during = store.backend.reallocate_now
    store.backend.remove = lambda keys: [-1] * len(keys)
    with caplog.at_level(logging.WARNING), pytest.raises(StalePoolsError):
        service.put(keyed)
    assert "2 objects put while the pools were replaced could not be removed" in caplog.text
    assert "keyed-hash" not in caplog.text
