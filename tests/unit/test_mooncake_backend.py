"""MooncakeBackend's code mapping against a fake ``MooncakeDistributedStore`` (no
Mooncake): one code per object, never an exception for a store error, put-if-absent
that reports stored only what the store then reports existing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from raykv.cache_actors.node.mooncake_backend import MooncakeBackend
from raykv.controllers.result_codes import (
    ALREADY_PRESENT,
    CLIENT_ERROR,
    NOT_CONFIRMED,
    TRANSFER_FAIL,
)


class FakeStore:
    """Objects in ``objects`` exist; ``put_codes`` (key -> code) overrides what a put
    answers; a key in ``vanishing`` is accepted (0) but never comes to exist; ``raises``
    names the methods that raise."""

    def __init__(self, objects=()) -> None:
        self.objects = set(objects)
        self.put_codes: dict[str, int] = {}
        self.vanishing: set[str] = set()
        self.steerable: set[str] = set()  # TRANSFER_FAIL keys that a second put stores
        self.raises: set[str] = set()
        self.calls: list[tuple] = []

    def _enter(self, method: str, *args) -> None:
        self.calls.append((method, *args))
        if method in self.raises:
            raise RuntimeError(f"{method} failed")

    def batch_is_exist(self, keys):
        self._enter("batch_is_exist", list(keys))
        return [1 if k in self.objects else 0 for k in keys]

    def batch_put_from(self, keys, ptrs, sizes, config=None):
        self._enter("batch_put_from", list(keys), list(ptrs), list(sizes),
                    *(() if config is None else (config,)))
        out = []
        for k in keys:
            code = self.put_codes.get(k, 0)
            if code == TRANSFER_FAIL and k in self.steerable:
                self.put_codes[k] = 0  # placed on a live segment next time
            if code == 0 and k not in self.vanishing:
                self.objects.add(k)
            out.append(code)
        return out

    def batch_get_into(self, keys, ptrs, sizes):
        self._enter("batch_get_into", list(keys))
        return [s if k in self.objects else -704 for k, s in zip(keys, sizes, strict=True)]

    def batch_remove(self, keys, force):
        self._enter("batch_remove", list(keys), force)
        out = [0 if k in self.objects else -704 for k in keys]
        self.objects.difference_update(keys)
        return out

    def alloc_from_mem_pool(self, nbytes):
        self._enter("alloc_from_mem_pool", nbytes)
        return 0 if nbytes > 100 else 0x1000

    def register_buffer(self, ptr, nbytes):
        self._enter("register_buffer", ptr, nbytes)
        return -600 if nbytes > 100 else 0

    def unregister_buffer(self, ptr):
        self._enter("unregister_buffer", ptr)
        return -1

    def health_check(self):
        return 0 if "health" not in self.raises else 1


def test_put_skips_present_objects_and_confirms_the_sent_ones():
    store = FakeStore({"old"})
    backend = MooncakeBackend(store)
    assert backend.put(["old", "new"], [1, 2], [10, 20]) == [ALREADY_PRESENT, 0]
    assert store.calls == [("batch_is_exist", ["old", "new"]),
                           ("batch_put_from", ["new"], [2], [20]),
                           ("batch_is_exist", ["new"])]


def test_a_put_of_only_present_objects_sends_nothing():
    store = FakeStore({"a", "b"})
    assert MooncakeBackend(store).put(["a", "b"], [1, 2], [1, 1]) == [ALREADY_PRESENT] * 2
    assert [c[0] for c in store.calls] == ["batch_is_exist"]


def test_an_accepted_object_the_store_does_not_report_is_not_confirmed():
    store = FakeStore()
    store.vanishing = {"racing"}  # another writer's put of it still in flight
    assert MooncakeBackend(store).put(["racing", "fine"], [1, 2], [1, 1]) == [
        NOT_CONFIRMED, 0]


def test_put_errors_pass_through_and_are_not_confirmed():
    store = FakeStore()
    store.put_codes = {"full": -200}
    assert MooncakeBackend(store).put(["full", "ok"], [1, 2], [1, 1]) == [-200, 0]
    assert store.calls[-1] == ("batch_is_exist", ["ok"])  # only the 0s are confirmed


def test_a_put_that_raises_fails_the_sent_objects_only():
    store = FakeStore({"old"})
    store.raises = {"batch_put_from"}
    assert MooncakeBackend(store).put(["old", "a", "b"], [1, 2, 3], [1, 1, 1]) == [
        ALREADY_PRESENT, CLIENT_ERROR, CLIENT_ERROR]


def test_an_existence_call_that_raises_is_a_client_error_per_key():
    store = FakeStore({"a"})
    backend = MooncakeBackend(store)
    assert backend.exists(["a", "b"]) == [1, 0]
    store.raises = {"batch_is_exist"}
    assert backend.exists(["a", "b"]) == [CLIENT_ERROR] * 2
    # a put then cannot tell what exists, sends everything, and confirms nothing
    assert backend.put(["a", "b"], [1, 2], [1, 1]) == [NOT_CONFIRMED] * 2


def test_get_and_remove_codes():
    store = FakeStore({"a"})
    backend = MooncakeBackend(store)
    assert backend.get(["a", "b"], [1, 2], [7, 7]) == [7, -704]
    assert backend.remove(["a"]) == [0]
    assert store.calls[-1] == ("batch_remove", ["a"], True)  # forced: leases ignored
    store.raises = {"batch_get_into", "batch_remove"}
    assert backend.get(["a", "b"], [1, 2], [7, 7]) == [CLIENT_ERROR] * 2
    assert backend.remove(["a", "b"]) == [CLIENT_ERROR] * 2


def test_memory_calls_raise_on_failure_except_unregistering():
    store = FakeStore()
    backend = MooncakeBackend(store)
    assert backend.alloc(64) == 0x1000
    with pytest.raises(RuntimeError, match="alloc_from_mem_pool"):
        backend.alloc(4096)
    backend.register(0x1000, 64)
    with pytest.raises(RuntimeError, match="register_buffer.*-600"):
        backend.register(0x1000, 4096)
    backend.unregister(0x1000)  # logged, never raised: the pool is going anyway
    assert backend.healthy()
    store.raises = {"health"}
    assert not backend.healthy()


def test_embedded_setup_failure_names_its_code(fake_mooncake):
    fake_mooncake.rc = -1
    with pytest.raises(RuntimeError, match="setup failed with code -1 .master m:1"):
        MooncakeBackend.embedded(local_hostname="10.0.0.1", metadata_server="P2PHANDSHAKE",
                                 master_server_addr="m:1", global_segment_size=1,
                                 local_buffer_size=2)
    fake_mooncake.rc = 0
    backend = MooncakeBackend.embedded(
        local_hostname="10.0.0.1", metadata_server="P2PHANDSHAKE", master_server_addr="m:1",
        global_segment_size=1, local_buffer_size=2)
    assert fake_mooncake.made[-1].args == ("10.0.0.1", "P2PHANDSHAKE", 1, 2, "tcp", "", "m:1")
    # every put prefers this client's own segment
    assert backend._steer.preferred_segment == "10.0.0.1:12345"
    assert backend.own_segment == "10.0.0.1:12345"
    consumer = MooncakeBackend.embedded(
        local_hostname="10.0.0.1", metadata_server="P2PHANDSHAKE", master_server_addr="m:1",
        global_segment_size=0, local_buffer_size=2)
    assert consumer._steer is None and consumer.own_segment is None  # placed at random


def test_embedded_binds_its_host_over_an_inherited_loopback(fake_mooncake, monkeypatch):
    """A node of another host whose process inherited a driver's 127.0.0.1 binds its own
    address (control: the environment did say loopback before the client was made)."""
    import os

    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    backend = MooncakeBackend.embedded(
        local_hostname="10.213.0.2", metadata_server="P2PHANDSHAKE", master_server_addr="m:1",
        global_segment_size=1, local_buffer_size=2)
    assert os.environ["MC_TCP_BIND_ADDRESS"] == "10.213.0.2"
    assert backend.endpoint() == "10.213.0.2:12345"  # what the (fake) client advertises


def test_dummy_setup_is_retried_then_gives_up(fake_mooncake):
    fake_mooncake.dummy_rcs = [-1, -1, 0]
    MooncakeBackend.dummy(server_address="h:1", mem_pool_size=8, local_buffer_size=4,
                          up=lambda: True, attempts=3)
    assert fake_mooncake.made[-1].args == (8, 4, "h:1")
    fake_mooncake.dummy_rcs = [-1, -1, -5]
    with pytest.raises(RuntimeError, match="setup_dummy to h:1 failed with code -5"):
        MooncakeBackend.dummy(server_address="h:1", mem_pool_size=8, local_buffer_size=4,
                              up=lambda: True, attempts=3)


def test_puts_prefer_the_own_segment_and_a_dead_placement_is_retried_once(fake_mooncake):
    """Every put prefers the node's own segment (first puts too, not only retries); a
    ``TRANSFER_FAIL`` (a put placed on a dead client's segment) is put once more; a
    second failure keeps its code; other errors are never retried.
    (tests/integration/test_restart_puts.py: a real killed actor;
    tests/integration/test_residency.py: real placement.)"""
    store = FakeStore()
    backend = MooncakeBackend(store, "10.0.0.1:7")
    steer = backend._steer
    assert steer.preferred_segment == "10.0.0.1:7"
    store.put_codes = {"dead": TRANSFER_FAIL, "stuck": TRANSFER_FAIL, "full": -200}
    store.steerable = {"dead"}
    assert backend.put(["ok", "dead", "stuck", "full"], [1, 2, 3, 4], [8] * 4) == \
        [0, 0, TRANSFER_FAIL, -200]
    puts = [c for c in store.calls if c[0] == "batch_put_from"]
    assert puts == [("batch_put_from", ["ok", "dead", "stuck", "full"], [1, 2, 3, 4], [8] * 4,
                     steer),
                    ("batch_put_from", ["dead", "stuck"], [2, 3], [8, 8], steer)]
    assert "dead" in store.objects and "stuck" not in store.objects


def test_placement_any_leaves_every_put_to_mooncake(fake_mooncake):
    """``prefer_own_segment=False`` (``placement="any"``): the own segment is known
    (``locate``, stats) but no put names it, retries neither (the test above is this
    one's control). (tests/integration/test_put_confirm.py: a real master's placement.)"""
    store = FakeStore()
    store.put_codes = {"dead": TRANSFER_FAIL}
    backend = MooncakeBackend(store, "a:1", prefer_own_segment=False)
    assert backend.put(["a", "dead"], [1, 2], [8, 8]) == [0, TRANSFER_FAIL]
    assert backend.own_segment == "a:1"
    assert [len(c) for c in store.calls if c[0] == "batch_put_from"] == [4, 4]


def _replica(segment: str, status: str = "done", memory: bool = True):
    desc = SimpleNamespace(buffer_descriptor=SimpleNamespace(transport_endpoint=segment))
    return SimpleNamespace(status=status, is_memory_replica=lambda: memory,
                           get_memory_descriptor=lambda: desc)


class PlacingStore(FakeStore):
    """``batch_get_replica_desc`` answers where each object of ``where`` lies."""

    def __init__(self) -> None:
        super().__init__()
        self.where: dict[str, list] = {}

    def batch_get_replica_desc(self, keys):
        self._enter("batch_get_replica_desc", list(keys))
        return {k: self.where[k] for k in keys if k in self.where}


def test_locate_names_the_segments_of_complete_memory_replicas(fake_mooncake):
    store = PlacingStore()
    store.where = {"x": [_replica("a:1"), _replica("b:2")],
                   "writing": [_replica("a:1", status="processing")],
                   "disk": [_replica("a:1", memory=False)]}
    backend = MooncakeBackend(store)
    assert backend.locate(["x", "missing", "writing", "disk"]) == [("a:1", "b:2"), (), (), ()]
    store.raises.add("batch_get_replica_desc")
    assert backend.locate(["x"]) is None  # logged, never raised
    store.raises.clear()
    backend.can_locate = False  # a dummy client: never asks (its process cannot answer)
    asked = len(store.calls)
    assert backend.locate(["x"]) is None and len(store.calls) == asked


def test_a_drain_steers_puts_to_another_segment_and_undoing_it_steers_them_home(
        fake_mooncake):
    """``steer(peer)``: every put prefers the peer's segment and none counts as the
    node's own (``prefers_own``); ``steer(None)``: the own segment again, or with
    ``placement="any"`` Mooncake's choice again."""
    store = FakeStore()
    backend = MooncakeBackend(store, "a:1")
    backend.steer("b:2")
    assert backend._steer.preferred_segment == "b:2" and not backend.prefers_own
    backend.put(["x"], [1], [8])
    assert store.calls[-2][-1].preferred_segment == "b:2"  # the put, then its confirmation
    backend.steer(None)
    assert backend._steer.preferred_segment == "a:1" and backend.prefers_own
    anywhere = MooncakeBackend(FakeStore(), "a:1", prefer_own_segment=False)
    anywhere.steer("b:2")
    assert anywhere._steer.preferred_segment == "b:2" and not anywhere.prefers_own
    anywhere.steer(None)
    assert anywhere._steer is None and not anywhere.prefers_own


class MovingStore(FakeStore):
    """Move tasks: ``rc`` answers each ``create_move_task``; ``states`` (task ->
    status name, or an error code) each ``query_task``."""

    def __init__(self) -> None:
        super().__init__()
        self.rc = 0
        self.states: dict[tuple, object] = {}

    def create_move_task(self, key, source, target):
        self._enter("create_move_task", key, source, target)
        return (len(self.calls), 7), self.rc

    def query_task(self, task):
        self._enter("query_task", task)
        state = self.states.get(task, "PENDING")
        if isinstance(state, int):
            return None, state
        return SimpleNamespace(status=f"TaskStatus.{state}"), 0


def test_move_tasks_are_started_and_their_states_read():
    store = MovingStore()
    backend = MooncakeBackend(store, "a:1")
    task, rc = backend.start_move("k", "a:1", "b:2")
    assert rc == 0 and store.calls[-1] == ("create_move_task", "k", "a:1", "b:2")
    assert backend.move_state(task) == "running"
    for state, seen in (("PROCESSING", "running"), ("SUCCESS", "done"), ("FAILED", "failed"),
                        (-1400, "failed")):
        store.states[task] = state
        assert backend.move_state(task) == seen
    store.rc = -600
    assert backend.start_move("k", "a:1", "b:2") == (None, -600)
    store.raises = {"create_move_task", "query_task"}
    assert backend.start_move("k", "a:1", "b:2") == (None, CLIENT_ERROR)
    assert backend.move_state(task) == "failed"
