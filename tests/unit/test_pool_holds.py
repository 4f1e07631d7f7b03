"""Holds of a pool's memory (``HostPool.held``) and re-mapping (``HostPool.remap``), on
real memfds in this process: what the node actor gives back (standalone mode's
``MemfdPoolMemory.release``, holes punched) waits for every hold, and a re-map never
unmaps a mapping a thread still copies through."""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time

import pytest
import torch
from raykv.cache_actors.host_pools import HostPool, PoolHandle, mapped_address
from raykv.cache_actors.node.pool_memory import MemfdPoolMemory, PoolBudget
from raykv.controllers.pool_layout import PoolLayout

from tests.unit.memfds import memfd_pool_handle, node_may_release

LAYOUT = PoolLayout.mla(page_size=1, size=16, layer_num=1, kv_cache_dim=256, dtype="uint8",
                        itemsize=1)


class MemfdBackend:
    """The dummy client's ``alloc`` as ``MemfdPoolMemory`` uses it: one memfd of exactly
    the size asked, mapped in this process (here the node actor's)."""

    def __init__(self) -> None:
        self.maps: list[mmap.mmap] = []

    def alloc(self, nbytes: int) -> int:
        fd = os.memfd_create("alloc")
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
        self.maps.append(mmap.mmap(fd, nbytes))
        return mapped_address(self.maps[-1])


def memfd_handle(name: str, fill: int) -> PoolHandle:
    """A pool handle of ``LAYOUT`` on a new memfd of this process, every byte ``fill``."""
    return memfd_pool_handle(name, LAYOUT, fill=fill)


def mapped(address: int) -> bool:
    """Whether a mapping of this process starts at ``address``."""
    with open("/proc/self/maps") as f:
        return any(line.startswith(f"{address:x}-") for line in f)


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_memory_a_rank_holds_is_given_back_only_once_it_let_go():
    """The node releases a pool (``mooncake_client`` restarted: its pools are allocated
    anew) while a rank holds its memory (a shared flock on the rank's own open file of
    it, what ``HostPool.held`` takes), copying out the bytes of a get: the rank reads
    those bytes to the end, the budget stops counting the pool at once, and the pages
    are given back (zeros) once the rank let go. Control (the old release): holes were
    punched at once, and the rank read zeros where its get's bytes were."""
    memory = MemfdPoolMemory(MemfdBackend(), PoolBudget(1 << 20))
    node_pool = memory.create("kv", LAYOUT)
    rank = HostPool.attach(node_pool.handle)  # /proc/<node pid>/fd/<fd>, as a rank maps it
    rank._bytes.fill_(7)  # what a get read into the staging pool
    hold = os.open(node_pool.handle.path, os.O_RDWR)  # the rank's hold: its own file
    fcntl.flock(hold, fcntl.LOCK_SH)
    memory.release(node_pool)
    assert memory.budget.used == 0
    time.sleep(0.2)  # a release that does not wait has punched by now
    assert bool((rank._bytes == 7).all()), "the pages were given back under a hold"
    os.close(hold)  # the rank let go (or died)
    wait_until(lambda: not rank._bytes.any(), "the pages given back after the hold")
    rank.close()


def test_a_hold_is_one_shared_lock_per_process_until_the_last_hold_ends():
    """Holds of two threads of one process share its one open file's lock: the node's
    exclusive lock is refused until the last of them ended (not the first)."""
    handle = memfd_handle("held", 1)
    node_fd = os.open(handle.path, os.O_RDWR)
    pool = HostPool.attach(handle)

    first = pool.held()
    first.__enter__()
    second_in, second_out = threading.Event(), threading.Event()

    def second() -> None:
        with pool.held():
            second_in.set()
            second_out.wait()

    t = threading.Thread(target=second)
    t.start()
    second_in.wait()
    assert pool.holds == 2 and not node_may_release(node_fd)
    first.__exit__(None, None, None)
    assert pool.holds == 1 and not node_may_release(node_fd)
    second_out.set()
    t.join()
    assert pool.holds == 0 and node_may_release(node_fd)
    pool.close()
    os.close(node_fd)


def test_a_remap_leaves_the_old_mapping_to_the_views_still_copying_through_it():
    """Another thread of the rank re-maps the pool (the node allocated it anew) while
    this one copies through views of it: the old mapping stays mapped under those views
    and the pool held for a transfer stays on the old memory, while the pool maps the
    new memory from now on. Control (the old remap): the old mapping was unmapped in
    place under the live views (a copy through them: SIGSEGV, checked here without
    touching them)."""
    old, new = memfd_handle("gen1", 1), memfd_handle("gen2", 2)
    pool = HostPool.attach(old)
    view = pool.kv_buffer  # a copy thread's views, taken before the re-map
    address = pool.base_ptr
    pool.remap(new)
    assert mapped(address), "the old mapping was unmapped under a live view"
    assert bool((view == 1).all()) and bool((pool.kv_buffer == 2).all())
    assert pool.handle == new and pool.base_ptr != address
    with pool.held() as held:
        pool.remap(old)  # a second re-map while a transfer holds the pool
        assert held.handle == new and bool((held.kv_buffer == 2).all())
        assert bool((pool.kv_buffer == 1).all())
    with pytest.raises(ValueError, match="changed layout"):
        pool.remap(PoolHandle("gen3", new.path, PoolLayout.mla(
            page_size=1, size=8, layer_num=1, kv_cache_dim=256, dtype="uint8", itemsize=1)))
    del view
    pool.close()


def test_a_dropped_mapping_is_unmapped_once_its_last_view_is_gone():
    """A mapping a re-map replaced is unmapped when nothing refers to it any more (its
    views gone), never before: no mapping is left behind either."""
    pool = HostPool.attach(memfd_handle("gen1", 1))
    view = pool.kv_buffer
    address = pool.base_ptr
    pool.remap(memfd_handle("gen2", 2))
    assert mapped(address)
    del view
    assert not mapped(address)
    assert torch.equal(pool.kv_buffer, torch.full_like(pool.kv_buffer, 2))
    pool.close()
