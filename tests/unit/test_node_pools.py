"""The node's pool table under change.

- Re-allocation: a data call resolving its batch while the pools are being replaced gets
  ``StalePoolsError``, never a ``ValueError`` (fake store and memory; the real race is in
  tests/integration/test_standalone.py).
- Teardown against transfers in flight (real shared memory, a fake store call held open):
  a pool leaving by destroy, the engine reaper, close or re-allocation is released only
  once the store calls reading it ended (tests/integration/test_pool_teardown.py: the
  same with real Ray and Mooncake).
- Restart records: planted or broken ``<prefix><name>.json`` files are skipped, never
  mapped, never fatal (tests/integration/test_restart_metadata.py: a real actor killed).
"""

import ctypes
import glob
import json
import os
import stat
import subprocess
import sys
import threading
import uuid
import zlib
from dataclasses import asdict, dataclass

import pytest
import torch
from raykv.cache_actors.errors import StalePoolsError
from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.node_pools import NodePools
from raykv.cache_actors.node.node_service import NodeService
from raykv.cache_actors.node.pool_memory import MemfdPoolMemory, PoolBudget, ShmPoolMemory
from raykv.controllers.object_batch import MAX_BATCH_OBJECTS, ObjectBatch, check_object_keys
from raykv.controllers.pool_layout import PoolLayout

from tests.unit.fakes import FakeBackend, FakeMemory, NoMetrics, ServiceStore, ShmStore
from tests.unit.test_engine_reaper import ENGINE

LAYOUT = PoolLayout.mla(page_size=1, size=4, layer_num=1, kv_cache_dim=8, dtype="uint8",
                        itemsize=1)


@dataclass
class FakeStore:
    memory: FakeMemory
    backend: FakeBackend
    mode: str = "embedded"

    def before_call(self) -> int:
        return self.memory.epoch


@pytest.fixture
def pools():
    store = FakeStore(FakeMemory(), FakeBackend())
    node = NodePools(f"raykv.test-{uuid.uuid4().hex[:8]}.", store, lambda *_: None)
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
    assert node.table.resolve(batch_of(old))[0] == [node.table.pools["kv"].base_ptr + 8]

    memory.gate.clear()
    memory.creating.clear()
    realloc = threading.Thread(target=node.reallocate)
    realloc.start()
    assert memory.creating.wait(5)  # old pool released, new one not yet made
    with pytest.raises(StalePoolsError, match="allocated anew"):
        node.table.resolve(batch_of(old))[0]
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
        node.table.resolve(batch_of(old))[0]
    assert node.table.resolve(batch_of(new))[0] == [node.table.pools["kv"].base_ptr + 8]


def test_a_table_once_read_never_changes(pools):
    node, _ = pools
    node.create("kv", LAYOUT)
    snapshot = node.table
    node.create("draft", LAYOUT)
    node.destroy("kv")
    assert set(snapshot.pools) == {"kv"} and set(node.table.pools) == {"draft"}
    with pytest.raises(TypeError):
        snapshot.pools["x"] = None


# --------------------------------------------------------------------------------------
# Teardown against transfers in flight: real shared-memory pools (a /dev/shm file, or a
# memfd whose pages are given back as in standalone mode), a fake store whose put is held
# inside the "store call" while the pool is being destroyed.


def mapped(ptr: int, nbytes: int) -> bool:
    """Whether ``[ptr, ptr + nbytes)`` lies in one mapping of this process."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr and ptr + nbytes <= hi:
                return True
    return False


def page(key: str, nbytes: int) -> bytes:
    """The bytes a writer puts under ``key``: a pattern derived from the key (never 0s)."""
    seed = (zlib.crc32(key.encode()) % 250) + 1
    return bytes((seed + i) % 255 + 1 for i in range(nbytes))


class HeldBackend(FakeBackend):
    """The shared fake backend whose ``put`` reads every object's bytes like Mooncake
    does, but first waits inside the call until ``release`` is set (or ``hold_s``
    passed): the window in which the test tears the pool down. Reading an unmapped
    pointer would crash the test process, so it records ``"unmapped"`` instead. Its
    ``alloc`` serves standalone mode's pool memory."""

    def __init__(self, hold_s: float = 2.0) -> None:
        super().__init__()
        self.hold_s = hold_s
        self.entered = threading.Event()
        self.release = threading.Event()
        self.stored: dict[str, bytes | str] = {}

    def put(self, keys, ptrs, sizes):
        self.entered.set()
        self.release.wait(self.hold_s)
        for k, p, s in zip(keys, ptrs, sizes, strict=True):
            self.stored[k] = ctypes.string_at(p, s) if mapped(p, s) else "unmapped"
        return [0] * len(keys)

    def remove(self, keys):
        for k in keys:
            self.stored.pop(k, None)
        return [0] * len(keys)


class RealStore(ServiceStore):
    """The parts of ``NodeStore`` a ``NodeService`` uses, over real pool memory."""

    def __init__(self, mode: str, prefix: str) -> None:
        self.backend = HeldBackend()
        if mode == "embedded":
            self.memory = ShmPoolMemory(prefix, PoolBudget(0))
        else:
            self.memory = MemfdPoolMemory(self.backend, PoolBudget(1 << 30))
        self.mode = mode


POOL = PoolLayout.mla(page_size=1, size=64, layer_num=2, kv_cache_dim=256, dtype="uint8",
                      itemsize=1)  # 512-byte pages


@pytest.fixture(params=["embedded", "standalone"])
def service(request):
    prefix = f"raykv.test-{uuid.uuid4().hex[:8]}."
    store = RealStore(request.param, prefix)
    node = NodeService("fake-node-id", prefix, store, NoMetrics(), lambda _: None,
                       segment_size=0, group_window_s=0.0, confirm_ttl_s=0.0)
    yield node, store
    store.backend.release.set()
    node.shutdown(remove_pools=True)


def written_batch(node: NodeService, uid: str, n: int = 4) -> ObjectBatch:
    """Pool "kv" created and ``n`` checksummed pages written into it through a rank's
    own mapping; the batch that puts them."""
    handle = node.create_pool("kv", POOL)
    rank = HostPool.attach(handle)
    size = POOL.object_sizes[0]
    batch = ObjectBatch(epoch=handle.epoch)
    for i in range(n):
        key = f"{uid}-{i}"
        rank.kv_buffer.view(-1)[i * size:(i + 1) * size] = torch.frombuffer(
            bytearray(page(key, size)), dtype=torch.uint8)
        batch.add(key, "kv", i * size, size)
    rank.close()
    return batch


def expected(batch: ObjectBatch) -> dict[str, bytes]:
    return {k: page(k, s) for k, s in zip(batch.keys, batch.sizes, strict=True)}


def test_destroy_waits_for_the_put_that_reads_the_pool(service):
    node, store = service
    batch = written_batch(node, "w")
    put = threading.Thread(target=node.put, args=(batch,))
    put.start()
    assert store.backend.entered.wait(10)  # the put is inside its store call

    destroyed = threading.Event()

    def destroy() -> None:
        assert node.destroy_pool("kv")
        destroyed.set()
        store.backend.release.set()  # (old code) the put reads after destroy returned
    teardown = threading.Thread(target=destroy)
    teardown.start()
    while "kv" in node._pools.table.pools:
        teardown.join(0.01)
    with pytest.raises(ValueError, match="'kv'"):  # new calls no longer see kv at once
        node.put(batch)
    returned_during_put = destroyed.wait(0.5)
    store.backend.release.set()
    put.join(10)
    teardown.join(10)
    # Every object stored holds what its writer wrote: never unmapped memory (a crash
    # in Mooncake), never the zeros of a pool whose pages were given back.
    assert store.backend.stored == expected(batch)
    assert not returned_during_put and destroyed.is_set()
    assert not store.backend.registered and store.memory.budget.used == 0


def test_a_stuck_put_keeps_the_pool_mapped_until_it_ends(service, caplog):
    node, store = service
    node._pools._drain_s = 0.2  # the bounded wait runs out
    batch = written_batch(node, "s")
    base = node._pools.table.pools["kv"].base_ptr
    put = threading.Thread(target=node.put, args=(batch,))
    store.backend.hold_s = 60
    put.start()
    assert store.backend.entered.wait(10)
    assert node.destroy_pool("kv")  # returns after the wait, the pool parked
    parked = mapped(base, POOL.nbytes), base in store.backend.registered
    store.backend.release.set()
    put.join(10)
    assert store.backend.stored == expected(batch)
    assert parked == (True, True) and "kv" not in node._pools.table.pools
    assert "still use it" in caplog.text
    # released by the put's own leave, as soon as it ended
    assert base not in store.backend.registered and store.memory.budget.used == 0
    if store.mode == "embedded":
        assert not mapped(base, POOL.nbytes)


def test_close_waits_for_calls_in_flight(service):
    node, store = service
    batch = written_batch(node, "c")
    put = threading.Thread(target=node.put, args=(batch,))
    put.start()
    assert store.backend.entered.wait(10)

    def close() -> None:
        node._pools.close(True)
        store.backend.release.set()  # (old code) the put reads after close returned
    closing = threading.Thread(target=close)
    closing.start()
    closing.join(0.5)
    closed_during_put = not closing.is_alive()
    store.backend.release.set()
    put.join(10)
    closing.join(10)
    assert store.backend.stored == expected(batch)
    assert not closed_during_put and not closing.is_alive()


def test_a_pool_destroyed_between_resolve_and_store_call_is_refused(service):
    node, store = service
    batch = written_batch(node, "r")
    pools = node._pools
    table = pools.table
    _, used = table.resolve(batch)
    assert pools.destroy("kv")
    with pytest.raises(ValueError, match="destroyed"):
        pools.enter(table, used)
    assert store.backend.stored == {}


@pytest.fixture
def engine_memfd():
    """A child process holding a memfd the size of ``POOL`` (an SGLang engine's pool)."""
    child = subprocess.Popen([sys.executable, "-c", ENGINE, str(POOL.nbytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fd = int(child.stdout.readline())
    yield child, f"/proc/{child.pid}/fd/{fd}"
    child.kill()
    child.wait()


def test_the_engine_reaper_waits_for_a_put_on_the_engine_pool(engine_memfd):
    child, path = engine_memfd
    prefix = f"raykv.test-{uuid.uuid4().hex[:8]}."
    store = RealStore("embedded", prefix)
    node = NodeService("fake-node-id", prefix, store, NoMetrics(), lambda _: None,
                       segment_size=0, group_window_s=0.0, confirm_ttl_s=0.0)
    try:
        st = os.stat(path)  # the memfd's identity, as the engine would send it
        handle = node.adopt_engine_pool("engine-kv", path, POOL, (st.st_dev, st.st_ino))
        engine = HostPool.attach(handle)
        size = POOL.object_sizes[0]
        engine.kv_buffer.view(-1)[:size] = torch.frombuffer(bytearray(page("e-0", size)),
                                                            dtype=torch.uint8)
        engine.close()
        batch = ObjectBatch(["e-0"], ["engine-kv"], [0], [size], handle.epoch)
        put = threading.Thread(target=node.put, args=(batch,))
        put.start()
        assert store.backend.entered.wait(10)
        child.stdin.close()  # the engine dies while its pages are being stored
        child.wait(10)
        reaped: list[list[str]] = []
        reaper = threading.Thread(target=lambda: reaped.append(
            node._pools.reap_engines(grace_s=0.0)))
        reaper.start()
        reaper.join(0.5)
        assert reaper.is_alive()  # the pool stays while the put reads it
        store.backend.release.set()
        put.join(10)
        reaper.join(10)
        assert reaped == [["engine-kv"]]
        assert store.backend.stored == {"e-0": page("e-0", size)}
    finally:
        store.backend.release.set()
        node.shutdown(remove_pools=True)


def test_reallocation_releases_old_pools_only_after_their_calls(pools):
    node, memory = pools
    released: list[str] = []
    memory.release = lambda pool, remove=True: released.append(pool.name)
    handle = node.create("kv", LAYOUT)
    table = node.table
    _, used = table.resolve(batch_of(handle))
    node.enter(table, used)
    realloc = threading.Thread(target=node.reallocate)
    realloc.start()
    realloc.join(0.3)
    assert realloc.is_alive() and released == []
    with pytest.raises(StalePoolsError):
        node.enter(table, used)  # a call resolved from the old table never starts
    node.leave(used)
    realloc.join(10)
    assert released == ["kv"] and node.handle("kv", "t").epoch == handle.epoch + 1


# --------------------------------------------------------------------------------------
# Restart records: what a restarted actor re-adopts from /dev/shm.




def shm_node(prefix: str) -> NodePools:
    """A node's pools as a (re)started actor has them: a fresh ``NodePools`` over the
    same ``/dev/shm`` prefix, its records re-adopted."""
    node = NodePools(prefix, ShmStore(ShmPoolMemory(prefix, PoolBudget(0)), FakeBackend()),
                     lambda *_: None)
    node.readopt()
    return node


def record(prefix: str, stem: str, **fields) -> str:
    """Write a pool record ``<prefix><stem>.json`` like a valid one of pool ``kv``,
    with ``fields`` replaced; returns its path."""
    raw = {"name": stem, "path": prefix + stem, "layout": asdict(POOL)} | fields
    path = f"/dev/shm/{prefix}{stem}.json"
    with open(path, "w") as f:
        json.dump(raw, f)
    os.chmod(path, 0o600)
    return path


def test_records_are_written_atomically_and_private(shm_prefix):
    node = shm_node(shm_prefix)
    node.create("kv", POOL)
    path = f"/dev/shm/{shm_prefix}kv.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    with open(path) as f:
        assert json.load(f)["path"] == shm_prefix + "kv"
    assert glob.glob(f"/dev/shm/{glob.escape(shm_prefix)}*.tmp") == []
    node.close(remove=False)
    again = shm_node(shm_prefix)
    assert set(again.table.pools) == {"kv"}
    again.close(remove=True)


def test_planted_and_broken_records_are_skipped_and_never_mapped(shm_prefix, tmp_path,
                                                                  caplog):
    node = shm_node(shm_prefix)
    node.create("kv", POOL)
    node.close(remove=False)  # the actor dies; its pool and record stay

    target = tmp_path / "target"
    target.write_bytes(b"\x01" * POOL.nbytes)
    bad = {
        "absolute": record(shm_prefix, "absolute", path=str(target)),
        "dots": record(shm_prefix, "dots", name="../dots", path=shm_prefix + "../dots"),
        "other-name": record(shm_prefix, "other-name", name="kv"),
        "bad-layout": record(shm_prefix, "bad-layout",
                             layout=asdict(POOL) | {"page_size": 0}),
        "not-a-dict": record(shm_prefix, "not-a-dict", layout=[1, 2]),
    }
    truncated = f"/dev/shm/{shm_prefix}truncated.json"
    with open(truncated, "w") as f:
        f.write(json.dumps({"name": "truncated", "path": shm_prefix + "truncated"})[:25])
    bad["truncated"] = truncated
    writable = record(shm_prefix, "writable")
    os.chmod(writable, 0o666)
    bad["writable"] = writable
    link = f"/dev/shm/{shm_prefix}link.json"
    os.symlink(f"/dev/shm/{shm_prefix}kv.json", link)
    # a record that looks right, for a pool file that is not this uid's own
    HostPool.create(PoolHandle("foreign-pool", shm_prefix + "foreign-pool", POOL)).close()
    record(shm_prefix, "foreign-pool")
    foreign = []
    if os.getuid() == 0:  # a record of another user (only root can make one here)
        os.chown(f"/dev/shm/{shm_prefix}foreign-pool", 65534, 65534)
        foreign.append(record(shm_prefix, "foreign"))
        os.chown(foreign[0], 65534, 65534)

    again = shm_node(shm_prefix)  # the restarted actor: starts, whatever it found
    assert set(again.table.pools) == {"kv"}
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert str(target) not in maps and "dots" not in maps
    for path in bad.values():  # this uid's own refused records are set aside
        assert not os.path.lexists(path) and os.path.lexists(path + ".bad")
    for path in foreign:  # another user's file is left alone (and never trusted)
        assert os.path.exists(path)
        assert "belongs to uid 65534" in caplog.text
    assert "writable by group or others" in caplog.text
    again.close(remove=True)


@pytest.mark.parametrize("raw", [
    b"", b"{", b"[]", b'{"name": 1, "path": "x", "layout": {}}', b"\xff\xfe",
    b'{"name": "kv", "path": "x"}', b'{"name": "kv", "path": 3, "layout": null}',
])
def test_record_parsing_refuses_garbage(shm_prefix, raw):
    node = NodePools(shm_prefix, ShmStore(ShmPoolMemory(shm_prefix, PoolBudget(0)),
                                          FakeBackend()), lambda *_: None)
    path = f"/dev/shm/{shm_prefix}kv.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, raw)
    os.close(fd)
    with pytest.raises(ValueError):
        node._records.read(path)
    node.readopt()  # never raises
    assert not node.table.pools


def test_standalone_readopt_never_maps_the_recorded_path(tmp_path):
    memory = MemfdPoolMemory(FakeBackend(), PoolBudget(1 << 30))
    target = tmp_path / "target"
    target.write_bytes(b"\x01" * POOL.nbytes)
    pool = memory.readopt(PoolHandle("kv", str(target), POOL))
    with open("/proc/self/maps") as f:
        assert str(target) not in f.read()
    assert pool.handle.path.startswith("/proc/") and bytes(pool._bytes[:4].tolist()) == \
        b"\0\0\0\0"
    memory.release(pool)


# --------------------------------------------------------------------------------------
# Batches are type-checked and bounded before they are resolved (and merged with other
# ranks' batches into one store call).


def one(key=None, pool="kv", off=8, size=8, epoch=1) -> ObjectBatch:
    return ObjectBatch(["k" if key is None else key], [pool], [off], [size], epoch)


@pytest.mark.parametrize(("batch", "msg"), [
    (one(key=1), "key 0 is 1 \\(int\\)"),
    (one(key=b"k"), "key 0 is b'k' \\(bytes\\)"),
    (one(key=""), "key 0 is ''"),
    (one(off=0.5), r"offsets\[0\] is 0.5 \(float\)"),
    (one(off=8.0), r"offsets\[0\] is 8.0"),
    (one(size=True), r"sizes\[0\] is True \(bool\)"),
    (one(size="8"), r"sizes\[0\] is '8'"),
    (one(pool=3), "pool names"),
    (one(pool=["kv"]), "pool names"),
    (one(epoch=1.0), "epoch is 1.0"),
    (one(epoch=True), "epoch is True"),
    (ObjectBatch("kk", ["kv"] * 2, [0, 8], [8, 8], 1), "must be a list"),
    (ObjectBatch(["a", "b"], ["kv"], [0, 8], [8, 8], 1), "differ in length"),
    (ObjectBatch(["a", "a"], ["kv"] * 2, [0, 8], [8, 8], 1), "repeats a key"),
    (ObjectBatch(["a"], ["kv"], (0.5,), (8,), 1), r"offsets\[0\] is 0.5"),
])
def test_ill_typed_batches_are_refused_before_any_pointer(pools, batch, msg):
    node, _ = pools
    node.create("kv", LAYOUT)
    with pytest.raises(ValueError, match=msg):
        node.table.resolve(batch)


def test_numpy_integers_are_taken_as_ints(pools):
    np = pytest.importorskip("numpy")
    node, _ = pools
    node.create("kv", LAYOUT)
    batch = ObjectBatch(["k"], ["kv"], [np.int64(8)], [np.uint32(8)], np.int64(1))
    ptrs, _ = node.table.resolve(batch)
    assert ptrs == [node.table.pools["kv"].base_ptr + 8]
    assert type(batch.offsets[0]) is int and type(batch.sizes[0]) is int
    assert type(batch.epoch) is int


def test_batches_and_key_lists_are_bounded(pools):
    node, _ = pools
    node.create("kv", LAYOUT)
    n = MAX_BATCH_OBJECTS + 1
    batch = ObjectBatch([f"k{i}" for i in range(n)], ["kv"] * n, [0] * n, [8] * n, 1)
    with pytest.raises(ValueError, match=f"{n} objects; at most MAX_BATCH_OBJECTS"):
        node.table.resolve(batch)
    with pytest.raises(ValueError, match="MAX_BATCH_OBJECTS"):
        check_object_keys(batch.keys)
    assert check_object_keys(("a", "b")) == ["a", "b"]
    for bad in ("ab", [b"a"], ["a", None], {"a"}):
        with pytest.raises(ValueError):
            check_object_keys(bad)


def test_a_pool_readopted_after_a_restart_is_removed_with_its_file(shm_prefix):
    """A node actor restarts and re-adopts its pool (its file and bytes); when that pool
    is destroyed (an engine's close, the reaper, the actor stopping for good), its
    shared-memory file goes too, as a pool the actor made itself. Control (the rule
    before: a re-adopted pool was only attached, never its owner): the file stayed, its
    memory held in ``/dev/shm`` for good while the budget counted it free."""
    first = shm_node(shm_prefix)
    first.create("kv", POOL)
    path = f"/dev/shm/{shm_prefix}kv"
    for pool in list(first.table.pools.values()):  # the actor dies: nothing removed
        first._store.memory.release(pool, remove=False)
    restarted = shm_node(shm_prefix)
    assert "kv" in restarted.table.pools and os.path.exists(path)
    assert restarted.destroy("kv")
    assert not os.path.exists(path)
    assert not os.path.exists(path + ".json")
