"""Where a node's host pools get their memory, and the node's budget for them.

- ``ShmPoolMemory`` (embedded mode): each pool is a ``/dev/shm`` file owned by the node
  actor; it outlives the actor, so a restarted actor re-adopts it with its bytes.
- ``MemfdPoolMemory`` (standalone mode): each pool is one allocation from the real
  ``mooncake_client``'s shared memory through the dummy client (``alloc_from_mem_pool``:
  one memfd of exactly the pool's size, registered on its exact base and size). Ranks map
  it through ``/proc/<actor pid>/fd/<fd>``. The memfd lives only as long as the actor,
  and a restarted ``mooncake_client`` no longer knows it, so after either restart every
  pool is allocated anew under a new epoch (L2 contents are lost; L3 is not).

``PoolMemory`` is the contract both keep (and the shared fake of the unit tests, which a
unit test keeps in step with it). ``PoolBudget`` accounts every pool's bytes once (a
pool is one allocation holding all its buffers: K and V, Mamba temporal and every conv
buffer; views and sidecar pools allocate nothing) against ``host_pool_bytes`` and
refuses a pool that would not fit, before any allocation.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import os
import threading
import time
from typing import Protocol

from raykv.cache_actors.host_pools import HostPool, PoolHandle
from raykv.cache_actors.node.own_files import check_own_file
from raykv.cache_actors.node.store_backend import StoreBackend
from raykv.cache_actors.shared_memory import reserve, shm_path
from raykv.controllers.pool_layout import PoolLayout

log = logging.getLogger(__name__)

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02


class PoolBudget:
    """Bytes of host pools a node may hold: ``limit`` (0: no limit), ``used``.
    Thread-safe: pools of different names are made and released side by side."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"host_pool_bytes must be >= 0, got {limit}")
        self.limit = limit
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, name: str, nbytes: int) -> None:
        """Count ``nbytes`` for pool ``name``; ``ValueError`` naming the numbers if they
        do not fit (nothing is counted then)."""
        with self._lock:
            used = self.used
            if self.limit and used + nbytes > self.limit:
                raise ValueError(
                    f"pool {name!r} needs {nbytes} bytes but this node's host pools already "
                    f"use {used} of host_pool_bytes={self.limit} ({self.limit - used} "
                    "left); raise host_pool_bytes (start_local / `raykv up "
                    "--host-pool-size`) or make the pool smaller")
            self.used = used + nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.used -= nbytes


class PoolMemory(Protocol):
    """Where a node's pools get their memory. ``mode``: ``"embedded"`` or
    ``"standalone"``; ``epoch``: the generation of the memory (``PoolHandle.epoch`` of
    every pool made now); ``budget``: the bytes every live pool counts against. Called
    by ``NodePools`` (under its pool-change rules: one change per name at a time)."""

    mode: str
    epoch: int
    budget: PoolBudget

    def create(self, name: str, layout: PoolLayout) -> HostPool:
        """A new pool ``name`` of ``layout``, mapped here and counted in ``budget``;
        ``ValueError`` (nothing counted, nothing left allocated) if it does not fit."""
        ...

    def readopt(self, handle: PoolHandle) -> HostPool:
        """The pool a previous actor process recorded as ``handle``, counted in
        ``budget``: its bytes (embedded) or fresh memory (standalone); ``ValueError``
        for a record this node would not have written."""
        ...

    def release(self, pool: HostPool, remove: bool = True) -> None:
        """Unmap ``pool`` and stop counting it; ``remove``: its memory goes too (a pool
        kept for the next actor process passes False)."""
        ...

    def renew(self) -> None:
        """Start a new ``epoch``: pools made from now on replace every earlier one
        (standalone, after ``mooncake_client`` restarted). Embedded memory is never
        allocated anew: ``RuntimeError``."""
        ...


class ShmPoolMemory:
    """Embedded mode: pools are ``/dev/shm/<node prefix><name>`` files (epoch 0)."""

    mode = "embedded"
    epoch = 0

    def __init__(self, node_prefix: str, budget: PoolBudget) -> None:
        self._prefix = node_prefix
        self.budget = budget

    def create(self, name: str, layout: PoolLayout) -> HostPool:
        self.budget.reserve(name, layout.nbytes)
        try:
            return HostPool.create(PoolHandle(name, self._prefix + name, layout))
        except BaseException:
            self.budget.release(layout.nbytes)
            raise

    def readopt(self, handle: PoolHandle) -> HostPool:
        """Map a pool this node made before a restart, with its bytes. ``ValueError`` if
        ``handle.path`` is not the file this node gives that name or that file is not
        this uid's own (``check_own_file``): a planted record maps nothing else."""
        if handle.path != self._prefix + handle.name:
            raise ValueError(f"pool {handle.name!r}: recorded path {handle.path!r} is not "
                             f"this node's {self._prefix + handle.name!r}")
        check_own_file(shm_path(handle.path), f"pool file {handle.path!r}")
        self.budget.reserve(handle.name, handle.layout.nbytes)
        try:
            return HostPool.attach(handle, owner=True)  # this node's: removed when it goes
        except BaseException:
            self.budget.release(handle.layout.nbytes)
            raise

    def release(self, pool: HostPool, remove: bool = True) -> None:
        """Unmap ``pool``; with ``remove`` delete its file too, if this node named it (an
        absolute path is an engine's memory, ``engine_memory``: never unlinked)."""
        pool.close(unlink=remove and not pool.handle.path.startswith("/"))
        self.budget.release(pool.nbytes)

    def renew(self) -> None:
        """Never: the files outlive every restart with their bytes (one epoch)."""
        raise RuntimeError("embedded pool memory is never allocated anew")


def _memfd_of(address: int) -> int:
    """The fd of this process that holds the memfd mapped at ``address``."""
    start = f"{address:x}-"
    with open("/proc/self/maps") as f:
        line = next((ln for ln in f if ln.startswith(start)), None)
    if line is None or "memfd:" not in line:
        raise RuntimeError(f"no memfd is mapped at {address:#x}")
    inode = int(line.split()[4])
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:" in os.readlink(f"/proc/self/fd/{fd}") and \
                    os.stat(f"/proc/self/fd/{fd}").st_ino == inode:
                return int(fd)
        except FileNotFoundError:
            continue
    raise RuntimeError(f"the memfd mapped at {address:#x} has no open fd in this process")


def _punch_hole(fd: int, nbytes: int) -> None:
    """Give the pages of memfd ``fd`` back to the system; mappings stay valid (zeros)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, nbytes) != 0:
        log.warning("could not release %d bytes of memfd %d: errno %d", nbytes, fd,
                    ctypes.get_errno())


def punch_when_let_go(fd: int, nbytes: int, name: str) -> None:
    """Give the pages of memfd ``fd`` (pool ``name``) back (``_punch_hole``) once no
    process holds them (``HostPool.held``: a rank copying the pages of a node call out
    of them or into them): under an exclusive ``flock`` of ``fd``, at once if no hold is
    taken now, else on a thread of its own that waits for the last hold to end. So a
    rank never reads holes (zeros) where the bytes of a call it was answered were."""
    def punch() -> None:
        try:
            _punch_hole(fd, nbytes)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        def when_let_go() -> None:
            fcntl.flock(fd, fcntl.LOCK_EX)
            punch()
            log.info("pool %s: the last rank holding its old memory let go; given back",
                     name)
        log.info("pool %s: a rank still copies out of its old memory; given back once it "
                 "let go", name)
        threading.Thread(target=when_let_go, name="raykv-pool-let-go", daemon=True).start()
        return
    punch()


class MemfdPoolMemory:
    """Standalone mode: pools allocated by the dummy client (see the module docstring).

    Mooncake's dummy client has no call to free an allocation, so a released pool keeps
    its address range and fd but its pages are given back (hole punched): only live pools
    hold memory, and only they count against the budget. The pages of a pool a rank
    still holds (``HostPool.held``) are given back once it let go
    (``punch_when_let_go``); the budget stops counting them at once.
    """

    mode = "standalone"

    def __init__(self, backend: StoreBackend, budget: PoolBudget) -> None:
        self._backend = backend
        self.budget = budget
        self.epoch = time.time_ns()
        self._fds: dict[int, int] = {}  # base address -> memfd

    def renew(self) -> None:
        """Start a new epoch: pools made from now on replace every earlier one."""
        self.epoch = time.time_ns()

    def create(self, name: str, layout: PoolLayout) -> HostPool:
        """A pool in a new allocation. Mooncake 0.3.13's allocations come fully backed
        (measured: every page allocated); one that is not is allocated whole here, so
        that no first write to it can fail later (``ValueError`` if memory runs out; its
        pages are given back then)."""
        self.budget.reserve(name, layout.nbytes)
        try:
            ptr = self._backend.alloc(layout.nbytes)
            fd = _memfd_of(ptr)
        except BaseException:
            self.budget.release(layout.nbytes)
            raise
        if os.fstat(fd).st_blocks * 512 < layout.nbytes:
            try:
                reserve(fd, layout.nbytes, f"pool {name!r}", "mooncake_client's memfd")
            except BaseException:
                _punch_hole(fd, layout.nbytes)
                self.budget.release(layout.nbytes)
                raise
        self._fds[ptr] = fd
        handle = PoolHandle(name, f"/proc/{os.getpid()}/fd/{fd}", layout, self.epoch)
        return HostPool.wrap(handle, ptr)

    def readopt(self, handle: PoolHandle) -> HostPool:
        """A pool of the same name and layout in fresh memory (the old memfd died with
        the previous actor process)."""
        return self.create(handle.name, handle.layout)

    def release(self, pool: HostPool, remove: bool = True) -> None:
        """Give the pool's pages back once no rank holds them (``punch_when_let_go``;
        ``remove`` is moot: nothing outlives the actor)."""
        fd = self._fds.pop(pool.base_ptr)
        nbytes = pool.nbytes
        pool.close()
        punch_when_let_go(fd, nbytes, pool.name)
        self.budget.release(nbytes)
