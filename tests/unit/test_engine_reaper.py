"""Engine-owned pools go away with their engine: a real memfd of a child process, served
as a node pool (``NodePools.adopt_engine``), and a pool created for one process (an
``process``: SGLang staging and vLLM pools) are removed once that process exited and the
grace period passed, never while it runs; shared pools are never removed (fake Mooncake
registration only)."""

import os
import subprocess
import sys
import time
import uuid

import pytest
from raykv.cache_actors.node.node_pools import NodePools, PoolTable
from raykv.cache_actors.node.pool_memory import PoolBudget, ShmPoolMemory
from raykv.cache_actors.processes import ProcessIdentity
from raykv.cache_actors.shared_memory import SHM_DIR
from raykv.controllers.pool_layout import PoolLayout

from tests.unit.fakes import FakeBackend, ShmStore

LAYOUT = PoolLayout.mha(page_size=4, size=16, layer_num=2, head_num=1, head_dim=8,
                        dtype="bfloat16", itemsize=2)

ENGINE = """
import os, sys
fd = os.memfd_create("sglang_host_pool_test")
os.ftruncate(fd, int(sys.argv[1]))
print(fd, flush=True)
sys.stdin.read()  # lives until its stdin closes
"""




@pytest.fixture
def engine():
    child = subprocess.Popen([sys.executable, "-c", ENGINE, str(LAYOUT.nbytes)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    fd = int(child.stdout.readline())
    path = f"/proc/{child.pid}/fd/{fd}"
    st = os.stat(path)
    yield child, path, (st.st_dev, st.st_ino)
    child.kill()
    child.wait()


@pytest.fixture
def pools():
    prefix = f"raykv.test-{uuid.uuid4().hex[:8]}."
    store = ShmStore(ShmPoolMemory(prefix, PoolBudget(0)), FakeBackend())
    node = NodePools(prefix, store, lambda *_: None)
    yield node, store
    node.close(remove=True)


def test_an_engine_pool_is_removed_after_its_process_exits(engine, pools):
    child, path, inode = engine
    node, store = pools
    assert node.engine_watch.alive() == 0
    node.adopt_engine("sglang-kv", path, LAYOUT, inode)
    assert node.reap_engines(grace_s=0.0) == []  # the engine runs: kept
    assert node.engine_watch.alive() == 1
    assert "sglang-kv" in node.table.pools and store.backend.registered

    child.stdin.close()  # the engine exits without unregistering anything
    child.wait(10)
    assert node.engine_watch.alive() == 0  # gone, though its pool is still mapped
    assert node.reap_engines(grace_s=60.0) == []  # seen gone now; still within the grace
    assert "sglang-kv" in node.table.pools
    time.sleep(0.05)
    assert node.reap_engines(grace_s=0.01) == ["sglang-kv"]
    assert "sglang-kv" not in node.table.pools
    assert not store.backend.registered and store.memory.budget.used == 0
    assert node.reap_engines(grace_s=0.0) == []


def test_a_pool_created_for_one_process_is_removed_after_it_exits(engine, pools):
    child, _, _ = engine
    node, store = pools
    process = ProcessIdentity.of(child.pid)
    node.create("sglang-staging", LAYOUT, process=process)
    node.create("shared-kv", LAYOUT)  # L2 of many ranks: outlives every one of them
    assert node.reap_engines(grace_s=0.0) == []

    child.stdin.close()
    child.wait(10)
    assert node.reap_engines(grace_s=60.0) == []
    time.sleep(0.05)
    assert node.reap_engines(grace_s=0.01) == ["sglang-staging"]
    assert sorted(node.table.pools) == ["shared-kv"]
    assert store.memory.budget.used == LAYOUT.nbytes and len(store.backend.registered) == 1
    assert not os.path.exists(os.path.join(SHM_DIR, node._records.prefix + "sglang-staging"))


def test_a_restarted_node_still_reaps_a_pool_with_its_process(engine, pools):
    """The process is kept in the pool's record: a node actor that restarts (a new
    ``NodePools`` over the same prefix) re-adopts the pool and still removes it once its
    process exited; a shared pool is re-adopted and kept. Control: without the process
    in the record the restarted node never reaps it."""
    child, _, _ = engine
    node, store = pools
    node.create("sglang-staging", LAYOUT, process=ProcessIdentity.of(child.pid))
    node.create("shared-kv", LAYOUT)
    for pool in list(node.table.pools.values()):  # the old actor dies: nothing removed
        store.memory.release(pool, remove=False)
    restarted = NodePools(node._records.prefix, store, lambda *_: None)
    restarted.readopt()
    assert sorted(restarted.table.pools) == ["sglang-staging", "shared-kv"]
    child.stdin.close()
    child.wait(10)
    assert restarted.reap_engines(grace_s=60.0) == []
    time.sleep(0.05)
    assert restarted.reap_engines(grace_s=0.01) == ["sglang-staging"]
    assert sorted(restarted.table.pools) == ["shared-kv"]
    node.table = PoolTable(node.table.epoch)  # released above: the fixture closes none
    restarted.close(remove=True)


def test_a_process_this_machine_does_not_show_is_never_reaped(engine, pools):
    """A process whose pid names another process here (another pid namespace, a reused
    pid) cannot be watched: its pool is kept rather than taken from a live engine."""
    child, _, _ = engine
    node, _ = pools
    me = ProcessIdentity.of(child.pid)
    node.create("elsewhere", LAYOUT, process=ProcessIdentity(me.pid, me.start_ticks + 1))
    node.create("gone", LAYOUT, process=ProcessIdentity(2**22 + 1, 1))
    time.sleep(0.05)
    assert node.reap_engines(grace_s=0.0) == []
    assert sorted(node.table.pools) == ["elsewhere", "gone"]


def test_node_pools_are_never_reaped(pools):
    node, _ = pools
    node.create("kv", LAYOUT)
    assert node.reap_engines(grace_s=0.0) == []
    assert "kv" in node.table.pools


def test_a_reused_pid_is_not_the_process_it_once_named():
    me = ProcessIdentity.of(os.getpid())
    assert me is not None and me.alive()
    assert not ProcessIdentity(me.pid, me.start_ticks + 1).alive()
    assert ProcessIdentity.of(2**22 + 1) is None  # above pid_max: no such process


def test_attached_engines_count_while_they_live_and_once():
    from raykv.cache_actors.node.engine_watch import MAX_CLIENTS, EngineWatch

    class Proc:
        def __init__(self) -> None:
            self.up = True

        def alive(self) -> bool:
            return self.up

    watch, a, b = EngineWatch(), Proc(), Proc()
    watch.attach(a)
    watch.attach(a)
    watch.watch("pool-a", a)
    watch.attach(b)
    assert watch.alive() == 2
    b.up = False
    assert watch.alive() == 1
    for _ in range(MAX_CLIENTS + 5):
        watch.attach(Proc())
    assert len(watch._clients) == MAX_CLIENTS  # bounded, the gone ones dropped first
