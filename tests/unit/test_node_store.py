"""NodeStore against the shared fakes of its backend and pool memory and a fake
``mooncake_client`` process (no Mooncake): when a data call may start, when its codes
mean "the store went down" rather than per-object errors, health, stats, and the
supervision hand-over."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from raykv.cache_actors.errors import NodeUnavailableError, StoreUnavailableError
from raykv.cache_actors.node import node_store
from raykv.cache_actors.node.node_store import PROBE_KEY, NodeStore
from raykv.cache_actors.node.pool_memory import PoolBudget
from raykv.controllers.node_records import ClientProcess, as_dict

from tests.unit.fakes import FakeBackend, FakeMemory


class FakeProcess:
    def __init__(self) -> None:
        self.down = threading.Event()
        self.record = SimpleNamespace(port=4242)
        self.is_alive = True
        self.watched = None
        self.stopped = False

    def alive(self) -> bool:
        return self.is_alive

    def info(self) -> ClientProcess:
        return ClientProcess(pid=7, port=4242, adopted=False, restarts=0, alive=True)

    def watch(self, on_restart) -> None:
        self.watched = on_restart

    def stop(self) -> None:
        self.stopped = True


def memory(epoch: int = 3, mode: str = "standalone") -> FakeMemory:
    """The shared fake pool memory at ``epoch`` in ``mode``, 4 KiB of 1 MiB used."""
    out = FakeMemory()
    out.epoch, out.mode, out.budget = epoch, mode, PoolBudget(1 << 20)
    out.budget.used = 4096
    return out


def standalone() -> tuple[NodeStore, FakeProcess]:
    process = FakeProcess()
    return NodeStore(FakeBackend(), memory(), process), process


def test_embedded_calls_always_start_and_keep_their_codes():
    store = NodeStore(FakeBackend(), memory(7, "embedded"))
    assert store.before_call() == 7 and store.mode == "embedded"
    assert store.after_call(7, [0, -800, -900]) == [0, -800, -900]  # per-object errors
    assert store.after_call(6, [-1]) == [-1]  # embedded pool memory never changes epoch
    stats = store.stats()
    assert (stats.mooncake_client, stats.tiers) == (None, None)
    # as JSON: the dict the node answered before its stats were records, the process
    # and the tiers left out (an embedded node, no seals)
    assert as_dict(stats) == {"mode": "embedded", "host_pool_bytes": 1 << 20,
                              "host_pool_used": 4096, "exposed_ports": [],
                              "mooncake_endpoint": "10.213.0.2:12345",
                              "own_segment": "10.213.0.2:12345"}


def test_no_call_starts_while_mooncake_client_is_down():
    store, process = standalone()
    assert store.before_call() == 3
    process.down.set()
    with pytest.raises(StoreUnavailableError, match="port 4242 is down") as e:
        store.before_call()
    assert isinstance(e.value, NodeUnavailableError)  # retryable


@pytest.mark.parametrize("what", ["down", "dead", "epoch"])
def test_failed_objects_of_a_call_the_client_went_down_during_are_an_outage(what):
    store, process = standalone()
    if what == "down":
        process.down.set()
    elif what == "dead":
        process.is_alive = False
    else:
        store.memory.epoch = 4  # the pools were allocated anew meanwhile
    with pytest.raises(StoreUnavailableError, match="went down during the call"):
        store.after_call(3, [0, -900])
    assert store.after_call(3, [0, 1, 5]) == [0, 1, 5]  # nothing failed: kept


def test_failed_objects_with_the_client_up_are_per_object_errors():
    store, _ = standalone()
    assert store.after_call(3, [0, -704, -800]) == [0, -704, -800]


def test_health():
    store = NodeStore(FakeBackend(), memory(mode="embedded"))
    assert store.healthy()
    store.backend.health = -1
    assert not store.healthy()
    store, process = standalone()
    store.backend.health = -1  # the dummy's health is the process's
    assert store.healthy()
    process.down.set()
    assert not store.healthy()
    process.down.clear()
    process.is_alive = False
    assert not store.healthy()


def test_standalone_stats_name_the_process_and_close_stops_it():
    store, process = standalone()
    assert store.stats().mooncake_client.port == 4242
    assert as_dict(store.stats())["mooncake_client"] == {
        "pid": 7, "port": 4242, "adopted": False, "restarts": 0, "alive": True}
    store.close()
    assert store.backend.closed and process.stopped


def test_supervise_reallocates_once_the_dummy_reconnected(monkeypatch):
    monkeypatch.setattr(node_store.time, "sleep", lambda s: None)
    store, process = standalone()
    store.backend.exists_codes = [-900, -1, 0]  # unreachable twice, then answering
    done: list[int] = []
    store.supervise(lambda: done.append(len(store.backend.probes)))
    process.watched()  # the watcher restarted mooncake_client
    assert done == [3] and store.backend.probes == [[PROBE_KEY]] * 3


def test_supervise_gives_up_if_the_dummy_never_reconnects(monkeypatch):
    clock = iter(range(0, 1000, 10))
    monkeypatch.setattr(node_store.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(node_store.time, "sleep", lambda s: None)
    store, process = standalone()
    store.backend.exists_codes = [-900] * 100
    store.supervise(lambda: pytest.fail("reallocated without a store"))
    with pytest.raises(RuntimeError, match="did not reconnect"):
        process.watched()


def test_embedded_has_nothing_to_supervise():
    store = NodeStore(FakeBackend(), memory(mode="embedded"))
    store.supervise(lambda: pytest.fail("no process to restart"))


def test_standalone_without_a_pool_budget_is_refused_before_mooncake():
    with pytest.raises(ValueError, match="host_pool_bytes > 0"):
        NodeStore.open("p.", standalone=True, host="h", master_address="m:1",
                       metadata_server="P2PHANDSHAKE", segment_size=1, local_buffer_size=1,
                       protocol="tcp", rdma_devices="", host_pool_bytes=0)
